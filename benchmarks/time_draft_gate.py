"""The draft gate with and without the confidences' weight in its measurement, side by side with plain decoding.

    python benchmarks/time_draft_gate.py --long-context 256,1k,2k --limit 8 > long-context.jsonl
    python benchmarks/time_draft_gate.py --datasets mt-bench=$E/mt-bench.jsonl,gsm8k=$E/gsm8k.jsonl --limit 8
    python benchmarks/time_draft_gate.py --datasets ... --limit 4 --max-new-tokens 64 --hog   # beside a CPU hog

The gate (`decoding.scheduler.DraftGate`) makes a round plain when drafted rounds measured dearer per committed
token than plain ones. Counting only the tokens measured, a few drafted rounds that happen to commit one token each
shut it for dozens of rounds; weighing them against what the calibrated confidences expected of those rounds
(`prior_rounds` = 8, the default) does not. Per prompt, in a rotating order within one process: plain
`generate()`, the gate with `prior_rounds=0` ("counted") and the default ("weighed"). One JSON line per prompt
(seconds, tokens, target forwards, identical), then a summary per set on stderr: τ and the speed against
plain of the whole call. `--hog` runs a 2-thread matmul loop in a second process meanwhile (the load the gate must
still protect against). The embedded SmolLM2 target and the shipped drafter.
"""

import argparse
import contextlib
import json
import subprocess
import sys

from dspark_hf.decoding import scheduler
from dspark_hf.default import load_default
from dspark_hf.evaluation.harness import timed_generate
from dspark_hf.evaluation.long_context import long_context_sets, parse_context_lengths
from dspark_hf.utils.prompts import encode, read_prompts


WAYS = {"plain": None, "counted": 0.0, "weighed": 8.0}
HOG = "import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


@contextlib.contextmanager
def prior_rounds(value: float):
    """Gates built inside this block weigh their drafted rounds' tokens against `value` rounds of the prediction."""
    build = scheduler.DraftGate.__init__

    def patched(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.rounds[True].prior_rounds = value

    scheduler.DraftGate.__init__ = patched
    try:
        yield
    finally:
        scheduler.DraftGate.__init__ = build


def prompt_sets(args, tokenizer) -> dict:
    sets = {}
    if args.long_context:
        sets |= long_context_sets(tokenizer, parse_context_lengths(args.long_context), args.limit)
    for item in filter(None, (args.datasets or "").split(",")):
        name, path = item.split("=", 1)
        sets[name] = read_prompts(path)[: args.limit]
    return sets


def summary(name: str, rows: list[dict]) -> str:
    tokens = sum(r["plain"]["tokens"] for r in rows)
    plain = sum(r["plain"]["seconds"] for r in rows)
    parts = [f"{name}: {len(rows)} prompts, identical {all(r['identical'] for r in rows)}"]
    for way in ("counted", "weighed"):
        tau = tokens / sum(r[way]["forwards"] for r in rows)
        parts.append(f"{way} τ {tau:.2f}, {plain / sum(r[way]['seconds'] for r in rows):.2f}x")
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long-context", default="", help="lengths, e.g. 256,1k,2k")
    parser.add_argument("--datasets", default="", help="name=FILE.jsonl,...")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hog", action="store_true", help="a 2-thread matmul loop beside the measurement")
    args = parser.parse_args()
    target, tokenizer, drafter = load_default()
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if args.hog else None
    try:
        for name, records in prompt_sets(args, tokenizer).items():
            rows = []
            for i, record in enumerate(records):
                ids, ways = encode(tokenizer, record), list(WAYS)
                row, outputs = {"set": name, "index": i}, {}
                for way in ways[i % 3 :] + ways[: i % 3]:  # each way in each slot as often
                    assistant = None if way == "plain" else drafter
                    with prior_rounds(WAYS[way] or 0.0):
                        out, seconds = timed_generate(target, ids, args.max_new_tokens, assistant)
                    outputs[way] = out.tolist()
                    forwards = drafter.generation_stats.num_target_forwards if assistant is not None else None
                    row[way] = {"seconds": seconds, "tokens": out.numel(), "forwards": forwards}
                row["identical"] = outputs["counted"] == outputs["weighed"] == outputs["plain"]
                rows.append(row)
                print(json.dumps(row), flush=True)
            print(summary(name, rows), file=sys.stderr, flush=True)
    finally:
        if hog is not None:
            hog.kill()


if __name__ == "__main__":
    main()
