"""Logits processors at every verify slot, or only along the walk acceptance takes, side by side in one process.

    python benchmarks/time_walk_processing.py --datasets mt-bench=$E/mt-bench.jsonl,gsm8k=$E/gsm8k.jsonl --limit 4
    python benchmarks/time_walk_processing.py ... --temperature 0 --processors no-repeat-ngram
    python benchmarks/time_walk_processing.py ... --processors top-k-top-p

transformers' verify (and this package's until 2026-12-07) runs a row's prefix-dependent logits processors once per
verify slot, each with the slot's own prefix. Only the slots on the accepted walk are ever read: a chain's up to its
first rejected draft, a tree's along the path its choices take (`decoding.rows.process_and_choose`). Per prompt, in
a rotating order: plain `generate()`, "every slot" (the old way, patched in) and "walk" (the shipped way), each with
the shipped drafter under its own settings. One JSON line per prompt (seconds, the processor calls of the verifies'
accept steps, whether the two ways gave one output), then a summary on stderr. The embedded SmolLM2 target; run
nothing else on the machine meanwhile.
"""

import argparse
import contextlib
import json
import statistics
import sys

import torch
from transformers import LogitsProcessorList

from dspark_hf.decoding import core
from dspark_hf.decoding.rows import choose_tokens, process_logits
from dspark_hf.default import load_default
from dspark_hf.evaluation.harness import timed_generate
from dspark_hf.utils.prompts import encode, read_prompts


PROCESSORS = {
    "min-new-tokens": lambda n: {"min_new_tokens": n},
    "repetition-penalty": lambda n: {"repetition_penalty": 1.1},
    "no-repeat-ngram": lambda n: {"no_repeat_ngram_size": 4},
    "top-k-top-p": lambda n: {"top_k": 50, "top_p": 0.9},  # transformers' warpers are processors too
}


def every_slot(rows, logits, tokens, lengths, parents=None, depths=None):
    """The old accept step: every slot processed with its own prefix, then chosen."""
    width = logits.shape[1]
    offsets = paths = None
    if parents is not None:
        up, drafted = parents.tolist(), tokens.tolist()
        paths = []
        for r in range(len(rows)):
            row_paths = [[]]
            for s in range(1, width):
                row_paths.append(row_paths[up[r][s - 1]] + [drafted[r][s - 1]])
            paths.append(row_paths)
        offsets = [[0] + d for d in depths[:, : width - 1].tolist()]
    processed = process_logits(rows, logits, None if parents is not None else tokens, paths=paths)
    counts = [0 if row.standard else n + 1 for row, n in zip(rows, lengths)]
    return processed, choose_tokens(rows, processed, counts=counts, offsets=offsets)


@contextlib.contextmanager
def way(name: str, calls: list):
    """Patch in the old accept step for "every slot"; count the processor-list calls made in a verify's accept step
    (`calls[0]`; plain decoding: every call, one per step)."""
    shipped, call = core.process_and_choose, LogitsProcessorList.__call__
    inside = [name == "plain"]

    def counted(self, *args, **kwargs):
        calls[0] += inside[0]
        return call(self, *args, **kwargs)

    def accept_step(*args, **kwargs):
        inside[0] = True
        try:
            return (every_slot if name == "every slot" else shipped)(*args, **kwargs)
        finally:
            inside[0] = False

    LogitsProcessorList.__call__ = counted
    core.process_and_choose = accept_step
    try:
        yield
    finally:
        core.process_and_choose, LogitsProcessorList.__call__ = shipped, call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", required=True, help="name=path.jsonl,... (prompt records)")
    parser.add_argument("--limit", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--processors", default="min-new-tokens,repetition-penalty", help=",".join(PROCESSORS))
    args = parser.parse_args(argv)
    settings = {"do_sample": args.temperature > 0}
    if args.temperature > 0:
        settings |= {"temperature": args.temperature, "top_k": 0, "top_p": 1.0}
    for name in filter(None, args.processors.split(",")):
        if name not in PROCESSORS:
            parser.error(f"--processors: unknown {name!r}; choose from {list(PROCESSORS)}")
        settings |= PROCESSORS[name](args.max_new_tokens)
    target, tokenizer, drafter = load_default()
    ways = ["plain", "every slot", "walk"]
    seconds = {w: [] for w in ways}
    index = 0
    for item in args.datasets.split(","):
        set_name, path = item.split("=", 1)
        for record in read_prompts(path)[: args.limit]:
            ids = encode(tokenizer, record)
            line, outputs = {"set": set_name}, {}
            order = ways[index % 3 :] + ways[: index % 3]  # rotating, so a change of load hits every way alike
            for name in order:
                calls = [0]
                with way(name, calls):
                    torch.manual_seed(index)
                    tokens, spent = timed_generate(
                        target, ids, args.max_new_tokens, None if name == "plain" else drafter, **settings
                    )
                outputs[name] = tokens.tolist()
                seconds[name].append(spent)
                line[name] = {"seconds": round(spent, 3), "tokens": len(tokens), "verify_processor_calls": calls[0]}
            line["identical"] = outputs["every slot"] == outputs["walk"]
            print(json.dumps(line), flush=True)
            index += 1
    total = {w: sum(v) for w, v in seconds.items()}
    per_prompt = statistics.geometric_mean(a / b for a, b in zip(seconds["every slot"], seconds["walk"]))
    print(
        f"{index} prompts: walk {total['plain'] / total['walk']:.3f}x of plain, every slot "
        f"{total['plain'] / total['every slot']:.3f}x; walk / every slot {total['every slot'] / total['walk']:.3f}x "
        f"(geometric mean per prompt {per_prompt:.3f}x)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
