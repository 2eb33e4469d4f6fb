"""Turn the shipped default drafter (no QK-norm, a learned mask vector) into an exportable one (QK-norm, a vocabulary
mask token) that drafts what the default drafts.

QK-norm: a per-head RMSNorm `g * x / sqrt(mean(x^2) + eps)` is linear, `x * g / sqrt(eps)`, while `mean(x^2)` is
far below `eps`. So the twin keeps the default's attention exactly (to a relative error below `--tolerance`) when
its q/k projections are the default's scaled by a power of two `c` (exact in bf16 and fp32) small enough that
`c^2 * mean(x^2) <= 2 * tolerance * eps` for the largest per-head mean square measured (times `--headroom`), and
its QK-norm gains are `sqrt(eps) / c`. Export such a drafter in float32 or bf16 (`--outtype f32` for GGUF): its
q/k weights are ~1e-8, below float16's range. Do not fine-tune it with Adam as it is (its steps would swamp the tiny
q/k weights); fine-tune the default and make the twin afterwards.

Mask token: no vocabulary embedding equals the learned mask vector. The candidates are the `--candidates` tokens
whose target embeddings are nearest to it in cosine (special tokens excluded); each is scored by the trainer's own
held-out evaluation (teacher-forced greedy τ on fixed batches), and the best one is kept. The `--baseline` drafter
is scored in the same run for comparison.

    python tools/make_exportable_drafter.py --drafter runs/src --out-masked runs/masked   # pick the mask token
    dspark-hf train --set init_drafter=runs/masked distil_from=runs/src ...      # distil the source (docs/engines.md)
    python tools/make_exportable_drafter.py --drafter runs/distil/best --out runs/exportable  # exact QK-norm twin

The shipped default was made this way from stage 7 (2026-12-06) and is exportable already; `--drafter` must be a
drafter without QK-norm (the default's own twin cannot be made again).
"""

import argparse
import json
import math
import shutil
import time
from pathlib import Path

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
def qk_mean_squares(drafter, target, tokenizer, max_new_tokens: int = 48) -> dict[str, float]:
    """Largest per-head mean square of every layer's query and key projections while `drafter` drafts a few
    prompts (keys include the projected target context)."""
    peaks, hooks = {}, []
    head_dim = drafter.config.head_dim
    for i, layer in enumerate(drafter.layers):
        for kind in ("q", "k"):
            name = f"layers.{i}.self_attn.{kind}"

            def record(module, inputs, output, name=name):
                ms = output.float().unflatten(-1, (-1, head_dim)).pow(2).mean(-1)
                peaks[name] = max(peaks.get(name, 0.0), float(ms.max()))

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
    return peaks


def with_mask_token(source: DSparkDraftModel, mask_token: int) -> DSparkDraftModel:
    """The source (no QK-norm) with `mask_token`'s embedding in its mask slots instead of its learned vector: the
    form to fine-tune before `exportable_twin` (Adam cannot train the twin's tiny q/k weights)."""
    fields = {**source.config.to_diff_dict(), "mask_token_id": mask_token}
    for key in ("model_type", "transformers_version", "architectures", "dtype"):
        fields.pop(key, None)
    model = DSparkDraftModel(DSparkConfig(**fields)).to(source.dtype)
    model.load_state_dict({k: v for k, v in source.state_dict().items() if k != "mask_embedding"})
    model.config.verify_policy = source.config.verify_policy
    return model


def exportable_twin(source: DSparkDraftModel, mask_token: int, peaks: dict, tolerance: float, headroom: float):
    """The source with QK-norm in its linear regime and `mask_token` as its mask; returns (twin, shifts)."""
    fields = {**source.config.to_diff_dict(), "use_qk_norm": True, "mask_token_id": mask_token}
    for key in ("model_type", "transformers_version", "architectures", "dtype"):
        fields.pop(key, None)
    twin = DSparkDraftModel(DSparkConfig(**fields)).to(source.dtype)
    state = {k: v for k, v in source.state_dict().items() if k != "mask_embedding"}
    missing, unexpected = twin.load_state_dict(state, strict=False)
    if unexpected or not all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing):
        raise SystemExit(f"unexpected weights: missing {missing}, unexpected {unexpected}")
    eps = source.config.rms_norm_eps
    shifts = {}
    with torch.no_grad():
        for name, peak in peaks.items():
            # c = 2^-k with c^2 * peak * headroom <= 2 * tolerance * eps
            k = max(0, math.ceil(0.5 * math.log2(peak * headroom / (2 * tolerance * eps))))
            shifts[name] = k
            twin.get_parameter(f"{name}_proj.weight").mul_(2.0**-k)
            twin.get_parameter(f"{name}_norm.weight").fill_(math.sqrt(eps) * 2.0**k)
    twin.config.verify_policy = source.config.verify_policy
    return twin, shifts


