"""Files a user keeps: JSON written atomically (never half-written) and JSONL read line by line (plain or
gzipped)."""

import gzip
import json
import os
import secrets
from pathlib import Path


def atomic_write_text(text: str, path: str | os.PathLike) -> None:
    """Write `text` to `path` via a temporary file in the same folder and an atomic rename. The file gets the
    permissions `open()` would give it (those of the file it replaces, if any), not `tempfile`'s owner-only 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # closes the descriptor however the write ends
            if path.exists():
                os.fchmod(f.fileno(), path.stat().st_mode & 0o7777)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def new_folder_beside(path: str | os.PathLike, tag: str = "tmp") -> Path:
    """A new empty folder next to `path` (hidden, a random name), to be filled and renamed to `path`: it has the
    permissions `mkdir` gives (`tempfile.mkdtemp`'s are owner-only 0700, which would stay on the renamed folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        folder = path.with_name(f".{path.name}.{tag}-{secrets.token_hex(6)}")
        try:
            folder.mkdir(mode=0o777)  # the umask applies
            return folder
        except FileExistsError:
            continue


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
