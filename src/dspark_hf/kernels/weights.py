"""What the package may do with a module of the target: multiply its weight, or only call it.

A drafter borrows the target's embedding and LM head, and the verify kernels recompute the target's linears. That is
only sound for a plain dense weight. Targets people load quantized or offloaded hold something else:

  "dense"     a float `torch.Tensor` / `nn.Parameter` on a real device: multiply it, gather its rows, pack it.
  "subclass"  a tensor subclass weight (torchao's `Int8Tensor`, `IntxUnpackedToInt8Tensor`, `AffineQuantizedTensor`,
              ...): the module's forward works, but `weight @ x` and most other ops raise or mean something else.
  "quantized" a quantized module: PyTorch's dynamic int8 `Linear` (its `weight` is a method), bitsandbytes
              `Linear4bit` / `Linear8bitLt` (`Params4bit` / `Int8Params` weights), GPTQ/AWQ `QuantLinear`s
              (`qweight`, no `weight`), or any module whose weight is not a float tensor.
  "hooked"    a module with accelerate hooks or other forward hooks (offloaded weights live on the meta device
              until its hook moves them in): only its own call is correct.

`weight_kind(module)` decides, from public types and attributes only (no quantization package is imported).
Callers use `dense_weight(module)` where it is not None and call the module otherwise; `dequantized(module, owner)`
makes a float copy once, explicitly, logging its memory cost, for the one place that needs rows of a non-dense
weight (a drafter's draft vocabulary).

`per_token_activations(model)` scopes a verify pass in which the target's dynamically quantized linears (PyTorch's
dynamic int8: one activation scale per call) quantize each token on its own, as its one-token decoding steps do.
"""

import contextlib
import functools

import torch
from torch import nn
from transformers.utils import logging

from ..utils.devices import module_device
from .few_rows import kept_copy
from .options import OPTIONS


logger = logging.get_logger(__name__)

DENSE, SUBCLASS, QUANTIZED, HOOKED = "dense", "subclass", "quantized", "hooked"
# weight classes of bitsandbytes (parameter subclasses holding packed integers), by name: never imported here
_BNB_WEIGHTS = {"Params4bit", "Int8Params"}


def _raw_weight(module: nn.Module):
    """The module's `weight` attribute as stored (a tensor, a method, None), without triggering a property twice."""
    return getattr(module, "weight", None)


def unpacked_weight(module: nn.Module):
    """The module's weight as a tensor where it keeps one packed (PyTorch's dynamic int8 `Linear`: `weight()` unpacks
    a quantized tensor, a copy each call); otherwise `weight` as stored (a tensor, None, or something else)."""
    weight = _raw_weight(module)
    if callable(weight) and not isinstance(weight, torch.Tensor):
        weight = weight()
    return weight


def weight_kind(module: nn.Module) -> str:
    """ "dense", "subclass", "quantized" or "hooked" (see the module docstring); hooks are checked first, since a
    hooked module's weight may not even be where it computes."""
    if hasattr(module, "_hf_hook") or module._forward_hooks or module._forward_pre_hooks:
        return HOOKED
    weight = _raw_weight(module)
    if not isinstance(weight, torch.Tensor):  # dynamic int8's weight(), GPTQ/AWQ's qweight, no weight at all
        return QUANTIZED
    if weight.device.type == "meta":  # offloaded without a hook we can see: its values are elsewhere
        return HOOKED
    if type(weight).__name__ in _BNB_WEIGHTS or weight.is_quantized or not weight.dtype.is_floating_point:
        return QUANTIZED
    if type(weight) not in (torch.Tensor, nn.Parameter):
        return SUBCLASS
    return DENSE


def is_dense(module: nn.Module) -> bool:
    """Whether the module's weight may be used directly (multiplied, sliced, packed, cast)."""
    return weight_kind(module) == DENSE


