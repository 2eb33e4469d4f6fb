"""Content fingerprints of weights: how a kept copy (packed, gathered, cast, dequantized) learns that the weights it
was made from changed, whatever way they changed.

A tensor's identity, `data_ptr` and in-place version counter catch most changes (a new tensor, a dtype or device
move, `load_state_dict`, an optimizer step), and `few_rows.kept_copy` and `verify_linears.TargetPacks` check those
before every use. An edit through `weight.data` (`.data.mul_`, peft's `merge_and_unload`, a slice of `.data`) and an
edit of an inference tensor change none of them. A fingerprint reads the bits: each weight viewed as 64-bit
integers, summed along its rows and along its columns with wrap-around arithmetic. Integer sums are exact and do not
depend on the order of the additions (no thread-count or BLAS noise), so any change to one element, or to any set of
elements that is not a permutation keeping every row's and column's sum, changes the fingerprint.

Cost: one read of the weights, twice (rows, then columns): 46 ms for SmolLM2-135M's 513 MiB on a 2-core Intel Xeon
(Sapphire Rapids) VM, done once per `generate()` call (and when an `Engine` starts work after being idle) for
the weights that have copies (`freshness.drop_stale`), and once when a copy is made.
"""

import torch
from torch import nn

from ..utils.compat import dynamic_packed_params


Fingerprint = tuple  # of int64 tensors and plain values; compared with `same`


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 2-D integer tensor (rows of its first dimension), int64 where the row's bytes allow,
    else the widest integer type that divides them."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    rows = t.shape[0] if t.dim() >= 2 else 1
    row_bytes = t.numel() * t.element_size() // max(rows, 1)
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = torch.empty((), dtype=dtype).element_size()
        if row_bytes % size == 0:
            break
    try:
        flat = t.reshape(-1).view(torch.uint8) if t.element_size() != size or t.dim() == 0 else t.reshape(-1)
        return flat.view(dtype).reshape(rows, -1)
    except RuntimeError:  # a view whose storage offset is not aligned to `dtype`: a copy is
        return t.clone().reshape(-1).view(torch.uint8).view(dtype).reshape(rows, -1)


def _dense(tensor: torch.Tensor) -> Fingerprint:
    if tensor.numel() == 0:
        return (tuple(tensor.shape), str(tensor.dtype))
    bits = _bits(tensor)
    return (tuple(tensor.shape), str(tensor.dtype), bits.sum(1, dtype=torch.int64), bits.sum(0, dtype=torch.int64))


class Unreadable:
    """The fingerprint of values that cannot be read (a tensor subclass that refuses the operations): equal to no
    other, so a copy made from them is dropped at every check and made again, never trusted."""

    def __eq__(self, other):
        return False

    __hash__ = object.__hash__


def fingerprint(source) -> Fingerprint:
    """A fingerprint of a tensor's values (a plain, quantized or subclass tensor, such as torchao's) or of every
    tensor a module holds (its parameters and buffers, and a quantized module's packed weights). Values it cannot
    read give `Unreadable()`."""
    try:
        return _fingerprint(source)
    except (NotImplementedError, RuntimeError, TypeError, AttributeError):
        return (Unreadable(),)


def _fingerprint(source) -> Fingerprint:
    if isinstance(source, nn.Module):
        return tuple(_fingerprint(v) for v in _module_tensors(source))
    if isinstance(source, (tuple, list)):
        return tuple(_fingerprint(v) for v in source)
    if isinstance(source, Packed):
        return (source,)
    if not isinstance(source, torch.Tensor):
        return (repr(source),)
    if source.is_quantized:
        scales = (source.q_scale(), source.q_zero_point()) if source.qscheme() in _PER_TENSOR else ()
        if not scales:
            scales = (_dense(source.q_per_channel_scales()), _dense(source.q_per_channel_zero_points()))
        return (_dense(source.int_repr()), *scales)
    if type(source) not in (torch.Tensor, nn.Parameter) and hasattr(source, "__tensor_flatten__"):
        names, context = source.__tensor_flatten__()  # a tensor subclass: its inner tensors hold the values
        return (type(source).__name__, repr(context), *(_fingerprint(getattr(source, n)) for n in names))
    if type(source) not in (torch.Tensor, nn.Parameter) and type(source).__torch_dispatch__ is not _PLAIN_DISPATCH:
        return (Unreadable(),)  # a subclass that keeps its values its own way
    if source.is_meta:
        return ("meta", tuple(source.shape))
    return _dense(source)


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)


class Packed:
    """The fingerprint of a quantized linear's packed weights (PyTorch's dynamic int8 `Linear`: one opaque object
    holding the weight and the bias). No Python code edits such an object in place: `set_weight_bias` and
    `load_state_dict` put a new one in its place. So the object itself is the fingerprint, equal only to a fingerprint
    of the same object, and nothing is unpacked: unpacking SmolLM2's int8 LM head and reading it took ~0.4 s a
    `generate()` call (docs/results.md, 2026-12-07). It holds the object, so that its id is not reused while a copy
    made from it is kept."""

    def __init__(self, packed: object, dtype: object):
        self.packed, self.dtype = packed, dtype

    def __eq__(self, other):
        return isinstance(other, Packed) and other.packed is self.packed and other.dtype == self.dtype

    __hash__ = object.__hash__


def _module_tensors(module: nn.Module) -> list:
    """The tensors a module's output depends on: its state dict's values; for a dynamically quantized linear, whose
    weight and bias are packed into one object (its state dict and `weight()` unpack it), that object (`Packed`)."""
    packed = dynamic_packed_params(module)
    if packed is not None:
        return [Packed(*packed)]
    values = list(module.state_dict(keep_vars=True).values())
    weight = getattr(module, "weight", None)
    if callable(weight) and not isinstance(weight, torch.Tensor):
        values.append(weight())
    return values


def read_once(source, fingerprints: dict) -> Fingerprint:
    """`fingerprint(source)`, read once per check: `fingerprints` maps the id of each source read so far to (the
    source, its fingerprint); a check passes one dict to every caller so that shared weights (a tied LM head, the
    target's head that the drafter uses) are read once."""
    hit = fingerprints.get(id(source))
    if hit is None or hit[0] is not source:
        hit = fingerprints[id(source)] = (source, fingerprint(source))
    return hit[1]


def same(a: Fingerprint, b: Fingerprint) -> bool:
    """Whether two fingerprints are equal (tensors compared exactly)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


__all__ = ["Fingerprint", "Packed", "fingerprint", "read_once", "same"]
