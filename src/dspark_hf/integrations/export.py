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
from collections.abc import Callable
from pathlib import Path

from ..models.configuration_dspark import DSparkConfig
from ..utils import files


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
    format and GGUF do, as a sliding window). It is no property of the weights: `window_refusal` says how to export
    the drafter without it, and what that changes."""
    if getattr(config, "context_window", None) is None:
        return []
    return [("context_window", f"{config.context_window}: the DeepSpec format has no sliding window")]


def window_refusal(config: DSparkConfig) -> str:
    """Why a drafter with a `context_window` is not exported to DeepSpec as it is, and the two ways to export it."""
    window = config.context_window
    return (
        f"This drafter drafts from a bounded context window (`context_window` = {window}: each block attends to the "
        f"{window} positions before it), which the DeepSpec format cannot carry. Export it with --format speculators "
        "(vLLM) or gguf (llama.cpp), which keep the window, or pass drop_context_window=True (dspark-hf export "
        f"--drop-context-window) to export the same weights without it: the engine's drafter then attends to the "
        f"whole context, so on prompts longer than {window} tokens its drafts, and so the acceptance and speed-up, "
        "may differ from what this drafter was measured with (the output stays the target's)."
    )


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
    """`utils.files.write_folder`: `write(tmp)` on a folder beside `out_dir`, renamed into place once complete.

    `FileExistsError` (before `write` runs) when `out_dir` is not empty and `overwrite` is False; an overwritten
    folder keeps its old content until the new one is complete.
    """
    return files.write_folder(out_dir, write, overwrite=overwrite)


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = ["check_exportable", "export_blockers", "window_blockers", "window_refusal", "write_folder", "write_json"]
