"""The verify kernels as a measured choice against always on, side by side with plain decoding, on the embedded pair.

    python benchmarks/time_kernel_choice.py --datasets mt-bench=$E/mt-bench.jsonl,gsm8k=$E/gsm8k.jsonl --limit 4 \
        --out kernel-choice.json

For every prompt, in turn: plain greedy `generate()`, the shipped drafter with the target's linears the way measured
on this machine (`verify_linears.kernel_choice`, the default: measured once per target) and the same drafter with the
few-row products on for every verify (`OPTIONS.verify_way = "few rows"`, the behaviour before any choice). Every
output is checked against plain greedy. Prints tok/s and the ratios; writes them, and the choice made, as JSON.
"""

import argparse
import json
import statistics

import torch

import dspark_hf
from dspark_hf.evaluation.harness import parse_datasets, timed_generate
from dspark_hf.kernels import verify_linears
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.utils.prompts import encode, read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", required=True, help="name=FILE.jsonl,...")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    target, tokenizer, drafter = dspark_hf.load_default()
    datasets = {name: read_prompts(path)[: args.limit] for name, path in parse_datasets((), args.datasets).items()}
    first = encode(tokenizer, next(iter(datasets.values()))[0])
    timed_generate(target, first, 8)  # warm-up
    timed_generate(target, first, 8, drafter)

    def always_on(ids):
        """The drafter with every verify on the few-row products."""
        OPTIONS.verify_way = "few rows"
        try:
            return timed_generate(target, ids, args.max_new_tokens, drafter)
        finally:
            OPTIONS.verify_way = None

    modes = {
        "plain": lambda ids: timed_generate(target, ids, args.max_new_tokens),
        "measured": lambda ids: timed_generate(target, ids, args.max_new_tokens, drafter),
        "always_on": always_on,
    }
    result, identical = {}, True
    for name, records in datasets.items():
        totals, taus = {mode: [0, 0.0] for mode in modes}, []
        for record in records:
            ids = encode(tokenizer, record)
            outputs = {}
            for mode, run in modes.items():
                outputs[mode], seconds = run(ids)
                totals[mode][0] += outputs[mode].numel()
                totals[mode][1] += seconds
                if mode == "measured":
                    taus.append(drafter.generation_stats.acceptance_length)
            identical &= all(torch.equal(outputs["plain"], outputs[m]) for m in ("measured", "always_on"))
        rates = {mode: tokens / seconds for mode, (tokens, seconds) in totals.items()}
        result[name] = {
            "tau": round(statistics.fmean(taus), 3),
            "tok_s": {mode: round(rate, 2) for mode, rate in rates.items()},
            "measured_vs_plain": round(rates["measured"] / rates["plain"], 3),
            "always_on_vs_plain": round(rates["always_on"] / rates["plain"], 3),
        }
        print(name, result[name], flush=True)
    summary = {
        key: round(statistics.geometric_mean(r[key] for r in result.values()), 3)
        for key in ("measured_vs_plain", "always_on_vs_plain")
    }
    choice = verify_linears.kernel_choice(target).table
    report = {
        "datasets": result,
        "geometric_mean": summary,
        "all_identical": identical,
        "kernels_chosen": choice.to_json()["choice"] if choice is not None else None,
        "torch_threads": torch.get_num_threads(),
        "prompts_per_dataset": args.limit,
        "max_new_tokens": args.max_new_tokens,
    }
    print(json.dumps({k: report[k] for k in ("geometric_mean", "all_identical", "kernels_chosen")}))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
