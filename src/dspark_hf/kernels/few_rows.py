"""Products and kept copies for few rows on the CPU: the building blocks of the drafting and verify kernels.

`linear_few_rows` puts the weight on the left of a product with <= 16 rows, where CPU GEMM is slow; `gathered_rows`
and `kept_copy` keep gathered or cast weight copies between calls, so a draft does not copy an LM head per round.
"""

import weakref
from collections.abc import Callable

import torch

from .fingerprint import fingerprint, read_once, same


FEW_ROWS = 16


def linear_few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, (..., d) -> (..., n), computed on CPU as `(weight @ x.T).T` for <= 16 rows.

    CPU GEMM (MKL) can be slow with few rows on the left, for a wide LM head most of all; the weight on the left
    avoids that. The values agree up to float rounding; more rows and other devices take `F.linear`. Other dtypes
    take `F.linear` too (bf16 goes through oneDNN, which is fast), on 2-D rows: a sliced 3-D bf16 input, `h[:, :2]`,
    sends it to a batched product that copies the whole weight.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if x.device.type != "cpu" or not 0 < rows <= FEW_ROWS:
        return torch.nn.functional.linear(x, weight, bias)
    if x.dtype != torch.float32:
        return torch.nn.functional.linear(x.reshape(rows, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], -1)
    out = (weight @ x.reshape(rows, x.shape[-1]).T).T
    if bias is not None:
        out = out + bias
    return out.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def gathered_rows(
    owner: object, weight: torch.Tensor, ids: torch.LongTensor | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`weight[ids]` (all of `weight` with `ids` None) in `dtype` (default: its own), kept for `owner` between calls
    while no gradient is needed (inference with a draft vocabulary, or a drafter computing in another dtype).

    Gathering the rows of a (V, d) LM head, or casting it, on every draft would copy tens of MB per round; the kept
    copy is used as long as neither tensor changed (same storage, same in-place version counter), and rebuilt
    otherwise. Without `ids` and `dtype` this is `weight` itself.
    """
    dtype = dtype or weight.dtype
    if ids is None and dtype == weight.dtype:
        return weight

    def make() -> torch.Tensor:
        return (weight if ids is None else weight[ids]).to(dtype)

    if torch.is_grad_enabled():
        return make()
    key = (weight.data_ptr(), version_counter(weight), dtype)
    if ids is not None:
        key += (ids.data_ptr(), version_counter(ids), len(ids))
    return kept_copy(owner, "rows", weight, key, make, sources=() if ids is None else (ids,))


# owner -> {kind: {id(weight): (weak reference to weight, key, copy, fingerprint of weight)}}. Beside the owners
# rather than in them: a model must stay deep-copyable and picklable (a packed copy has no storage, a weak reference
# does not pickle).
_KEPT: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def kept_copy(owner: object, kind: str, weight, key: tuple, make: Callable[[], torch.Tensor], sources: tuple = ()):
    """The `kind` copy of `weight` (a tensor, or a module for a copy of its weights) kept for `owner`: `make()` when
    there is none yet or it is stale. `sources`: other tensors the copy is made from (e.g. the row ids gathered).

    A copy is reused only for the same live object (held by a weak reference, so a new tensor that the allocator
    puts at a freed one's id and address is never mistaken for it) with the same `key` (e.g. its storage and
    in-place version counter), checked at every use. Edits the key cannot see (through `weight.data`, of an
    inference tensor) are caught by the content fingerprint kept beside the copy, which `drop_stale_kept` checks once
    per `generate()` call (`freshness.py`). A stale copy is dropped before the new one is made. The copies go when
    the owner does.
    """
    cache = _KEPT.setdefault(owner, {}).setdefault(kind, {})
    hit = cache.get(id(weight))
    if hit is None or hit[0]() is not weight or hit[1] != key:
        cache.pop(id(weight), None)
        copy = make()
        hit = cache[id(weight)] = (weakref.ref(weight), key, copy, fingerprint((weight, *sources)), sources)
    return hit[2]


def drop_stale_kept(owner: object, fingerprints: dict | None = None) -> int:
    """Drop the copies kept for `owner` whose source is gone or whose values changed since the copy was made (its
    fingerprint differs); returns how many were dropped. `fingerprints` (id -> fingerprint) shares the reading of a
    source between callers within one check."""
    fingerprints = {} if fingerprints is None else fingerprints
    dropped = 0
    for cache in _KEPT.get(owner, {}).values():
        for ident, (ref, _, _, made, sources) in list(cache.items()):
            source = ref()
            now = None if source is None else (read_once(source, fingerprints), *map(fingerprint, sources))
            if now is None or not same(made, now):
                del cache[ident]
                dropped += 1
    return dropped


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; 0 for an inference tensor (made under `torch.inference_mode`, as in
    pipelines), which has none."""
    return 0 if tensor.is_inference() else tensor._version


def kept_copies(owner: object, kind: str) -> list[torch.Tensor]:
    """The `kind` copies kept for `owner` (for tests and memory accounting)."""
    return [entry[2] for entry in _KEPT.get(owner, {}).get(kind, {}).values()]
