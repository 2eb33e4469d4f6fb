"""The draft gate's state carried across `generate()` calls (`GateMemory.shut` / `.wait`) against a gate that forgets
it every call, beside plain decoding, alternating in one process.

    python benchmarks/time_gate_memory.py --eval path/to/eval [--max-new-tokens 128]   # the demo's prompt + 6
    python benchmarks/time_gate_memory.py --sky-only                                    # the demo's prompt, 4 calls

Each variant keeps its own `GateMemory` (swapped in before each of its calls), so one's state never reaches the
other. "old" resets the carried state when each call's gate is made, which is the gate before the change. Prints
tok/s per variant, each one's ratio over plain, and whether every output equals plain greedy. The prompts: the
demo's, plus the first 2 turns each of MT-Bench, GSM8K and HumanEval from `--eval` (evaluation only).
"""

import argparse
import json
from pathlib import Path

import torch

import dspark_hf
from dspark_hf.cli.demo import DEMO_PROMPT
from dspark_hf.decoding import gate
from dspark_hf.decoding.profiling import cpu_model
from dspark_hf.evaluation.harness import timed_generate
from dspark_hf.kernels.runtime import runtime_for
from dspark_hf.utils.prompts import encode


def forgetting(forget: bool):
    """Patch `DraftGate.__init__` so that a new gate forgets the carried state (`forget`); returns the original."""
    original = gate.DraftGate.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if forget:
            self.memory.shut, self.memory.wait = False, None
            self.started_shut, self.wait = False, self.probe_interval

    gate.DraftGate.__init__ = init
    return original


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eval", help="folder with mt-bench.jsonl, gsm8k.jsonl, humaneval.jsonl")
    parser.add_argument("--sky-only", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, tokenizer, drafter = dspark_hf.load_default()
    texts = [DEMO_PROMPT]
    if not args.sky_only:
        for name in ("mt-bench", "gsm8k", "humaneval"):
            lines = Path(args.eval, f"{name}.jsonl").read_text().splitlines()[:2]
            texts += [json.loads(line)["turns"][0] for line in lines]
    prompts = [encode(tokenizer, {"messages": [{"role": "user", "content": t}]}) for t in texts]
    memories = {"old": gate.GateMemory(), "new": gate.GateMemory()}
    timed_generate(target, prompts[0], 16)
    for memory in memories.values():  # warm-up, each variant's first call
        runtime_for(target).gates[drafter] = memory
        timed_generate(target, prompts[0], 32, drafter)
    modes = ("plain", "old", "new")
    seconds, tokens, identical = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0), True
    for repeat in range(4 if args.sky_only else 2):
        for ids in prompts:
            plain, spent = timed_generate(target, ids, args.max_new_tokens)
            seconds["plain"] += spent
            tokens["plain"] += plain.numel()
            for variant in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
                original = forgetting(variant == "old")
                runtime_for(target).gates[drafter] = memories[variant]
                try:
                    out, spent = timed_generate(target, ids, args.max_new_tokens, drafter)
                finally:
                    gate.DraftGate.__init__ = original
                seconds[variant] += spent
                tokens[variant] += out.numel()
                identical &= out.tolist() == plain.tolist()
    rates = {k: tokens[k] / seconds[k] for k in seconds}
    print(f"{cpu_model()}, {torch.get_num_threads()} threads; every output identical to plain greedy: {identical}")
    for k, rate in rates.items():
        print(f"{k:>6}: {rate:.2f} tok/s = {rate / rates['plain']:.3f}x of plain")


if __name__ == "__main__":
    main()
