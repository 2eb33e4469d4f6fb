"""What every foreign checkpoint format needs from a DSpark drafter, and the folder writing they share.

Serving engines (vLLM through the `speculators` format, SGLang through DeepSpec's, llama.cpp through GGUF) all run
DSpark drafters with a *Qwen3* draft layer: a Llama block plus per-head RMSNorm on queries and keys (QK-norm), the
γ-1 mask slots embedded as a vocabulary token (`mask_token_id`), no MLP biases, and no Gemma-style embedding scale
or logit soft-capping. `export_blockers` lists which of these a drafter misses, as `(field, reason)` pairs, so an
exporter can refuse it with one message naming the field and the engine. Weights cannot be converted afterwards (a
learned mask vector is not any token's embedding; QK-norm changes every attention score), which is why
`DSparkConfig.for_target` builds exportable drafters by default (`exportable=False` opts out).
"""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from ..models.configuration_dspark import DSparkConfig
from ..utils.files import new_folder_beside


def export_blockers(config: DSparkConfig) -> list[tuple[str, str]]:
    """`(field, reason)` for every property of `config` that the engines' Qwen3 draft layer cannot represent."""
    out = []
    if config.target_model_type.startswith("gemma") or config.final_logit_softcapping is not None:
        out.append(
            (
                "target_model_type",
                f"it was made for a {config.target_model_type!r} (Gemma-family) target, whose sqrt(d) embedding scale "
                "and logit soft-capping the Qwen3 draft layer does not apply",
            )
        )
    if not config.use_qk_norm:
        out.append(("use_qk_norm", "it has no QK-norm (`use_qk_norm=False`); the Qwen3 draft layer always applies it"))
    if config.mask_token_id is None:
        out.append(
            (
                "mask_token_id",
                "it learns a mask embedding (`mask_token_id=None`); the engines embed a vocabulary mask token",
            )
        )
    if config.mlp_bias:
        out.append(("mlp_bias", "its MLP has biases (`mlp_bias=True`); Qwen3's has none"))
    return out


def window_blockers(config: DSparkConfig) -> list[tuple[str, str]]:
    """The bounded context window (`context_window`), which the DeepSpec export does not carry (the speculators
    format and GGUF do, as a sliding window): DeepSpec's draft layer would attend to the whole context and draft from
    another distribution than the drafter was measured with."""
    if getattr(config, "context_window", None) is None:
        return []
    return [
        (
            "context_window",
            f"{config.context_window}: the DeepSpec export has no sliding window, so its draft layer would attend to "
            "the whole context (the speculators and GGUF formats carry the window); set "
            "`drafter.config.context_window = None` before exporting if the drafter was trained without a window "
            "(acceptance on long prompts may then drop)",
        )
    ]


def check_exportable(config: DSparkConfig, engine: str) -> None:
    """Raise `ValueError` naming each blocking field and `engine` (e.g. "vLLM / speculators")."""
    blockers = export_blockers(config)
    if blockers:
        raise ValueError(
            f"This drafter cannot be exported for {engine}: "
            + "; ".join(f"`{field}`: {reason}" for field, reason in blockers)
            + ". Weights cannot be converted afterwards: build the drafter with "
            "DSparkConfig.for_target(target.config) (exportable by default: use_qk_norm=True and a vocabulary "
            "mask_token_id), train it, then export it."
        )


def write_folder(out_dir: str | os.PathLike, overwrite: bool, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp)` on a temporary folder next to `out_dir`, then rename it into place (atomic for readers).

    `FileExistsError` when `out_dir` exists, is not empty and `overwrite` is False.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace it.")
    tmp = new_folder_beside(out_dir)
    try:
        write(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = ["check_exportable", "export_blockers", "window_blockers", "write_folder", "write_json"]
