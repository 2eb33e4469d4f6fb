"""The round's target forward at one git revision against the working tree's, side by side in one process.

    python benchmarks/time_lean_forward.py [--old HEAD] [--part forward|cache] [--widths 1,4,16]
                                           [--contexts 256,2048] [--repeats 10] [--json out.json]

`--part forward`: `kernels/lean_forward.py` as it was at `--old` is loaded beside today's (as a sibling module of the
installed package, so both run on the same kernels, cache and target). `--part cache`: `decoding/ragged_cache.py`
as it was, its `AppendCache` beside today's, both under today's forward. Both sides forward the same tokens over a
prefilled `AppendCache` of each context length, as a decode round calls it (a 2-D mask of ones, positions after
the context; the slots written are cropped again). Each round of timing visits every (context, width, side) once,
so a burst of load lands on all alike. Prints the CPU, each median in ms, new / old, and whether the logits are
bit-identical. fp32 SmolLM2-135M, no kernel scope (the linears as `F.linear`). Nothing here is a test.
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import dspark_hf
from dspark_hf.decoding.profiling import cpu_model, run_facts
from dspark_hf.decoding.ragged_cache import AppendCache
from dspark_hf.kernels import lean_forward


ROOT = Path(__file__).resolve().parents[1]
PARTS = {"forward": "kernels/lean_forward.py", "cache": "decoding/ragged_cache.py"}


def load_revision(revision: str, part: str):
    """The module of `part` as it was at `revision`, as a sibling module `_old_<name>` of today's."""
    module = f"src/dspark_hf/{PARTS[part]}"
    source = subprocess.run(["git", "show", f"{revision}:{module}"], cwd=ROOT, capture_output=True, text=True)
    if source.returncode:
        sys.exit(f"time_lean_forward: no {module} at {revision!r}: {source.stderr.strip()}")
    folder, stem = PARTS[part].removesuffix(".py").split("/")
    path = Path(tempfile.mkdtemp()) / f"_old_{stem}.py"
    path.write_text(source.stdout)
    name = f"dspark_hf.{folder}._old_{stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", default="HEAD", help="the git revision to compare with (default: HEAD)")
    parser.add_argument("--part", choices=sorted(PARTS), default="forward", help="the module compared")
    parser.add_argument("--widths", default="1,4,16")
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    old = load_revision(args.old, args.part)
    forwards = {"old": old if args.part == "forward" else lean_forward, "new": lean_forward}
    cache_classes = {"old": old.AppendCache if args.part == "cache" else AppendCache, "new": AppendCache}
    target, _, _ = dspark_hf.load_default()
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    caches = {}
    for context in contexts:
        prompt = torch.randint(0, vocab, (1, context), generator=generator)
        for side, cache_class in cache_classes.items():
            caches[context, side] = cache_class()
            target(input_ids=prompt, use_cache=True, cache=caches[context, side])
    sides = list(forwards)

    def run(side, context, ids):
        width = ids.shape[1]
        out = forwards[side].run_target(
            target, input_ids=ids, position_ids=torch.arange(context, context + width)[None], use_cache=True,
            attention_mask=torch.ones(1, context + width, dtype=torch.long), cache=caches[context, side],
        )  # fmt: skip
        caches[context, side].crop(-width)
        return out.logits

    identical = {}
    for context in contexts:
        for width in widths:
            ids = torch.randint(0, vocab, (1, width), generator=generator)
            identical[f"{context},{width}"] = torch.equal(run("old", context, ids), run("new", context, ids))
    times = {(c, w, side): [] for c in contexts for w in widths for side in sides}
    for i in range(args.repeats + 2):
        for context in contexts:
            for width in widths:
                ids = torch.randint(0, vocab, (1, width), generator=generator)
                for side in sides if i % 2 else reversed(sides):
                    start = time.perf_counter()
                    run(side, context, ids)
                    if i >= 2:
                        times[context, width, side].append((time.perf_counter() - start) * 1e3)
    medians = {key: statistics.median(v) for key, v in times.items()}
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {args.part} at {args.old}")
    print(f"{'context':>8}{'width':>6}{'old ms':>9}{'new ms':>9}{'new/old':>9}  bit-identical")
    for context in contexts:
        for width in widths:
            old, new = medians[context, width, "old"], medians[context, width, "new"]
            print(f"{context:8d}{width:6d}{old:9.1f}{new:9.1f}{new / old:9.3f}  {identical[f'{context},{width}']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    **run_facts(),
                    "old": args.old,
                    "part": args.part,
                    "ms": {f"{c},{w},{side}": v for (c, w, side), v in medians.items()},
                    "identical": identical,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
