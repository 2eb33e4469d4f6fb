"""The draft gate with and without the confidences' weight in its measurement, side by side with plain decoding.

    python benchmarks/time_draft_gate.py --long-context 256,1k,2k --limit 8 > long-context.jsonl
    python benchmarks/time_draft_gate.py --datasets mt-bench=$E/mt-bench.jsonl,gsm8k=$E/gsm8k.jsonl --limit 8
    python benchmarks/time_draft_gate.py --datasets ... --limit 4 --max-new-tokens 64 --hog   # beside a CPU hog
    python benchmarks/time_draft_gate.py --datasets ... --temperature 1 --ways plain,weighed,off   # sampling, gate off

The gate (`decoding.gate.DraftGate`) makes a round plain when drafted rounds measured dearer per committed
token than plain ones. Counting only the tokens measured, a few drafted rounds that happen to commit one token each
shut it for dozens of rounds; weighing them against what the calibrated confidences expected of those rounds
(`prior_rounds` = 8, the default) does not. Per prompt, in a rotating order within one process: plain
`generate()`, the gate with `prior_rounds=0` ("counted"), the default ("weighed") and no gate at all ("off",
`draft_gate=False`: every round drafts); `--ways` picks some. One JSON line per prompt (seconds, tokens, target
forwards, identical), then a summary per set on stderr: τ and the speed against plain of the whole call.
`--temperature` samples, seeded per prompt: the drafted ways must then agree token for token (which rounds draft
never changes a seeded output), but not with plain sampling, which transformers draws another way. `--hog` runs a
2-thread matmul loop in a second process meanwhile (the load the gate must still protect against). The embedded
SmolLM2 target and the shipped drafter.
"""

import argparse
import contextlib
import json
import subprocess
import sys

import torch

from dspark_hf.decoding.gate import DraftGate
from dspark_hf.default import load_default
from dspark_hf.evaluation.harness import timed_generate
from dspark_hf.evaluation.long_context import long_context_sets, parse_context_lengths
from dspark_hf.utils.prompts import encode, read_prompts


WAYS = {"plain": None, "counted": 0.0, "weighed": 8.0, "off": None}  # the gate's `prior_rounds` (None: no gate)
HOG = "import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


@contextlib.contextmanager
def prior_rounds(value: float):
    """Gates built inside this block weigh their drafted rounds' tokens against `value` rounds of the prediction."""
    build = DraftGate.__init__

    def patched(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.rounds[True].prior_rounds = value

    DraftGate.__init__ = patched
    try:
        yield
    finally:
        DraftGate.__init__ = build


def prompt_sets(args, tokenizer) -> dict:
    sets = {}
    if args.long_context:
        sets |= long_context_sets(tokenizer, parse_context_lengths(args.long_context), args.limit)
    for item in filter(None, (args.datasets or "").split(",")):
        name, path = item.split("=", 1)
        sets[name] = read_prompts(path)[: args.limit]
    return sets


@contextlib.contextmanager
def gate_off(drafter, off: bool):
    """Every round drafts inside this block where `off` (the drafter's `draft_gate` setting, restored after)."""
    before = drafter.config.draft_gate
    drafter.config.draft_gate = before and not off
    try:
        yield
    finally:
        drafter.config.draft_gate = before


def summary(name: str, rows: list[dict], ways: list[str]) -> str:
    """τ per way (each way's own tokens over its target forwards) and its speed against plain, per token."""
    parts = [f"{name}: {len(rows)} prompts, identical {all(r['identical'] for r in rows)}"]
    plain = sum(r["plain"]["seconds"] for r in rows) / sum(r["plain"]["tokens"] for r in rows)
    for way in ways:
        if way == "plain":
            continue
        tokens = sum(r[way]["tokens"] for r in rows)
        per_token = sum(r[way]["seconds"] for r in rows) / tokens
        parts.append(f"{way} τ {tokens / sum(r[way]['forwards'] for r in rows):.2f}, {plain / per_token:.2f}x")
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--long-context", default="", help="lengths, e.g. 256,1k,2k")
    parser.add_argument("--datasets", default="", help="name=FILE.jsonl,...")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--hog", action="store_true", help="a 2-thread matmul loop beside the measurement")
    parser.add_argument("--ways", default="plain,counted,weighed", help=f"comma-separated, of {','.join(WAYS)}")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    parser.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    args = parser.parse_args()
    ways = args.ways.split(",")
    if "plain" not in ways or not set(ways) <= set(WAYS) or len(ways) < 2:
        parser.error(f"--ways: plain and at least one of {', '.join(w for w in WAYS if w != 'plain')}")
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature else {}
    target, tokenizer, drafter = load_default()
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if args.hog else None
    try:
        for name, records in prompt_sets(args, tokenizer).items():
            rows = []
            for i, record in enumerate(records):
                ids, k = encode(tokenizer, record), i % len(ways)
                row, outputs = {"set": name, "index": i}, {}
                for way in ways[k:] + ways[:k]:  # each way in each slot as often
                    assistant = None if way == "plain" else drafter
                    torch.manual_seed(args.seed + i)
                    with prior_rounds(WAYS[way] or 0.0), gate_off(drafter, way == "off"):
                        out, seconds = timed_generate(target, ids, args.max_new_tokens, assistant, **sampling)
                    outputs[way] = out.tolist()
                    forwards = drafter.generation_stats.num_target_forwards if assistant is not None else None
                    row[way] = {"seconds": seconds, "tokens": out.numel(), "forwards": forwards}
                compared = [outputs[way] for way in ways if not (sampling and way == "plain")]
                row["identical"] = all(output == compared[0] for output in compared)
                rows.append(row)
                print(json.dumps(row), flush=True)
            print(summary(name, rows, ways), file=sys.stderr, flush=True)
    finally:
        if hog is not None:
            hog.kill()


if __name__ == "__main__":
    main()
