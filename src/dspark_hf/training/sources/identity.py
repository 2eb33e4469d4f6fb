"""Text identity of prompts: the normalised form, the held-out split and the evaluation guard.

`normalize` is the form used for de-duplication, the split hash and the guard. `is_heldout` splits by a hash of the
normalised text alone, so a prompt is held out (or not) whatever the seed or the other prompts. `EvalGuard` rejects
any text that shares an evaluation prompt.
"""

import hashlib
import os
import re
from collections.abc import Iterable

from ...utils.files import read_jsonl


def normalize(text: str) -> str:
    """Lower-case with collapsed whitespace: the form used for de-duplication, the split hash and the eval guard."""
    return " ".join(text.lower().split())


def prompt_text(record: dict) -> str:
    """The user-visible text of a record: `prompt`, else all user turns (`messages` or `turns`), joined by newlines."""
    if "prompt" in record:
        return str(record["prompt"])
    if "messages" in record:
        return "\n".join(str(m.get("content", "")) for m in record["messages"] if m.get("role", "user") == "user")
    return "\n".join(str(t) for t in record.get("turns", []))


def is_heldout(text: str, fraction: float = 0.05) -> bool:
    """Stable split: True for about `fraction` of all texts, decided by a SHA-256 of the normalised text alone."""
    digest = hashlib.sha256(normalize(text).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class EvalGuard:
    """Rejects any text that shares an evaluation prompt.

    A text is rejected if its normalised form equals an evaluation turn, or if it shares any run of `ngram`
    consecutive words with one (so a training prompt that quotes or wraps an evaluation prompt is caught too; the
    13-word overlap test of the GPT-3 contamination study). Evaluation files are JSONL with `turns`, `messages` or
    `prompt`, like /work/shared/data/eval or the `dspark-hf bench` prompt files.
    """

    def __init__(self, files: Iterable[str | os.PathLike] = (), ngram: int = 13):
        self.ngram, self.files = ngram, [str(f) for f in files]
        self.exact: set[str] = set()
        self.grams: set[str] = set()
        for path in self.files:
            for _, record in read_jsonl(path):
                if isinstance(record, str):
                    record = {"prompt": record}
                turns = record.get("turns") or [
                    m.get("content", "") for m in record.get("messages", []) if m.get("role", "user") == "user"
                ]
                if "prompt" in record:
                    turns = [record["prompt"], *turns]
                for turn in turns:
                    self.add(str(turn))
        self.rejected = 0

    def add(self, text: str) -> None:
        self.exact.add(normalize(text))
        self.grams.update(self._grams(text))

    def _grams(self, text: str) -> set[str]:
        words = _words(text)
        return {" ".join(words[i : i + self.ngram]) for i in range(len(words) - self.ngram + 1)}

    def __len__(self) -> int:
        return len(self.exact)

    def contains(self, text: str) -> bool:
        if not self.exact:
            return False
        if normalize(text) in self.exact:
            return True
        words = _words(text)
        return any(" ".join(words[i : i + self.ngram]) in self.grams for i in range(len(words) - self.ngram + 1))

    def allows(self, text: str) -> bool:
        """False (and counted in `rejected`) for a text that overlaps the evaluation prompts."""
        if self.contains(text):
            self.rejected += 1
            return False
        return True
