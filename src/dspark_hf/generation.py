"""The one module that touches transformers' private generation API.

`generate()` picks its candidate generator in `GenerationMixin._get_candidate_generator`, a closed if/elif chain
with no registry. We wrap it once, narrowly: when the assistant's `config.model_type` is one of this package's
drafters ("dspark" -> `DSparkCandidateGenerator`, "dspark_eagle3" -> `Eagle3CandidateGenerator`, see
`candidate_generator_class`; duck-typed, so a drafter loaded with `trust_remote_code` works too) we return its
candidate generator; everything else goes to the original. `enable(model)` / `disable(model)` do the same for one
object only, and `generate` is a `custom_generate` entry point. Each private name used here is listed in
`_PRIVATE_API` and checked at import.
Inside `record_draft_rounds()` every candidate generator the selector returns (DSpark's or transformers' own) also
logs the wall time and size of each drafting round, for the evaluation harness.

Tested with transformers 5.24 and 5.25 (5.25 reads `CandidateGenerator.num_drafting_tokens`).
"""

import contextlib
import functools
import time
import types
from dataclasses import dataclass

import torch
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


def candidate_generator_class(model):
    """The candidate generator class for one of this package's drafters, or None for any other assistant.

    Imported on first use; the imports stay literal so that remote-code checkpoints ship these modules.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "dspark":
        from .candidate_generator import DSparkCandidateGenerator

        return DSparkCandidateGenerator
    if model_type == "dspark_eagle3":
        from .eagle3_candidate_generator import Eagle3CandidateGenerator

        return Eagle3CandidateGenerator
    return None


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
        generator_class = candidate_generator_class(assistant_model)
        if generator_class is not None:
            generator = generator_class(
                assistant_model,
                self,
                generation_config,
                logits_processor,
                input_ids=input_ids,
                tokenizer=kwargs.get("target_tokenizer"),
            )
        else:
            generator = original(
                self,
                generation_config=generation_config,
                input_ids=input_ids,
                inputs_tensor=inputs_tensor,
                logits_processor=logits_processor,
                model_kwargs=model_kwargs,
                assistant_model=assistant_model,
                **kwargs,
            )
        return _observe(generator)

    setattr(selector, _MARKER, True)
    return selector


@dataclass
class DraftRound:
    """One `get_candidates` call of a candidate generator inside `generate()`.

    start: `time.perf_counter()` when drafting began; seconds: wall time of the call (drafting only, the target's
    verify pass follows it); proposed: draft tokens returned; first: the call before the prefill (DSpark drafts
    nothing there, transformers' assistants draft from the prompt); accepted: drafts the target accepted, from
    `update_candidate_strategy` (None if the loop ended before it).
    """

    start: float
    seconds: float
    proposed: int
    first: bool
    accepted: int | None = None


_RECORDERS: list[list[DraftRound]] = []


@contextlib.contextmanager
def record_draft_rounds():
    """Within the block, every `generate()` with an assistant appends its drafting rounds to the yielded list."""
    rounds: list[DraftRound] = []
    _RECORDERS.append(rounds)
    try:
        yield rounds
    finally:
        _RECORDERS.remove(rounds)


def _synchronize(tensor) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _observe(generator):
    """Time `generator.get_candidates` and note accepted counts while a `record_draft_rounds()` block is open."""
    if not _RECORDERS:
        return generator
    rounds, get_candidates, update = _RECORDERS[-1], generator.get_candidates, generator.update_candidate_strategy
    own: list[DraftRound] = []

    def timed_get_candidates(input_ids, *args, **kwargs):
        _synchronize(input_ids)
        start = time.perf_counter()
        candidate_ids, candidate_logits = get_candidates(input_ids, *args, **kwargs)
        _synchronize(candidate_ids)
        proposed = candidate_ids.shape[1] - input_ids.shape[1]
        own.append(DraftRound(start, time.perf_counter() - start, proposed, first=not own))
        rounds.append(own[-1])
        return candidate_ids, candidate_logits

    def counted_update(input_ids, scores, num_matches):
        if own:
            own[-1].accepted = int(num_matches)
        return update(input_ids, scores, num_matches)

    generator.get_candidates = timed_get_candidates
    generator.update_candidate_strategy = counted_update
    return generator


def install_candidate_generator() -> None:
    """Route `generate(assistant_model=<drafter of this package>)` to its candidate generator for every model.
    Idempotent."""
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


__all__ = [
    "DraftRound",
    "candidate_generator_class",
    "disable",
    "enable",
    "generate",
    "install_candidate_generator",
    "is_dspark_drafter",
    "record_draft_rounds",
]
