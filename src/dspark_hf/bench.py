"""Side-by-side benchmark: plain greedy vs DSpark-assisted greedy on the same prompts, in one process.

Runs alternate (plain first on even prompts, DSpark first on odd ones) so that drifting machine load hits both
alike; speed is reported as a ratio measured in the same run, never as an absolute threshold.
"""

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from .stats import DSparkGenerationStats
from .utils import atomic_write_json, read_jsonl


logger = logging.get_logger(__name__)


def read_prompts(path: str | Path) -> list[dict]:
    """JSONL records with `"prompt"` (raw text), `"messages"` (chat) or `"turns"` (first user turn, as DeepSpec's
    evaluation files); blank lines are skipped. Raises ValueError naming the bad line."""
    records = []
    for lineno, record in read_jsonl(path):
        if not isinstance(record, dict) or not any(k in record for k in ("prompt", "messages", "turns")):
            raise ValueError(f'{path}:{lineno} needs a "prompt", "messages" or "turns" field.')
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no prompts.")
    return records


def encode(tokenizer, record: dict) -> torch.LongTensor:
    """Token ids (1, L) of one prompt record; chat records go through the tokenizer's chat template."""
    if "prompt" in record:
        return tokenizer(record["prompt"], return_tensors="pt").input_ids
    messages = record.get("messages") or [{"role": "user", "content": record["turns"][0]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return ids["input_ids"]


@torch.no_grad()
def timed_generate(target, input_ids, max_new_tokens, drafter=None):
    start = time.perf_counter()
    out = target.generate(
        input_ids,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        assistant_model=drafter,
        attention_mask=torch.ones_like(input_ids),
    )
    return out[0, input_ids.shape[1] :], time.perf_counter() - start


def run_bench(target, tokenizer, drafter, records, max_new_tokens=128, progress=True) -> dict:
    """Plain vs DSpark greedy for every record; returns per-prompt results and pooled summary numbers."""
    timed_generate(target, encode(tokenizer, records[0]), 4)  # warm-up of both paths
    timed_generate(target, encode(tokenizer, records[0]), 4, drafter)
    pooled = DSparkGenerationStats(block_size=drafter.config.block_size)
    per_prompt, times, tokens = [], {"plain": 0.0, "dspark": 0.0}, {"plain": 0, "dspark": 0}
    for i, record in enumerate(tqdm(records, desc="bench", disable=not progress)):
        ids = encode(tokenizer, record)
        order = ("plain", "dspark") if i % 2 == 0 else ("dspark", "plain")
        result = {}
        for mode in order:
            result[mode] = timed_generate(target, ids, max_new_tokens, drafter if mode == "dspark" else None)
            if mode == "dspark":
                stats = drafter.generation_stats
        for mode, (out, seconds) in result.items():
            times[mode] += seconds
            tokens[mode] += out.numel()
        pooled = pooled.merge(stats)
        identical = torch.equal(result["plain"][0], result["dspark"][0])
        per_prompt.append(
            {
                "index": i,
                "prompt_tokens": ids.shape[1],
                "new_tokens": result["dspark"][0].numel(),
                "identical": identical,
                "acceptance_length": stats.acceptance_length,
                "per_position_acceptance": stats.per_position_acceptance,
                "num_target_forwards": stats.num_target_forwards,
                "mean_verify_length": stats.mean_verify_length,
                "seconds_plain": result["plain"][1],
                "seconds_dspark": result["dspark"][1],
            }
        )
        if not identical:
            logger.warning(f"Prompt {i}: DSpark output differs from plain greedy. Please report this as a bug.")
    tps = {mode: tokens[mode] / times[mode] if times[mode] else 0.0 for mode in times}
    return {
        "num_prompts": len(records),
        "max_new_tokens": max_new_tokens,
        "block_size": drafter.config.block_size,
        "verify_policy": drafter.config.verify_policy,
        "all_identical": all(p["identical"] for p in per_prompt),
        "acceptance_length": pooled.acceptance_length,
        "mean_prompt_acceptance_length": sum(p["acceptance_length"] for p in per_prompt) / len(per_prompt),
        "per_position_acceptance": pooled.per_position_acceptance,
        "mean_verify_length": pooled.mean_verify_length,
        "tokens_per_second_plain": tps["plain"],
        "tokens_per_second_dspark": tps["dspark"],
        "speedup": tps["dspark"] / tps["plain"] if tps["plain"] else 0.0,
        "per_prompt": per_prompt,
    }


def format_summary(result: dict) -> str:
    rates = ", ".join("-" if r is None else f"{r:.2f}" for r in result["per_position_acceptance"])
    return (
        f"prompts {result['num_prompts']}  identical {result['all_identical']}  τ {result['acceptance_length']:.2f}  "
        f"mean verify {result['mean_verify_length']:.2f}\n"
        f"per-position acceptance [{rates}]\n"
        f"plain {result['tokens_per_second_plain']:.1f} tok/s  dspark {result['tokens_per_second_dspark']:.1f} tok/s  "
        f"speedup {result['speedup']:.2f}x"
    )


def write_result(result: dict, path: str | Path) -> None:
    atomic_write_json(result, path)
