"""Checkpoint checks: safetensors only, no corrupt files, no silently random weights."""

import json
import os
import re

from safetensors import SafetensorError, safe_open


_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "tf_model.h5")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(path) -> bool:
    """Whether `path` could name a Hub repository ("name" or "owner/name"): no absolute or relative-path marks."""
    text = str(path)
    return bool(_HUB_ID.match(text)) and ".." not in text and not text.endswith((".json", ".safetensors"))


def check_local_folder(path, subfolder: str = "") -> None:
    """A checkpoint path that is meant as a local folder must be one holding a readable `config.json` (a JSON
    object): FileNotFoundError / ValueError saying which, rather than the Hub's "Repo id must be in the form ..."
    or a bare JSONDecodeError. A path that could be a Hub repo id and is not on disk is left to the Hub."""
    base = os.path.expanduser(str(path))
    if not os.path.exists(base) and looks_like_hub_id(path):
        return
    folder = os.path.join(base, subfolder) if subfolder else base
    if not os.path.exists(folder):
        raise FileNotFoundError(f"No DSpark checkpoint (config.json) at {folder}: the folder does not exist.")
    if not os.path.isdir(folder):
        raise ValueError(f"{folder} is a file; a checkpoint is a folder holding config.json and model.safetensors.")
    read_config_file(os.path.join(folder, "config.json"))


def read_config_file(config_path) -> dict:
    """A checkpoint's `config.json` as a dict, or an error naming the file (missing, not JSON, not an object)."""
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"No DSpark checkpoint (config.json) at {os.path.dirname(str(config_path))}.")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON ({err}); the checkpoint's config is corrupt.") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{config_path} holds a JSON {type(config).__name__}, not a model config (a JSON object of fields)."
        )
    return config


# fields a DeepSpec draft config.json adds to the target's config (`integrations/deepspec.py`)
_DEEPSPEC_FIELDS = ("num_target_layers", "target_layer_ids", "block_size", "markov_rank")


def check_model_type(path, expected: str, subfolder: str = "") -> None:
    """A local checkpoint folder must hold a config.json of `expected` model_type: a target's folder, or a DeepSpec
    config.json that lost its `architectures` (by which DeepSpec checkpoints are recognised), is named as such
    rather than failing later inside transformers. Hub ids and folders without a config.json are left alone."""
    folder = os.path.join(os.path.expanduser(str(path)), subfolder)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        return
    config = read_config_file(config_path)
    found = config.get("model_type")
    if found == expected:
        return
    if all(k in config for k in _DEEPSPEC_FIELDS) and not config.get("architectures"):
        raise ValueError(
            f"{config_path} looks like a DeepSpec DSpark config (it has {list(_DEEPSPEC_FIELDS)}) but lacks "
            '`architectures`, by which DeepSpec checkpoints are recognised: add "architectures": ["Qwen3DSparkModel"] '
            '(or ["Gemma4DSparkModel"]) to it.'
        )
    raise ValueError(
        f"{config_path} has model_type {found!r}, not {expected!r}: it is not this kind of drafter's checkpoint "
        "(a target model's folder?)."
    )


def check_checkpoint_files(path, kwargs: dict) -> None:
    """For a local checkpoint folder: refuse a missing folder or config.json, a corrupt config.json, pickle-only
    weights, missing weights and corrupt safetensors files."""
    subfolder = kwargs.get("subfolder") or ""
    check_local_folder(path, subfolder)
    folder = os.path.join(os.path.expanduser(str(path)), subfolder)
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
