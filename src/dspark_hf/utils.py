"""Small shared helpers: atomic file writes (nothing a user saved is ever half-written), JSONL reading (plain or
gzipped), a linear map for few rows."""

import gzip
import json
import os
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import torch


def atomic_write_json(obj, path: str | os.PathLike) -> None:
    """Write JSON to `path` via a temporary file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_jsonl(path: str | os.PathLike):
    """Yield `(line number, record)` for every non-blank line (gzipped when the name ends in .gz); ValueError names a
    line that is not JSON."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({err}).") from err


FEW_ROWS = 16


def linear_few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, (..., d) -> (..., n), computed on CPU as `(weight @ x.T).T` for <= 16 rows.

    CPU GEMM is slow with few rows on the left: the (7, 576) x (576, 49152) LM-head product of one draft block
    took 35 ms as `F.linear` and 14 ms with the weight on the left on a 2-core x86 CPU (torch 2.13; 2 rows: 24
    against 5 ms). The values agree up to float rounding; more rows and other devices take `F.linear`. Other
    dtypes take `F.linear` too (bf16 goes through oneDNN and is fast: 0.6 against 1.0 ms for 2 rows of a 16k-row
    head), on 2-D rows: a sliced 3-D bf16 input, `h[:, :2]`, sends it to a batched product that copies the whole
    weight (10 ms).
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
    return kept_copy(owner, "rows", weight, key, make)


# owner -> {kind: {id(weight): (weak reference to weight, key, copy)}}. Beside the owners rather than in them: a
# model must stay deep-copyable and picklable (a packed copy has no storage, a weak reference does not pickle).
_KEPT: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def kept_copy(owner: object, kind: str, weight: torch.Tensor, key: tuple, make: Callable[[], torch.Tensor]):
    """The `kind` copy of `weight` kept for `owner`: `make()` when there is none yet or it is stale.

    A copy is reused only for the same live tensor (held by a weak reference, so a new tensor that the allocator
    puts at a freed one's id and address is never mistaken for it) with the same `key` (e.g. its storage and
    in-place version counter). A stale copy is dropped before the new one is made. The copies go when the owner does.
    """
    cache = _KEPT.setdefault(owner, {}).setdefault(kind, {})
    hit = cache.get(id(weight))
    if hit is None or hit[0]() is not weight or hit[1] != key:
        cache.pop(id(weight), None)
        hit = cache[id(weight)] = (weakref.ref(weight), key, make())
    return hit[2]


def version_counter(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; 0 for an inference tensor (made under `torch.inference_mode`, as in
    pipelines), which has none."""
    return 0 if tensor.is_inference() else tensor._version


def kept_copies(owner: object, kind: str) -> list[torch.Tensor]:
    """The `kind` copies kept for `owner` (for tests and memory accounting)."""
    return [copy for _, _, copy in _KEPT.get(owner, {}).get(kind, {}).values()]
