"""Package a trained, calibrated drafter as the embedded default (`src/dspark_hf/default_drafter/`).

    python tools/ship_default_drafter.py --drafter runs/smollm2-dspark/best \
        --results results/evaluation.json --label dspark --data data/smollm2 \
        --out src/dspark_hf/default_drafter

Writes a Hub-layout folder without remote code (config.json with the STS temperatures, bf16 model.safetensors,
calibration.json, README.md built from the measured results, the training settings and the data statistics).
`dspark_hf.load_default()`, `dspark-hf demo` and `dspark-hf bench` then use it. The weights are stored in bf16
(half the size; `load_default()` runs the drafter in bf16 on a CPU with native bf16, else in the target's dtype)
and the folder must stay under 40 MB.
"""

import argparse
import json
from pathlib import Path

import torch

from dspark_hf import DSparkDraftModel
from dspark_hf.evaluation.harness import model_card_results
from dspark_hf.integrations.hub import save_for_hub
from dspark_hf.training.dataset import TokenDataset
from dspark_hf.training.step import special_token_ids, vocab_shortlist


MAX_BYTES = 40 * 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="trained checkpoint (calibrated with `dspark-hf calibrate`)")
    parser.add_argument("--results", help="evaluation.json of `dspark-hf bench` that includes this drafter")
    parser.add_argument("--label", help="the drafter's label in --results (default: its only drafter)")
    parser.add_argument(
        "--data",
        help="the `dspark-hf data` folder(s) it was trained on, comma-separated (stats.json goes in the card)",
    )
    parser.add_argument("--out", default="src/dspark_hf/default_drafter")
    parser.add_argument(
        "--target-name",
        default="HuggingFaceTB/SmolLM2-135M-Instruct",
        help="the target's Hub name for the card (instead of the local GGUF folder it was trained from)",
    )
    parser.add_argument("--notes", help="a Markdown file appended to the model card (e.g. what limits the numbers)")
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="draft among the N most frequent supervised tokens of --data's train.npz (0: keep the checkpoint's; "
        "`dspark-hf train` saves its train_vocab_size shortlist)",
    )
    args = parser.parse_args()
    if args.draft_vocab and not args.data:
        raise SystemExit("--draft-vocab needs --data (the draft vocabulary comes from its train.npz).")

    drafter = DSparkDraftModel.from_pretrained(args.drafter)
    results = None
    if args.results:
        results = model_card_results(json.loads(Path(args.results).read_text()), drafter=args.label)
        results = {name: {k: v for k, v in run.items() if k != "per_prompt"} for name, run in results.items()}
    training = json.loads((Path(args.drafter) / "trainer_state.json").read_text())
    folders = [Path(d) for d in (args.data or "").split(",") if d]
    if folders:
        stats = [json.loads((d / "stats.json").read_text()) for d in folders]
        training["data"] = stats[0] if len(stats) == 1 else dict(zip(map(str, folders), stats))
    drafter.config.target_name_or_path = args.target_name
    if args.draft_vocab:
        dataset = TokenDataset.load([d / "train.npz" for d in folders])
        drafter.set_draft_vocab(vocab_shortlist(dataset, args.draft_vocab, always=special_token_ids(drafter.config)))
    drafter = drafter.to(torch.bfloat16)
    out = save_for_hub(drafter, args.out, results=results, training=training, with_code=False, overwrite=True)
    if args.notes:
        card = out / "README.md"
        card.write_text(card.read_text() + "\n" + Path(args.notes).read_text())
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if size > MAX_BYTES:
        raise SystemExit(f"{out} is {size / 2**20:.1f} MB, over the 40 MB the repository allows.")
    print(f"wrote {out} ({size / 2**20:.1f} MB)")


if __name__ == "__main__":
    main()