def computes_with_weight(module: nn.Module) -> bool:
    """Whether the module's own forward may be replaced by a product with its weight while the module is still
    called (its forward hooks run as before): a plain float weight and no accelerate hook, which would move the
    weight in or out around the call (the verify kernels' and packed linears' class swaps)."""
    weight = _raw_weight(module)
    return isinstance(weight, torch.Tensor) and plain_tensor(weight) and not hasattr(module, "_hf_hook")


def dense_weight(module: nn.Module) -> torch.Tensor | None:
    """The module's dense weight tensor, or None when the module must be called instead (see `weight_kind`)."""
    return _raw_weight(module) if is_dense(module) else None


def plain_tensor(tensor: torch.Tensor) -> bool:
    """A float tensor of torch's own class on a real device (no subclass, no quantized or meta tensor)."""
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.dtype.is_floating_point
        and tensor.device.type != "meta"
    )


def out_features(module: nn.Module) -> int:
    """The number of outputs (an LM head's vocabulary) of a linear-like module of any kind."""
    for name in ("out_features", "num_embeddings", "outfeatures"):  # nn.Linear and most quantized linears; GPTQ
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    weight = _raw_weight(module)
    if isinstance(weight, torch.Tensor):
        return weight.shape[0]
    raise ValueError(f"Cannot tell the output size of {type(module).__name__}; give it an `out_features` attribute.")


