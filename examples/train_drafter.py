"""Train your own drafter: `dspark-hf data` → `dspark-hf train` → `dspark-hf calibrate`, here on a tiny run.

Usage:
    python examples/train_drafter.py --workdir runs/example    # a few minutes on 2 CPU cores
    python examples/train_drafter.py --workdir runs/example --print-only   # show the commands, run nothing

Each step is one `dspark-hf` command, printed before it runs, so you can copy it into a shell and scale it up
(docs/training.md has the recipe of the shipped drafter: thousands of prompts and thousands of steps). The sizes
below only show the flow: a drafter trained for 4 steps on 16 answers drafts badly, but its output is still exactly
the target's.
"""

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path


HUB_CONFIG = Path(__file__).resolve().parents[1] / "hub_configs" / "smollm2-135m-instruct.json"


def run(args, print_only):
    """Run `dspark-hf <args>` with this Python (the same as the `dspark-hf` command of its environment)."""
    print("$ dspark-hf " + shlex.join(args), flush=True)
    if not print_only:
        subprocess.run([sys.executable, "-m", "dspark_hf.cli", *args], check=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/example", help="data and checkpoints go here")
    parser.add_argument("--print-only", action="store_true", help="print the commands without running them")
    args = parser.parse_args(argv)
    data, run_dir = Path(args.workdir) / "data", Path(args.workdir) / "run"

    # 1. A training set: the target's own answers to prompts (so the drafter learns what the target says).
    #    Rerunning the same command resumes; --exclude-eval FILE.jsonl keeps benchmark prompts out.
    run(
        ["data", "--out", str(data), "--num-prompts", "16", "--max-new-tokens", "32", "--batch-size", "8",
         "--heldout-fraction", "0.25"],
        args.print_only,
    )  # fmt: skip

    # 2. Train: the drafter's shape comes from a hub_configs/ file (one per supported target); --set overrides any
    #    DSparkTrainingConfig field. --resume continues after a crash; a non-empty output_dir needs --overwrite.
    run(
        ["train", "--config", os.path.relpath(HUB_CONFIG), "--overwrite", "--set", f"data={data / 'train.npz'}",
         f"heldout={data / 'heldout.npz'}", f"output_dir={run_dir}", "max_steps=4", "seq_len=128", "batch_size=2",
         "num_anchors=8", "eval_every=4", "eval_batches=1", "save_every=4", "log_every=1"],
        args.print_only,
    )  # fmt: skip

    # 3. Calibrate the confidence head (how many drafts are worth verifying) on held-out data; writes a copy.
    calibrated = Path(args.workdir) / "calibrated"
    run(
        ["calibrate", "--drafter", str(run_dir / "best"), "--data", str(data / "heldout.npz"), "--out",
         str(calibrated), "--overwrite", "--seq-len", "128", "--batches", "2"],
        args.print_only,
    )  # fmt: skip

    # 4. Use it: `dspark-hf demo --drafter <folder>`, or from Python
    #    `dspark_hf.load_default(drafter_path=<folder>)` (examples/generate.py --drafter <folder>).
    run(["demo", "--drafter", str(calibrated), "--max-new-tokens", "32", "--repeats", "1"], args.print_only)


if __name__ == "__main__":
    main()