def heldout_tau(drafters: dict, target, heldout: str, batches: int, seq_len: int, batch_size: int) -> dict:
    """The trainer's own held-out evaluation (fixed seeded batches, the full vocabulary) of each drafter."""
    from dspark_hf.training.config import DSparkTrainingConfig
    from dspark_hf.training.dataset import TokenDataset
    from dspark_hf.training.trainer import DSparkTrainer

    dataset = TokenDataset.load(heldout)
    results = {}
    for name, drafter in drafters.items():
        config = DSparkTrainingConfig(
            data=heldout,
            heldout=heldout,
            output_dir="/tmp/unused",
            batch_size=batch_size,
            seq_len=seq_len,
            num_anchors=64,
            eval_batches=batches,
            shortlist_draft_vocab=False,
        )
        trainer = DSparkTrainer(config, target, dataset=dataset, drafter=drafter)
        trainer.heldout = dataset
        start = time.perf_counter()
        results[name] = trainer.evaluate()
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(name, json.dumps(results[name]), flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the exportable twin here")
    parser.add_argument("--out-masked", help="write the source with the chosen mask token (no QK-norm) here")
    parser.add_argument("--drafter", default=str(DEFAULT_DRAFTER_DIR), help="source drafter without QK-norm")
    parser.add_argument("--baseline", default=str(DEFAULT_DRAFTER_DIR), help="scored beside the twin")
    parser.add_argument("--heldout", default="data/smollm2/heldout.npz", help="token data to score drafters on")
    parser.add_argument("--candidates", type=int, default=4, help="mask tokens tried (nearest in cosine first)")
    parser.add_argument("--mask-tokens", help="comma-separated mask tokens to try instead")
    parser.add_argument("--select-batches", type=int, default=4, help="held-out batches to pick the mask token")
    parser.add_argument("--eval-batches", type=int, default=12, help="held-out batches of the final comparison")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="relative error of the linearised QK-norm")
    parser.add_argument("--headroom", type=float, default=16.0, help="factor over the largest measured mean square")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the twin's weights")
    parser.add_argument("--json", help="write the scores here")
    args = parser.parse_args()
    torch.manual_seed(0)
    target, tokenizer = load_default_target()
    source = DSparkDraftModel.from_pretrained(args.drafter, dtype=torch.float32)  # fine-tunes need fp32 weights
    if source.config.use_qk_norm:
        raise SystemExit(f"{args.drafter} already has QK-norm.")
    report = {}
    if source.mask_embedding is not None:  # pick the mask token
        embed = target.get_input_embeddings().weight.detach()
        special = {source.config.bos_token_id, source.config.eos_token_id, source.config.pad_token_id}
        cosine = torch.nn.functional.cosine_similarity(embed, source.mask_embedding.detach().float()[None], dim=-1)
        cosine[[t for t in special if t is not None]] = -2.0
        if args.mask_tokens:
            candidates = [int(t) for t in args.mask_tokens.split(",")]
        else:
            candidates = cosine.topk(args.candidates).indices.tolist()
        masked = {str(t): with_mask_token(source, t) for t in candidates}
        scores = heldout_tau(masked, target, args.heldout, args.select_batches, 256, 2)
        report["selection"] = {t: scores[t]["eval_greedy_tau"] for t in scores}
        best = max(scores, key=lambda t: scores[t]["eval_greedy_tau"])
        report.update(mask_token=int(best), cosine=float(cosine[int(best)]))
        source = masked[best]
        if args.out_masked:
            source.save_pretrained(args.out_masked)
    if args.out:
        policy = source.config.verify_policy
        source.config.verify_policy = "fixed"
        peaks = qk_mean_squares(source, target, tokenizer)
        source.config.verify_policy = policy
        twin, shifts = exportable_twin(source, source.config.mask_token_id, peaks, args.tolerance, args.headroom)
        twin = twin.to(getattr(torch, args.dtype)).float()  # scored as stored (the baseline too: bf16 on disk)
        report.update(peaks=peaks, shifts=shifts)
        baseline = DSparkDraftModel.from_pretrained(args.baseline, dtype=torch.float32)
        drafters = {"baseline": baseline, "source": source, "exportable": twin}
        report["final"] = heldout_tau(drafters, target, args.heldout, args.eval_batches, 256, 2)
        twin.to(getattr(torch, args.dtype)).save_pretrained(args.out)  # scaling by 2^-k is exact in bf16 too
        profile = Path(args.baseline) / "sps_profile.json"  # the same target, so the same verify cost
        if profile.is_file() and not (Path(args.out) / profile.name).exists():
            shutil.copyfile(profile, Path(args.out) / profile.name)
    print(json.dumps({k: v for k, v in report.items() if k != "final"}))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
