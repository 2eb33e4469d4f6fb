"""Benchmark prompts and timed generation: the pieces the evaluation harness (`evaluation.py`) and the demo share."""

import time
from pathlib import Path

import torch

from .utils import read_jsonl


def read_prompts(path: str | Path) -> list[dict]:
    """JSONL records with `"prompt"` (raw text), `"messages"` (chat) or `"turns"` (first user turn, as DeepSpec's
    evaluation files); blank lines are skipped. Raises ValueError naming the bad line."""
    records = []
    for lineno, record in read_jsonl(path):
        if not isinstance(record, dict) or not any(k in record for k in ("prompt", "messages", "turns")):
            raise ValueError(f'{path}:{lineno} needs a "prompt", "messages" or "turns" field.')
        problem = _prompt_problem(record)
        if problem:
            raise ValueError(f"{path}:{lineno}: {problem}.")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no prompts.")
    return records


def _prompt_problem(record: dict) -> str | None:
    """What is wrong with the prompt field of a record that has one, or None."""
    if "prompt" in record:
        return None if isinstance(record["prompt"], str) else '"prompt" must be a string'
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return '"messages" must be a non-empty list of {"role": ..., "content": ...} objects'
        for m in messages:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), (str, list))
            ):
                return 'every entry of "messages" needs a string "role" and a "content" (text)'
        return None
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
        return '"turns" must be a non-empty list of strings'
    return None


def encode(tokenizer, record: dict) -> torch.LongTensor:
    """Token ids (1, L) of one prompt record; chat records go through the tokenizer's chat template."""
    if "prompt" in record:
        return tokenizer(record["prompt"], return_tensors="pt").input_ids
    messages = record.get("messages") or [{"role": "user", "content": record["turns"][0]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return ids["input_ids"]


@torch.no_grad()
def timed_generate(target, input_ids, max_new_tokens, drafter=None, **generate_kwargs):
    """generate() on `input_ids` (1, L), greedy unless `generate_kwargs` say otherwise: (new tokens (n,), seconds)."""
    input_ids = input_ids.to(target.device)
    settings = {"do_sample": False, **generate_kwargs}
    start = time.perf_counter()
    out = target.generate(
        input_ids,
        max_new_tokens=max_new_tokens,
        assistant_model=drafter,
        attention_mask=torch.ones_like(input_ids),
        **settings,
    )
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out[0, input_ids.shape[1] :], time.perf_counter() - start
