"""generate() throughput at batch 1, 4 and 8: plain batched decoding against the same batches with the drafter.

    python benchmarks/bench_batched_generate.py --prompts mt-bench.jsonl --limit 8 --out batched.json

The embedded default (SmolLM2-135M-Instruct and its drafter) on the first `--limit` prompts, left-padded into
batches of each size, greedy, `--max-new-tokens` each. Plain and speculative runs alternate batch by batch in one
process; every speculative row must equal the plain one. Reports tokens/s per mode and batch size, and the ratio.
"""

import argparse
import json
import time

import torch

from dspark_hf import load_default
from dspark_hf.utils.prompts import read_prompts


def batches(tokenizer, records, size):
    texts = [
        tokenizer.apply_chat_template(
            r.get("messages") or [{"role": "user", "content": r.get("prompt") or r["turns"][0]}],
            add_generation_prompt=True,
            tokenize=False,
        )  # fmt: skip
        for r in records
    ]
    for i in range(0, len(texts), size):
        yield tokenizer(texts[i : i + size], return_tensors="pt", padding=True, add_special_tokens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--sizes", default="1,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="batched.json")
    args = parser.parse_args()
    target, tokenizer, drafter = load_default()
    tokenizer.padding_side = "left"
    records = read_prompts(args.prompts)[: args.limit]
    results = {}
    for size in (int(s) for s in args.sizes.split(",")):
        seconds, tokens, identical = {"plain": 0.0, "dspark": 0.0}, 0, True
        for k, inputs in enumerate(batches(tokenizer, records, size)):
            outs = {}
            for mode in ("plain", "dspark") if k % 2 == 0 else ("dspark", "plain"):
                start = time.perf_counter()
                outs[mode] = target.generate(
                    **inputs, do_sample=False, max_new_tokens=args.max_new_tokens,
                    assistant_model=drafter if mode == "dspark" else None,
                )  # fmt: skip
                seconds[mode] += time.perf_counter() - start
            identical &= torch.equal(outs["plain"], outs["dspark"])
            new = outs["plain"][:, inputs["input_ids"].shape[1] :]
            tokens += int((new != tokenizer.pad_token_id).sum())
        results[size] = {
            "tokens": tokens,
            "plain_tokens_per_s": tokens / seconds["plain"],
            "dspark_tokens_per_s": tokens / seconds["dspark"],
            "speedup": seconds["plain"] / seconds["dspark"],
            "identical": identical,
        }
        print(size, json.dumps(results[size]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
                   "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
