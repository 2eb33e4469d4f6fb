"""Start an exportable SmolLM2 drafter from the shipped default (which is not exportable) for fine-tuning.

The shipped default drafter has no QK-norm and a learned mask embedding, which no serving engine's Qwen3 draft
layer represents. This writes a twin that has both and every other weight copied: the mask token is the vocabulary
token whose embedding is nearest in cosine to the learned mask vector, and each layer's QK-norm gain is the mean
per-head RMS of the source drafter's queries / keys while it drafts a few prompts (so that normalised queries and keys
keep their usual scale; gains of 1 shrink the attention logits and the twin drafts noise). The twin still drafts
differently (per-token RMS varies, the mask slots see another vector), so fine-tune it before use, e.g.

    python examples/make_exportable_drafter.py --out runs/exportable-init
    dspark-hf train --set init_drafter=runs/exportable-init data=data/smollm2/train.npz \
        heldout=data/smollm2/heldout.npz output_dir=runs/exportable max_steps=300 batch_size=2 seq_len=256 \
        num_anchors=64 train_vocab_size=16384 mixed_precision=bf16 eval_batches=4 eval_every=100 save_every=25
"""

import argparse

import torch

from dspark_hf import DSparkConfig, DSparkDraftModel
from dspark_hf.default import DEFAULT_DRAFTER_DIR, load_default_target


PROMPTS = [
    "Explain how a rainbow forms, step by step.",
    "Write a short Python function that checks whether a number is prime.",
    "What are three good habits for staying healthy? Answer briefly.",
    "Tom has 3 apples and buys 5 more. He gives 2 away. How many are left?",
]


@torch.no_grad()
def qk_scales(drafter, target, tokenizer, max_new_tokens: int = 48) -> dict[str, float]:
    """Mean per-head RMS of every layer's query and key projections while `drafter` drafts a few prompts."""
    sums, counts, hooks = {}, {}, []
    head_dim = drafter.config.head_dim
    for i, layer in enumerate(drafter.layers):
        for kind in ("q", "k"):
            name = f"layers.{i}.self_attn.{kind}_norm.weight"

            def record(module, inputs, output, name=name):
                rms = output.float().unflatten(-1, (-1, head_dim)).pow(2).mean(-1).sqrt()
                sums[name] = sums.get(name, 0.0) + float(rms.sum())
                counts[name] = counts.get(name, 0) + rms.numel()

            hooks.append(getattr(layer.self_attn, f"{kind}_proj").register_forward_hook(record))
    try:
        for prompt in PROMPTS:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
            )
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: sums[name] / counts[name] for name in sums}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER_DIR))
    args = parser.parse_args()
    target, tokenizer = load_default_target()
    source = DSparkDraftModel.from_pretrained(args.drafter)
    source.config.verify_policy = "fixed"
    scales = qk_scales(source, target, tokenizer)
    if source.mask_embedding is None:
        raise SystemExit(f"{args.drafter} already uses a vocabulary mask token.")
    embed = target.get_input_embeddings().weight.detach()
    special = {source.config.bos_token_id, source.config.eos_token_id, source.config.pad_token_id}
    cosine = torch.nn.functional.cosine_similarity(embed, source.mask_embedding.detach()[None], dim=-1)
    cosine[[t for t in special if t is not None]] = -2.0
    mask_token = int(cosine.argmax())
    fields = {**source.config.to_diff_dict(), "use_qk_norm": True, "mask_token_id": mask_token}
    for key in ("model_type", "transformers_version", "architectures", "dtype"):
        fields.pop(key, None)
    twin = DSparkDraftModel(DSparkConfig(**fields))
    state = {k: v for k, v in source.state_dict().items() if k != "mask_embedding"}
    missing, unexpected = twin.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing), missing
    with torch.no_grad():
        for name in missing:
            twin.get_parameter(name).fill_(scales[name])
    twin.config.verify_policy = DSparkDraftModel.from_pretrained(args.drafter).config.verify_policy
    twin.save_pretrained(args.out)
    gains = ", ".join(f"{k.removeprefix('layers.').replace('.self_attn.', ' ')} {v:.2f}" for k, v in scales.items())
    print(f"wrote {args.out}: mask token {mask_token} (cosine {float(cosine[mask_token]):.3f}); QK-norm gains {gains}")


if __name__ == "__main__":
    main()
