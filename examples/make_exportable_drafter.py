"""Start an exportable SmolLM2 drafter from the shipped default (which is not exportable) for fine-tuning.

The shipped default drafter has no QK-norm and a learned mask embedding, which no serving engine's Qwen3 draft
layer represents. This writes a twin that has both (QK-norm gains 1, the mask token = the vocabulary token whose
embedding is nearest in cosine to the learned mask vector) and every other weight copied. The twin drafts
differently (QK-norm rescales attention scores), so fine-tune it before use, e.g.

    python examples/make_exportable_drafter.py --out runs/exportable-init
    dspark-hf train --set init_drafter=runs/exportable-init data=data/smollm2/train.npz \
        heldout=data/smollm2/heldout.npz output_dir=runs/exportable max_steps=300 batch_size=2 seq_len=256 \
        num_anchors=64 train_vocab_size=16384 mixed_precision=bf16 eval_batches=4 eval_every=100 save_every=25
"""

import argparse

import torch

from dspark_hf import DSparkConfig, DSparkDraftModel
from dspark_hf.default import DEFAULT_DRAFTER_DIR, load_default_target


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER_DIR))
    args = parser.parse_args()
    target, _ = load_default_target()
    source = DSparkDraftModel.from_pretrained(args.drafter)
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
            twin.get_parameter(name).fill_(1.0)
    twin.save_pretrained(args.out)
    print(f"wrote {args.out}: mask token {mask_token} (cosine {float(cosine[mask_token]):.3f}), QK-norm gains 1")


if __name__ == "__main__":
    main()
