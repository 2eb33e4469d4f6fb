"""How much of a speedup is speculation, and how much is the few-rows products? A kernel-neutral plain baseline.

    python benchmarks/time_padded_plain.py [MAX_NEW_TOKENS]

On a 2-core CPU, torch's one-row product (MKL's matrix-vector path) barely uses the second core, while a 2-row
product written as (W xᵀ)ᵀ uses both (`dspark_hf.kernels.verify_head`). So a 2-token verify forward can cost less
than a 1-token plain step. This script decodes greedily with `generate()` in two ways, alternating on the same prompts:
- plain: one row per step, as `generate()` runs it;
- padded: inside `verify_head.padded_steps(target)`, each step feeds the new token plus a junk copy with the
  few-rows products on, keeps the first row's logits and crops the junk position from the cache again.
The two produce the same tokens (the script checks). A drafter's speedup over "padded" is what speculation itself
buys on this machine; `dspark-hf bench` reports it as `speedup_vs_padded`.
"""

import contextlib
import statistics
import sys
import time

import torch

from dspark_hf.default import load_default_target
from dspark_hf.evaluation.harness import timed_generate
from dspark_hf.kernels import verify_head
from dspark_hf.utils.prompts import encode


PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
]


def decode(target, ids: torch.Tensor, new_tokens: int, padded: bool) -> list[int]:
    """Greedy decoding of `new_tokens`; `padded` runs each step as a 2-row forward."""
    with verify_head.padded_steps(target) if padded else contextlib.nullcontext():
        return timed_generate(target, ids, new_tokens, min_new_tokens=new_tokens)[0].tolist()


def main() -> None:
    new_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    target, tokenizer = load_default_target()
    times = {False: [], True: []}
    for text in PROMPTS:
        ids = encode(tokenizer, {"messages": [{"role": "user", "content": text}]})
        decode(target, ids, 4, False), decode(target, ids, 4, True)  # warm-up
        outputs = {}
        for padded in (False, True, False, True):
            start = time.perf_counter()
            outputs[padded] = decode(target, ids, new_tokens, padded)
            times[padded].append(new_tokens / (time.perf_counter() - start))
        same = outputs[False] == outputs[True]
        rates = f"plain {times[False][-1]:5.1f} tok/s   padded {times[True][-1]:5.1f} tok/s"
        print(f"{text[:40]!r:44s} {rates}   same: {same}")
    plain, padded = statistics.median(times[False]), statistics.median(times[True])
    print(f"median: plain {plain:.1f} tok/s, padded {padded:.1f} tok/s, padded/plain {padded / plain:.2f}x")


if __name__ == "__main__":
    main()
