"""How much of a speedup is speculation, and how much is the few-rows products? A kernel-neutral plain baseline.

    python examples/time_padded_plain.py [MAX_NEW_TOKENS]

On a 2-core CPU, torch's one-row product (MKL's matrix-vector path) barely uses the second core, while a 2-row
product written as (W xᵀ)ᵀ uses both (`dspark_hf.verify_head`). So a 2-token verify forward can cost less than a
1-token plain step. This script decodes greedily in two ways, alternating on the same prompts:
- plain: one row per step, exactly as `generate()` runs it;
- padded: each step feeds the new token plus one junk token, with the few-rows products on, reads the first row's
  logits and crops the junk position from the cache again.
The two produce the same tokens (the script checks). A drafter's speedup over "padded" is what speculation itself
buys on this machine.
"""

import statistics
import sys
import time

import torch
from transformers import DynamicCache

from dspark_hf import verify_head
from dspark_hf.bench import encode
from dspark_hf.default import load_default_target


PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
]


@torch.no_grad()
def decode(target, ids: torch.Tensor, new_tokens: int, padded: bool) -> list[int]:
    """Greedy decoding, one token a step; `padded` runs each step as a 2-row forward."""
    cache = DynamicCache(config=target.config)
    logits = target(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    out = []
    for _ in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)  # (1, 1)
        out.append(int(token))
        if padded:
            with verify_head.verifying(target):
                logits = target(input_ids=torch.cat([token, token], dim=1), cache=cache, use_cache=True).logits[:, 0]
            cache.crop(-1)  # forget the junk position
        else:
            logits = target(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    return out


def main() -> None:
    new_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    target, tokenizer = load_default_target()
    verify_head.attach(target)
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
