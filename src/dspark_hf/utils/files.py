"""Files a user keeps: JSON written atomically (never half-written) and JSONL read line by line (plain or
gzipped)."""

import gzip
import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    """Write `text` to `path` via a temporary file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(obj, path: str | os.PathLike) -> None:
    """Write JSON to `path` atomically (see `atomic_write_text`)."""
    atomic_write_text(json.dumps(obj, indent=2) + "\n", path)


def read_jsonl(path: str | os.PathLike):
    """Yield `(line number, record)` for every non-blank line (gzipped when the name ends in .gz); ValueError names a
    line that is not JSON."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({err}).") from err
