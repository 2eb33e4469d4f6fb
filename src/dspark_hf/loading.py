"""Checkpoint checks: safetensors only, no corrupt files, no silently random weights."""

import os

from safetensors import SafetensorError, safe_open


_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "tf_model.h5")


def check_checkpoint_files(path, kwargs: dict) -> None:
    """For a local checkpoint folder: refuse pickle-only weights, missing weights and corrupt safetensors files."""
    folder = os.path.join(str(path), kwargs.get("subfolder") or "")
    if not os.path.isdir(folder):
        return  # a Hub repo id: `use_safetensors=True` makes transformers refuse non-safetensors repos
    names = os.listdir(folder)
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if not shards:
        pickles = [n for n in names if n in _PICKLE_WEIGHTS or n.endswith((".bin", ".pt", ".pth"))]
        if pickles:
            raise ValueError(
                f"{folder} holds only pickle weights ({', '.join(pickles)}); DSpark drafters load from safetensors "
                "only, because unpickling can run arbitrary code. Convert them once in a trusted environment: "
                "`model.save_pretrained(out_dir)` writes model.safetensors."
            )
        raise OSError(f"No model.safetensors in {folder}; it is not a complete DSpark checkpoint (config.json only?).")
    for name in shards:
        try:
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(
                f"{os.path.join(folder, name)} is not a readable safetensors file ({err}). "
                "The file is truncated or corrupt: copy or download the checkpoint again."
            ) from err


def raise_on_incomplete_load(path, loading_info: dict) -> None:
    """A drafter with missing or mis-shaped weights would draft noise: fail instead of warning."""
    missing = sorted(loading_info.get("missing_keys") or [])
    mismatched = loading_info.get("mismatched_keys") or []
    if missing:
        raise ValueError(
            f"The checkpoint at {path} lacks {len(missing)} drafter weight(s), e.g. {missing[:5]}; the model would "
            "start from random values. Was it saved by a different DSpark configuration?"
        )
    if mismatched:
        raise ValueError(f"The checkpoint at {path} has weights of the wrong shape: {list(mismatched)[:5]}.")
