"""The one module that touches transformers' private generation API.

`generate()` picks its candidate generator in `GenerationMixin._get_candidate_generator`, a closed if/elif chain
with no registry. We wrap it once, narrowly: when the assistant's `config.model_type == "dspark"` (duck-typed, so a
drafter loaded with `trust_remote_code` works too) we return a `DSparkCandidateGenerator`; everything else goes to
the original. `enable(model)` / `disable(model)` do the same for one object only, and `generate` is a
`custom_generate` entry point. Each private name used here is listed in `_PRIVATE_API` and checked at import.

Tested with transformers 5.24 and 5.25 (5.25 reads `CandidateGenerator.num_drafting_tokens`).
"""

import functools
import types

import transformers
from packaging import version
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging


logger = logging.get_logger(__name__)

MIN_VERSION, MAX_VERSION = "5.24.0", "6.0.0"
_PRIVATE_API = ("_get_candidate_generator", "_assisted_decoding")
_MARKER = "_dspark_selector"


def check_transformers_version() -> None:
    """Raise a clear error on a transformers release whose assisted-decoding internals we have not checked."""
    found = version.parse(transformers.__version__)
    if not version.parse(MIN_VERSION) <= found < version.parse(MAX_VERSION):
        raise ImportError(
            f"dspark-hf needs transformers>={MIN_VERSION},<{MAX_VERSION}; found {transformers.__version__}. "
            f'Install a supported release: pip install "transformers>={MIN_VERSION},<{MAX_VERSION}".'
        )
    missing = [name for name in _PRIVATE_API if not hasattr(GenerationMixin, name)]
    if missing:
        raise ImportError(
            f"transformers {transformers.__version__} lacks GenerationMixin.{', '.join(missing)}, which DSpark's "
            "generate() integration relies on. Please report this with your transformers version."
        )


def is_dspark_drafter(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "dspark"


def eos_token_ids(generation_config) -> list[int]:
    """The EOS ids `generate()` stops on (private attribute `_eos_token_tensor`, set during `generate()`)."""
    tensor = getattr(generation_config, "_eos_token_tensor", None)
    return [] if tensor is None else [int(t) for t in tensor.flatten().tolist()]


def _wrap_selector(original):
    @functools.wraps(original)
    def selector(
        self,
        generation_config,
        input_ids,
        inputs_tensor,
        logits_processor,
        model_kwargs,
        assistant_model=None,
        **kwargs,
    ):
        if is_dspark_drafter(assistant_model):
            from .candidate_generator import DSparkCandidateGenerator

            return DSparkCandidateGenerator(
                assistant_model,
                self,
                generation_config,
                logits_processor,
                input_ids=input_ids,
                tokenizer=kwargs.get("target_tokenizer"),
            )
        return original(
            self,
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            **kwargs,
        )

    setattr(selector, _MARKER, True)
    return selector


def install_candidate_generator() -> None:
    """Route `generate(assistant_model=<dspark drafter>)` to DSpark for every model. Idempotent."""
    check_transformers_version()
    current = GenerationMixin._get_candidate_generator
    if not getattr(current, _MARKER, False):
        GenerationMixin._get_candidate_generator = _wrap_selector(current)


def enable(model):
    """Per-object routing, for users who prefer not to rely on the global install. Returns `model`."""
    check_transformers_version()
    original = type(model)._get_candidate_generator
    if not getattr(original, _MARKER, False):
        model._get_candidate_generator = types.MethodType(_wrap_selector(original), model)
    return model


def disable(model):
    """Undo `enable(model)`."""
    model.__dict__.pop("_get_candidate_generator", None)
    return model


def generate(model, *args, **kwargs):
    """`custom_generate` entry point: `target.generate(..., custom_generate=dspark_hf.generate, ...)`."""
    return GenerationMixin.generate(enable(model), *args, **kwargs)


__all__ = ["disable", "enable", "generate", "install_candidate_generator", "is_dspark_drafter"]
