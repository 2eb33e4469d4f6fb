"""Files a user keeps: JSON written atomically (never half-written), folders written atomically and never over a
user's files unless told to (`write_folder`), and JSONL read line by line (plain or gzipped)."""

import gzip
import json
import os
import secrets
import shutil
from collections.abc import Callable
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


def check_folder_free(path: str | os.PathLike, overwrite: bool = False, how: str = "overwrite=True") -> Path:
    """`path` as a Path, when it may be written: absent, an empty folder, or `overwrite`.

    `FileExistsError` in one line naming the folder and `how` to overwrite it (`overwrite=True` for the Python API,
    `--overwrite` for the command line) otherwise; a file where a folder should go is refused even with `overwrite`.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a folder; remove it or choose another folder.")
    if not overwrite and path.is_dir() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty; pass {how} to replace it, or choose another folder.")
    return path.resolve() if path.is_symlink() else path  # a link: its folder is written, the link stays


def replace_folder(new: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Rename the complete folder `new` to `path`; an existing `path` is first renamed aside (hidden, beside it) and
    removed only once `new` is in place (put back if that fails), so `path` holds the old content or the new, never
    a mix, and the old is deleted only after the new is complete. Between the two renames (microseconds) `path` is
    absent. Both must be on one filesystem (`new_folder_beside` makes such a folder)."""
    new, path = Path(new), Path(path)
    if not path.exists():
        os.rename(new, path)
        return path
    old = new_folder_beside(path, "old")
    os.rename(path, old / path.name)  # moved aside whole, inside a hidden folder
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old / path.name, path)  # put back: the old content stays where it was
        old.rmdir()
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def write_folder(
    path: str | os.PathLike, write: Callable[[Path], None], overwrite: bool = False, how: str = "overwrite=True"
) -> Path:
    """Write a folder atomically: refuse a non-empty `path` unless `overwrite` (`check_folder_free`), call
    `write(tmp)` on a new hidden folder beside `path`, then rename it into place (`replace_folder`). If `write`
    fails, the temporary folder is removed and `path` is as it was."""
    path = check_folder_free(path, overwrite, how)
    tmp = new_folder_beside(path)
    try:
        write(tmp)
        check_folder_free(path, overwrite, how)  # filled meanwhile (another process)?
        return replace_folder(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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
