"""Export a DSpark drafter as a GGUF draft model for llama.cpp (`--spec-type draft-dspark`).

llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py`, class `DSparkModel` in `conversion/qwen.py`) reads the
speculators format (`architectures=["DSparkSpeculator"]`) as well as DeepSpec's, so this module writes the drafter
with `export_speculators`, writes the target's `config.json` and tokenizer next to it (the converter takes the draft's
vocabulary from `--target-model-dir`), and runs the converter of a llama.cpp source tree (for instance the one the
`llama-cpp-python` sdist vendors, see `tools/llamacpp_dspark.sh`). Nothing of llama.cpp is copied here; which
converter ran is the one at `llamacpp_dir`.

What llama.cpp's DSpark path carries (llama.cpp as vendored by llama-cpp-python 0.3.36; see docs/engines.md):

* the vanilla Markov head only: `conversion/qwen.py` (`DSparkModel.__init__`) raises for any other
  `markov_head_type`, so `gated_markov` and `rnn` drafters are refused here;
* a confidence head only on `[h ; W1[x]]`: `src/models/dflash.cpp` creates `conf_proj` with shape `n_embd + rank`,
  so a confidence head without the Markov input (`confidence_with_markov=False`) is refused;
* without a sequential head (`sequential_head="none"`) the GGUF is a DFlash drafter, which llama.cpp runs with
  `--spec-type draft-dflash` (the Markov tensors are what select draft-dspark);
* a draft vocabulary (written as `d2t`, absolute token ids) and any Llama-family or Qwen3 target whose llama.cpp
  graph records its layer inputs (`res->t_layer_inp`, e.g. `src/models/llama.cpp`, `src/models/qwen3.cpp`);
* a bounded context window (`context_window`): the converter reads the speculators folder's `use_sliding_window`,
  `sliding_window` and `layer_types` into `attention.sliding_window` and its per-layer pattern
  (`conversion/qwen.py`, `DFlashModel.set_gguf_parameters`), and `src/models/dflash.cpp` builds the draft's KV cache
  with that window. llama.cpp windows per query position (`llama_hparams::is_masked_swa`: a key is hidden once
  `p_query - p_key >= W`), so the slot at a + j sees the context back to a + j - W + 1: the j + 1 oldest of the W
  positions ours sees are missing there (drafts may differ there, never the output).
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from transformers.utils import logging

from ..models.modeling_dspark import DSparkDraftModel
from ..utils.devices import below_float16, below_float16_text
from .export import check_exportable
from .speculators import export_speculators


logger = logging.get_logger(__name__)

ENGINE = "llama.cpp (GGUF)"
OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
_FLOAT16_BASED = ("f16", "q8_0")  # q8_0 stores a float16 scale per block of 32 values


def gguf_blockers(drafter: DSparkDraftModel) -> list[tuple[str, str]]:
    """`(field, reason)` for what llama.cpp's DSpark converter or graph cannot carry (beyond `export_blockers`)."""
    config = drafter.config
    out = []
    if config.sequential_head in ("gated_markov", "rnn"):
        out.append(
            (
                "sequential_head",
                f"{config.sequential_head!r}: llama.cpp's converter (conversion/qwen.py, DSparkModel) supports only "
                "the vanilla Markov head ('markov')",
            )
        )
    if config.confidence_head and not config.confidence_with_markov:
        out.append(
            (
                "confidence_with_markov",
                "False: llama.cpp's conf_proj (src/models/dflash.cpp) reads [h ; W1[x]] (hidden + Markov rank inputs)",
            )
        )
    return out


def find_converter(llamacpp_dir: str | os.PathLike | None) -> Path:
    """`convert_hf_to_gguf.py` of the llama.cpp source tree at `llamacpp_dir` (or `$LLAMACPP_DIR`)."""
    folder = llamacpp_dir or os.environ.get("LLAMACPP_DIR")
    if not folder:
        raise ValueError(
            "GGUF export runs llama.cpp's own converter: pass the llama.cpp source folder with --llamacpp DIR (or set "
            "LLAMACPP_DIR), e.g. the one tools/llamacpp_dspark.sh unpacks from the llama-cpp-python sdist."
        )
    script = Path(folder) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ValueError(f"No convert_hf_to_gguf.py in {folder}; point --llamacpp at a llama.cpp source tree.")
    return script


