"""The drafter's share of a round, old way against new, on the embedded pair (issue 50, deliverable 2).

    python benchmarks/time_draft_pass.py --datasets mt-bench=$E/mt-bench.jsonl,gsm8k=$E/gsm8k.jsonl --limit 2 \
        --off narrow_draft [--policy fixed] [--json out.json]

For each prompt, `generate()` with the shipped drafter runs once per variant, in alternating order: "old" with the
`OPTIONS` fields named by `--off` turned off, "new" with them on (`kernels/options.py`). Each round's draft pass
(`DSparkCandidateGenerator.propose`: the backbone pass and the sequential and confidence heads) and the whole round
(`SpeculativeDecoder.step`) are timed. `--policy fixed` (the default) drafts and verifies the whole block every
round, so every round has a draft pass; `--policy shipped` keeps the drafter's own policy and gate. Prints, per
variant, the milliseconds of a draft pass, of a round, the draft's share of the round and tokens per second, and
whether the two variants gave the same tokens (they must).
"""

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import torch

from dspark_hf.decoding.core import SpeculativeDecoder
from dspark_hf.decoding.drafting import DSparkCandidateGenerator
from dspark_hf.default import load_default
from dspark_hf.evaluation.harness import parse_datasets
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.utils.prompts import encode, read_prompts


@contextmanager
def options_off(names: list[str]):
    saved = {name: getattr(OPTIONS, name) for name in names}
    try:
        for name in names:
            setattr(OPTIONS, name, False)
        yield
    finally:
        for name, value in saved.items():
            setattr(OPTIONS, name, value)


class Timer:
    """Wall times of every call of the wrapped methods, by name, while installed."""

    def __init__(self):
        self.times: dict[str, list[float]] = {}
        self._saved = []

    def wrap(self, owner: type, name: str) -> None:
        function = getattr(owner, name)
        times = self.times.setdefault(name, [])

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - start)

        self._saved.append((owner, name, function))
        setattr(owner, name, timed)

    def remove(self) -> None:
        for owner, name, function in reversed(self._saved):
            setattr(owner, name, function)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", required=True, help="name=FILE.jsonl,... (as `dspark-hf bench` reads them)")
    parser.add_argument("--limit", type=int, default=2, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--off", default="narrow_draft", help="OPTIONS fields the old way turns off, comma-separated")
    parser.add_argument("--policy", choices=("fixed", "shipped"), default="fixed")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    off = [name for name in args.off.split(",") if name]
    unknown = [name for name in off if not hasattr(OPTIONS, name)]
    if unknown:
        parser.error(f"--off: no OPTIONS field {', '.join(unknown)} (see kernels/options.py)")
    target, tokenizer, drafter = load_default()
    policy = "fixed" if args.policy == "fixed" else None
    prompts = [
        encode(tokenizer, record)
        for path in parse_datasets(datasets=args.datasets).values()
        for record in read_prompts(path)[: args.limit]
    ]
    totals = {variant: {"propose": [], "step": [], "seconds": 0.0, "tokens": 0} for variant in ("old", "new")}
    identical = True

    def run(ids, variant):
        timer = Timer()
        timer.wrap(DSparkCandidateGenerator, "propose")
        timer.wrap(SpeculativeDecoder, "step")
        start = time.perf_counter()
        try:
            with options_off(off if variant == "old" else []):
                out = target.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens, do_sample=False,
                    assistant_model=drafter, verify_policy=policy,
                )  # fmt: skip
        finally:
            timer.remove()
        record = totals[variant]
        record["seconds"] += time.perf_counter() - start
        record["tokens"] += out.shape[1] - ids.shape[1]
        record["propose"] += timer.times["propose"]
        record["step"] += timer.times["step"]
        return out

    run(prompts[0], "new")  # warm-up: first kernels, packed weights, the gate's first measurements (not counted)
    totals["new"] = {"propose": [], "step": [], "seconds": 0.0, "tokens": 0}
    for i, ids in enumerate(prompts):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        outs = {variant: run(ids, variant) for variant in order}
        identical &= torch.equal(outs["old"], outs["new"])
    result = {"cpu": _cpu(), "off": off, "policy": args.policy, "prompts": len(prompts), "identical": identical}
    for variant, record in totals.items():
        draft, step = record["propose"], record["step"]
        result[variant] = {
            "draft_ms": 1e3 * statistics.fmean(draft) if draft else 0.0,
            "round_ms": 1e3 * statistics.fmean(step) if step else 0.0,
            "draft_share": sum(draft) / sum(step) if step else 0.0,
            "draft_passes": len(draft),
            "tokens_per_second": record["tokens"] / record["seconds"],
        }
        row = result[variant]
        print(
            f"{variant}: draft pass {row['draft_ms']:.2f} ms ({row['draft_passes']} passes)   round "
            f"{row['round_ms']:.2f} ms   draft share {100 * row['draft_share']:.1f} %   "
            f"{row['tokens_per_second']:.2f} tok/s"
        )
    print(
        f"new/old: draft pass {result['new']['draft_ms'] / result['old']['draft_ms']:.3f}x   tokens/s "
        f"{result['new']['tokens_per_second'] / result['old']['tokens_per_second']:.3f}x   identical: {identical}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
