"""No copy of a model's weights answers for weights that changed since it was made.

The kernels keep derived forms of weights between calls: the target's packed linears (`verify_linears.TargetPacks`),
the drafter's packed linears (`packed_linear`), gathered or cast LM-head rows and dequantized heads
(`few_rows.kept_copy`). Each is checked in two ways:

- at every use, cheaply: the same tensor object, at the same address, with the same in-place version counter. This
  sees a new tensor (`load_state_dict(assign=True)`, `param.data = ...`), a dtype or device move, `load_state_dict`,
  optimizer steps and every in-place op on the parameter;
- once per `generate()` call, and each time an `Engine` starts work after being idle (`drop_stale`, called by
  `SpeculativeDecoder.prefill` on an empty batch): the weights' content fingerprints (`fingerprint.py`) against those
  taken when the copy was made, and the target's packed linears against the linears it holds now. This sees edits
  through `weight.data` (peft's `merge_and_unload`, `.data.mul_`, a slice of `.data`), edits of inference tensors,
  and modules swapped or wrapped (peft's LoRA layers, a debugging wrapper).

A stale copy is dropped and made again from the current weights at its next use. Edits made while a `generate()` call
or an Engine's batch is running (from a streamer, a logits processor or another thread) are seen by the first check
only; an edit through `.data` mid-call is seen at the next call. Measured costs are in docs/reliability.md.
"""

from torch import nn
from transformers.utils import logging

from .few_rows import drop_stale_kept
from .verify_linears import stale_packs


logger = logging.get_logger(__name__)


def drop_stale(*models: nn.Module | None) -> int:
    """Drop every kept copy derived from `models`' weights (the target's packs; copies kept for any of their modules)
    whose weights changed since it was made; returns how many were dropped. Shared weights are read once."""
    fingerprints: dict = {}
    dropped = 0
    for model in models:
        if model is None:
            continue
        dropped += stale_packs(model, fingerprints)
        for module in model.modules():
            dropped += drop_stale_kept(module, fingerprints)
    if dropped:
        logger.info(f"{dropped} kept weight copies were stale (the weights changed since they were made): made anew.")
    return dropped


__all__ = ["drop_stale"]
