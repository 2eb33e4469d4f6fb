"""A training checkpoint's manifest: the sha256 of every other file of the folder, written last, so that a checkpoint
whose files all match it is complete and intact (`checkpoint_problem`), and a damaged one is told apart before
`--resume` trusts it (`trainer.find_resume_checkpoint`)."""

import hashlib
import json
import os
from pathlib import Path


MANIFEST = "manifest.json"  # sha256 of every other file of a checkpoint, written last


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _digest_of(sums: dict) -> str:
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()


def write_manifest(folder: Path) -> None:
    """Write `folder/manifest.json`: the sha256 of every other file in `folder`, atomically (temporary name, then
    renamed), after everything else is written."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, f".{MANIFEST}.tmp"))
    sums = {p.relative_to(folder).as_posix(): _sha256(p) for p in files}
    manifest = {"sha256": sums, "self": _digest_of(sums)}  # "self": a damaged manifest is told from damaged files
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)


def checkpoint_problem(folder: Path) -> str | None:
    """Why the checkpoint in `folder` cannot be trusted (missing, no or unreadable manifest, a file missing or
    changed since it was written), or None when every file matches its manifest checksum."""
    if not folder.is_dir():
        return f"{folder} does not exist"
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        sums = manifest["sha256"]
        if not isinstance(sums, dict) or manifest["self"] != _digest_of(sums):
            raise TypeError
    except FileNotFoundError:
        return f"{folder / MANIFEST} is missing"
    except (ValueError, TypeError, KeyError):
        return f"{folder / MANIFEST} is corrupt"
    for name, expected in sorted(sums.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if _sha256(path) != expected:
            return f"{path} does not match its checksum (corrupt)"
    return None


__all__ = ["MANIFEST", "checkpoint_problem", "write_manifest"]