def export_gguf(
    drafter: DSparkDraftModel,
    target,
    tokenizer,
    out_file: str | os.PathLike,
    llamacpp_dir: str | os.PathLike | None = None,
    outtype: str = "auto",
    overwrite: bool = False,
    python: str | None = None,
) -> Path:
    """Write `drafter` as a llama.cpp GGUF draft model at `out_file` through llama.cpp's converter.

    `tokenizer` is the target's (the GGUF carries the vocabulary llama.cpp compares with the target's). `outtype` is
    the converter's (f32, f16, bf16, q8_0), or "auto": f16, or bf16 when weights of the drafter lie below float16's
    range (`utils.devices.below_float16`, e.g. an exact QK-norm twin's q/k projections), which f16 and q8_0 refuse.
    `python` runs the converter (default: this interpreter); it needs
    llama.cpp's converter requirements (`requirements/requirements-convert_hf_to_gguf.txt`: torch, numpy,
    sentencepiece, transformers), e.g. a separate environment. `ValueError` names what llama.cpp cannot carry;
    `RuntimeError` carries the converter's output when it fails. The file is written under a temporary name and
    renamed into place.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"`outtype` must be one of {list(OUTTYPES)}, got {outtype!r}.")
    drafter.config.check_target(target.config)
    check_exportable(drafter.config, ENGINE)
    blockers = gguf_blockers(drafter)
    if blockers:
        raise ValueError(
            f"This drafter cannot be exported for {ENGINE}: "
            + "; ".join(f"`{field}`: {reason}" for field, reason in blockers)
            + ". Export it with --format speculators or deepspec instead, or train a drafter with "
            "sequential_head='markov' (and confidence_with_markov=True)."
        )
    tiny = below_float16(drafter)
    if outtype == "auto":
        outtype = "bf16" if tiny else "f16"
    elif outtype in _FLOAT16_BASED and tiny:
        raise ValueError(
            f"--outtype {outtype} cannot hold this drafter: {below_float16_text(tiny)}. Use --outtype bf16 or f32 "
            "(or auto)."
        )
    script = find_converter(llamacpp_dir)
    if getattr(drafter.config, "context_window", None) is not None:
        logger.warning(
            f"llama.cpp applies the drafter's context window ({drafter.config.context_window}) per query position: "
            "block slot j sees j + 1 fewer of the oldest context positions than here, so its drafts can differ on "
            "long prompts (the output never does)."
        )
    out_file = Path(out_file)
    if out_file.exists() and not overwrite:
        raise FileExistsError(f"{out_file} exists; pass overwrite=True (--overwrite) to replace it.")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dspark-gguf-") as tmp:
        draft_dir, target_dir = Path(tmp) / "draft", Path(tmp) / "target"
        export_speculators(drafter, target, draft_dir)
        target_config = target.config.get_text_config(decoder=True)
        if not getattr(target_config, "architectures", None):  # e.g. a target loaded from a GGUF file
            target_config.architectures = [type(target).__name__]
        target_config.save_pretrained(target_dir)
        tokenizer.save_pretrained(target_dir)
        partial = out_file.with_name(f".{out_file.name}.tmp")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(script.parent / "gguf-py")  # the tree's own gguf package, never ours
        cmd = [python or sys.executable, str(script), str(draft_dir), "--target-model-dir", str(target_dir)]
        cmd += ["--outfile", str(partial), "--outtype", outtype]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0 or not partial.is_file():
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"llama.cpp's converter ({script}) failed:\n{(run.stdout + run.stderr)[-4000:]}")
        os.replace(partial, out_file)
    return out_file


__all__ = ["export_gguf", "find_converter", "gguf_blockers"]