def in_features(module: nn.Module) -> int:
    for name in ("in_features", "embedding_dim", "infeatures"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            return value
    weight = _raw_weight(module)
    if isinstance(weight, torch.Tensor):
        return weight.shape[-1]
    raise ValueError(f"Cannot tell the input size of {type(module).__name__}; give it an `in_features` attribute.")


def bias_of(module: nn.Module) -> torch.Tensor | None:
    """The module's bias as a tensor (PyTorch's quantized linears keep it behind a `bias()` method), or None."""
    bias = getattr(module, "bias", None)
    if callable(bias) and not isinstance(bias, torch.Tensor):
        bias = bias()
    return bias if isinstance(bias, torch.Tensor) else None


def input_dtype(module: nn.Module) -> torch.dtype:
    """The float dtype to give a module of any kind: its weight's (a float or float-presenting subclass weight), a
    quantized module's `compute_dtype` (bitsandbytes) or float bias, else float32 on the CPU and float16 elsewhere."""
    weight = _raw_weight(module)
    if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point and weight_kind(module) != QUANTIZED:
        return weight.dtype
    for value in (getattr(module, "compute_dtype", None), getattr(getattr(module, "bias", None), "dtype", None)):
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return value
    return torch.float32 if module_device(module).type == "cpu" else torch.float16


def _dequantize(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A float (out, in) copy of a linear-like module's weight: the weight's own `dequantize()` where it has one
    (torchao subclasses, PyTorch's quantized tensors), else the module applied to the identity, which is exact for
    weight-only quantized linears (the bias, if any, is taken off again)."""
    weight = unpacked_weight(module)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        own = getattr(type(weight), "dequantize", torch.Tensor.dequantize) is not torch.Tensor.dequantize
        if weight.is_quantized or own:  # PyTorch's quantized tensors, torchao's subclasses (not bitsandbytes')
            try:
                return weight.dequantize().to(dtype)
            except (NotImplementedError, RuntimeError, TypeError):
                pass
        elif type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype.is_floating_point:
            return weight.detach().to(dtype)
    if isinstance(module, nn.Embedding):
        ids = torch.arange(module.num_embeddings, device=module_device(module))
        return module(ids).to(dtype)
    device, width = module_device(module), in_features(module)
    probe_dtype = getattr(module, "compute_dtype", None) or (torch.float16 if device.type == "cuda" else dtype)
    eye = torch.eye(width, device=device, dtype=probe_dtype)
    product = module(eye).to(dtype)  # (in, out) = eye @ Wᵀ + b
    bias = bias_of(module)
    if bias is not None:
        product = product - bias.to(product)
    return product.T.contiguous()


def dequantized(module: nn.Module, owner: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float copy (out, in) of a non-dense module's weight in `dtype`, made once per (owner, module, dtype) and kept
    beside `owner` while both live; the dense weight itself for a dense module. Logs the memory it costs."""
    if is_dense(module):
        return module.weight
    key = (id(module), dtype)

    def make() -> torch.Tensor:
        with torch.no_grad():
            copy = _dequantize(module, dtype)
        logger.warning_once(
            f"Dequantized the target's {type(module).__name__} ({weight_kind(module)} weight, {tuple(copy.shape)}) "
            f"once to {str(dtype).removeprefix('torch.')}: {copy.numel() * copy.element_size() / 2**20:.1f} MiB kept "
            "beside the drafter while it lives."
        )
        return copy

    return kept_copy(owner, "dequantized", module, key, make)


def quantization(model: nn.Module) -> str | None:
    """A short name of how the model's linears are stored, when any is not dense: e.g. "Int8Tensor",
    "torch.ao dynamic Linear", "Linear4bit", or several joined by "+"; None for a dense (or only hooked) model.
    Profiles and calibrations key on it, so a quantized target never reuses a full-precision one's."""
    names = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) or not (hasattr(module, "weight") or hasattr(module, "qweight")):
            continue
        kind = weight_kind(module)
        if kind == SUBCLASS:
            names.add(type(module.weight).__name__)
        elif kind == QUANTIZED:
            names.add(f"{type(module).__module__.split('.')[0]}.{type(module).__name__}")
    return "+".join(sorted(names)) or None


# -- verify passes with one activation scale per token ------------------------------------------------------------


def rounds_by_call(module: nn.Module) -> bool:
    """Whether the module quantizes its input with one scale per call (PyTorch's dynamic int8 linears), so that its
    output for a token depends on the other tokens of the call."""
    cls = type(module)
    return cls.__module__.startswith("torch.ao.nn.quantized.dynamic") and cls.__name__ == "Linear"


@functools.cache
def _per_token_class(cls: type) -> type:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.numel() // x.shape[-1] <= 1:
            return cls.forward(self, x)
        rows = x.reshape(-1, 1, x.shape[-1])  # (N, 1, d): each token alone, as a one-token decoding step sends it
        return torch.cat([cls.forward(self, row) for row in rows]).reshape(*x.shape[:-1], -1)

    return type(f"PerToken{cls.__name__}", (cls,), {"forward": forward, "__module__": cls.__module__})


def per_token_linears(model: nn.Module) -> list[nn.Module]:
    """The model's modules that `per_token_activations` computes token by token (none with `OPTIONS.per_token_verify`
    off)."""
    if not OPTIONS.per_token_verify:
        return []
    return [m for m in model.modules() if rounds_by_call(m) and "forward" not in vars(m)]


@contextlib.contextmanager
def per_token_activations(model: nn.Module, modules: list[nn.Module] | None = None):
    """Within the block, the model's dynamically quantized linears (`per_token_linears`, or `modules`) compute each
    token with its own activation scale, exactly as a one-token decoding step does: a verify of k tokens then gives
    every token the logits plain decoding gives it (one call per token: the verify costs k calls per linear).
    Classes are restored on exit, also after an exception."""
    swapped = per_token_linears(model) if modules is None else modules
    originals = [type(m) for m in swapped]
    for module, cls in zip(swapped, originals):
        object.__setattr__(module, "__class__", _per_token_class(cls))
    try:
        yield
    finally:
        for module, cls in zip(swapped, originals):
            object.__setattr__(module, "__class__", cls)


__all__ = [
    "DENSE",
    "HOOKED",
    "QUANTIZED",
    "SUBCLASS",
    "bias_of",
    "computes_with_weight",
    "dense_weight",
    "dequantized",
    "in_features",
    "input_dtype",
    "is_dense",
    "out_features",
    "per_token_activations",
    "per_token_linears",
    "plain_tensor",
    "quantization",
    "unpacked_weight",
    "weight_kind",
]
