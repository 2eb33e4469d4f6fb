"""The drafter's linear layers on the CPU: oneDNN's prepacked weights, and bf16 where the CPU computes it natively.

A draft pass multiplies a handful of rows (the block's 7 slots, a few context positions, 1–7 positions through the
LM head) by weights that do not change between calls. On the CPU, torch's `F.linear` is slow for exactly such
shapes. oneDNN computes them near memory speed once the weight has been reordered into its blocked layout, and bf16
halves the memory traffic where the CPU computes it natively. On the development CPU this about halved the
default drafter's drafting round (docs/results.md has the dated numbers).

`pack_linears(model)` turns a model's CPU `nn.Linear`s into `PackedLinear`s. These compute through a prepacked
copy of their weight while no gradient is needed, and run `nn.Linear.forward` otherwise (training, other devices).
The copy is made on first use and rebuilt when the weight changes (another tensor, or an in-place update such as an
optimizer step). `linear(x, weight, bias, owner)` is the same product for a weight that is not a module's, such as the
target's LM-head rows a drafter borrows.

Packing uses two private torch operators (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`, what
torch's inductor uses for CPU linears). They are only used from this module, behind a one-time check that they exist
and agree with `F.linear`; without them everything takes `F.linear`. Set `OPTIONS.packed_linear = False` to turn
packing off.
"""

import functools

import torch
from torch import nn
from transformers.utils import logging

from .few_rows import kept_copies, kept_copy, linear_few_rows, version_counter
from .options import OPTIONS
from .weights import computes_with_weight, plain_tensor


logger = logging.get_logger(__name__)

MAX_ROWS = 64  # beyond this many rows (training batches, long prefills) `F.linear` is as good
BATCH_HINT = 4  # the row count oneDNN tunes the packed layout for; 1–16 rows all run near memory speed with it
FEW_ROWS_FLOAT32 = 4  # float32 up to this many rows: `linear_few_rows`, faster than prepacked for a few head rows
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _check_available() -> bool:
    """Whether the operators exist and agree with F.linear (checked once per process, on first use)."""
    try:
        # fixed values (the global RNG stays untouched: seeded sampling must not depend on this check)
        x, w = torch.arange(24.0).reshape(3, 8).sin(), torch.arange(40.0).reshape(5, 8).cos()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        return bool(torch.allclose(_product(x, packed, None, 5), x @ w.T, atol=1e-4))
    except (AttributeError, RuntimeError) as err:  # a torch build without oneDNN, or other operator signatures
        logger.info(f"Prepacked CPU linears unavailable ({err}); drafters use F.linear.")
        return False


@functools.cache
def bf16_native() -> bool:
    """Whether this CPU computes bf16 products natively (AVX-512 BF16 or AMX), so a bf16 drafter runs faster than
    a float32 one rather than emulating bf16 (asked once per process)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None and torch.backends.mkldnn.is_available() else False
    except RuntimeError:
        return False


def inference_dtype(device: torch.device | str = "cpu", target_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a drafter runs fastest in next to a target of `target_dtype` on `device`: on a CPU with native bf16,
    bfloat16 (the drafters are trained under bf16 autocast, and their checkpoints are stored in bf16); elsewhere the
    target's dtype."""
    if torch.device(device).type == "cpu" and bf16_native() and target_dtype in _PACKABLE_DTYPES:
        return torch.bfloat16
    return target_dtype


def _packable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        OPTIONS.packed_linear
        and not torch.is_grad_enabled()
        and plain_tensor(weight)  # no tensor subclass (torchao) or quantized weight: kernels/weights.py
        and weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and x.dtype == weight.dtype
        and (weight.dtype != torch.bfloat16 or bf16_native())  # oneDNN packs bf16 only where the CPU computes it
        and weight.dim() == 2
        and 0 < x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
        and _check_available()
    )


def packed_weight(owner: object, weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed copy of `weight` (out, in), kept for `owner` while the weight is unchanged (same storage, same
    in-place version counter).

    The copies live beside the owner (`few_rows.kept_copy`), not in it: a packed tensor has no storage, so a model
    holding one could not be deep-copied, pickled or `torch.save`d any more.
    """
    key = (weight.data_ptr(), version_counter(weight), weight.dtype, tuple(weight.shape))
    reorder = torch.ops.mkldnn._reorder_linear_weight
    return kept_copy(owner, "packed", weight, key, lambda: reorder(weight.detach(), BATCH_HINT))


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """(..., in) -> (..., out) with a packed weight; the rows are flattened first (oneDNN wants them 2-D)."""
    rows = x.numel() // x.shape[-1]
    bias = None if bias is None else bias.to(x.dtype)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out_features)


def packed_count(owner: object) -> int:
    """How many packed weight copies are kept for `owner` (each the size of its weight)."""
    return len(kept_copies(owner, "packed"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, owner: object = None):
    """`F.linear(x, weight, bias)`, (..., in) -> (..., out), through a packed copy of `weight` kept for `owner` where
    that is faster (CPU, no gradient, float32 beyond `FEW_ROWS_FLOAT32` rows or bf16); else
    `few_rows.linear_few_rows`."""
    rows = x.numel() // max(x.shape[-1], 1)
    if owner is None or not _packable(x, weight) or (x.dtype == torch.float32 and rows <= FEW_ROWS_FLOAT32):
        return linear_few_rows(x, weight, bias)
    return _product(x, packed_weight(owner, weight), bias, weight.shape[0])


class PackedLinear(nn.Linear):
    """An `nn.Linear` that computes through oneDNN's packed copy of its weight while no gradient is needed (see the
    module docstring); `pack_linears` turns a model's linears into these in place (parameters, hooks stay)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _packable(x, self.weight):
            return super().forward(x)
        return _product(x, packed_weight(self, self.weight), self.bias, self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Make the model's plain `nn.Linear`s with more than one output `PackedLinear`s (others, and linears with a
    quantized or subclass weight, an accelerate hook or a replaced forward, are left alone). Idempotent; returns how
    many are `PackedLinear`s."""
    count = 0
    for module in model.modules():
        if (
            type(module) is nn.Linear
            and module.out_features > 1
            and computes_with_weight(module)  # no quantized or subclass weight, no accelerate hook (weights.py)
            and "forward" not in vars(module)
        ):
            module.__class__ = PackedLinear
        count += isinstance(module, PackedLinear)
    return count


__all__ = ["PackedLinear", "bf16_native", "inference_dtype", "linear", "pack_linears", "packed_count", "packed_weight"]
