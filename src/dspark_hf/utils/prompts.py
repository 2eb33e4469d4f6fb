"""Prompt records (JSONL with `prompt`, `messages` or `turns`) and their token ids, for the evaluation harness, the
demo and the OpenAI protocol."""

from pathlib import Path

import torch

from .files import read_jsonl


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
        if not isinstance(record["prompt"], str):
            return '"prompt" must be a string'
        return None if record["prompt"] else '"prompt" is empty; give the text to continue'
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
