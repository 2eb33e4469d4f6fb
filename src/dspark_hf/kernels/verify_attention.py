"""The target's attention in verify passes: grouped-query attention without copying the cache, on the CPU.

A verify pass runs the target on k + 1 >= 2 query positions over its cache. For grouped-query models (fewer
key/value heads than query heads: Llama 3, Qwen3, Mistral, Gemma, SmolLM2), transformers' "sdpa" attention avoids
repeating the keys and values in two cases only: SDPA's own GQA where the backend takes it without a mask, and a
packing of the heads for a single query position (plain decoding). A verify pass is neither, so every layer copies
its whole key and value cache `num_key_value_groups` times (`repeat_kv`) before the product. On the CPU,
`scaled_dot_product_attention(..., enable_gqa=True)` takes the mask and the unrepeated cache, and gives the same
values (bit-identical logits on SmolLM2-135M, 9 query heads and 3 key/value heads, at 2–8 rows) without the copies
(a verify forward 7–11 % cheaper there; docs/history.md, "Attention without repeated keys"). SDPA's GQA still reads
each key/value head once per query head, which over a long cache is most of a verify's attention; for a few queries
the query heads of each key/value head are packed into the rows of one product instead (`PACKED_ROWS`), as
transformers does for a single query.

`ATTN_IMPLEMENTATION` is registered with transformers' `AttentionInterface` (the function below) and
`AttentionMaskInterface` (sdpa's mask). `with routed(model):` points a target whose `config._attn_implementation`
is "sdpa" at it for one verify pass and restores "sdpa" on exit (`verify_head.verify_kernels` does this). Outside a
verify pass the model is untouched; within one, everything but GQA on the CPU with a mask or a single query still
goes to transformers' own `sdpa_attention_forward`. Set `OPTIONS.verify_attention = False` to turn it off.
"""

import contextlib
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .few_rows import version_counter
from .options import OPTIONS


ATTN_IMPLEMENTATION = "dspark_verify_sdpa"
# a round's query heads are packed per key/value head up to this many rows of one product (queries x heads per key/
# value head), SDPA's GQA beyond: on 2 threads of an AMD EPYC, packing made the attention of 2-4 queries over an 8k
# cache 1.1-1.5x faster, and 5-8 queries 0.9-1.0x (docs/history.md, "Packed query heads"). Where fewer products
# (sequences x key/value heads) than threads would run, it is not packed.
PACKED_ROWS = 12
# 2 or more queries over a masked cache, up to this many packed rows, take two matrix products per key/value head
# instead (`_matmul_attention`; 0 turns it off), where the scores fit in MATMUL_SCORES_BYTES
MATMUL_ROWS = 24
MATMUL_SCORES_BYTES = 8 << 20


def verify_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`sdpa_attention_forward` without repeating the CPU cache: the query heads packed per key/value head (up to
    `PACKED_ROWS` rows of one product), or, for more queries over a masked cache, SDPA's grouped-query attention.

    query (B, H, q, d), key and value (B, H_kv, L, d), attention_mask (B or 1, 1, q, L) or None (a single query over
    a cache without holes) -> ((B, q, H, d), None).
    """
    n_rep = getattr(module, "num_key_value_groups", 1)
    batch, heads, q, dim = query.shape
    masked = isinstance(attention_mask, torch.Tensor)
    if (
        n_rep == 1
        or query.device.type != "cpu"
        or not (masked or (attention_mask is None and q == 1))  # no mask for several queries: a causal prefill
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions")
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # Deviations from sdpa_attention_forward: no repeat_kv (with a mask, is_causal is False there too), and ...
    packed_products = batch * key.shape[1]  # SDPA runs one product per sequence and head, each on one thread
    if masked and q > 1 and _by_matmul(query, key, attention_mask, n_rep):
        # ... a few queries over a masked cache: the packed rows' scores as one matrix product per key/value head
        output = _matmul_attention(query, key, value, attention_mask, n_rep, scaling)
    elif (
        q * n_rep <= PACKED_ROWS
        and (not masked or attention_mask.shape[1] == 1)
        and packed_products >= torch.get_num_threads()
    ):
        # ... a few queries: each key/value head's query heads as the rows of one product (pack_gqa's packing of a
        # single query, for q of them), so that every key and value is read once: rows r * q + i see mask row i.
        # transformers packs a single query only under a mask: without one it takes SDPA's GQA, which reads each
        # key/value head once per query head (2.3x the time over an 8k cache). Only where the packed products keep
        # every thread busy (measured with 3 products on 2 threads)
        packed = query.reshape(batch, heads // n_rep, n_rep * q, dim)
        mask = _repeated(attention_mask, n_rep) if masked and q > 1 else attention_mask  # (B or 1, 1, n_rep q, L)
        output = sdpa(packed, key, value, attn_mask=mask, scale=scaling).reshape(batch, heads, q, dim)
    else:
        # ... more: SDPA's grouped-query attention
        output = sdpa(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _by_matmul(query, key, mask, n_rep: int) -> bool:
    """Whether `_matmul_attention` takes this product: float32, at most `MATMUL_ROWS` packed rows, scores within
    `MATMUL_SCORES_BYTES`, a mask broadcast over the heads (one row per query) in which every query sees a key."""
    batch, heads, q, _ = query.shape
    rows, length = n_rep * q, key.shape[2]
    return (
        MATMUL_ROWS > 0
        and rows <= MATMUL_ROWS
        and mask.shape[1] == 1
        and batch * (heads // n_rep) * rows * length * query.element_size() <= MATMUL_SCORES_BYTES
        and query.dtype == key.dtype == torch.float32  # half precision keeps SDPA's float32 accumulation
        and _bias(mask, n_rep, query.dtype) is not None
    )


def _matmul_attention(query, key, value, mask, n_rep: int, scaling: float | None) -> torch.Tensor:
    """Attention of a few queries as two matrix products per key/value head, its query heads packed into the rows:
    scores (B, H_kv, n_rep q, L) = Q K^T, the mask added, softmax, times V -> (B, H, q, d).

    SDPA's fused CPU kernel walks the cache in blocks per query head (or per packed product), which for 2-8 queries
    over a few thousand keys runs well below the memory bandwidth; BLAS streams each key and value once per key/value
    head (docs/long_context.md, "Attention as two products")."""
    batch, heads, q, dim = query.shape
    packed = query.reshape(batch, heads // n_rep, n_rep * q, dim)
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(packed, key.transpose(-1, -2))  # (B, H_kv, n_rep q, L)
    scores.mul_(scale).add_(_bias(mask, n_rep, query.dtype))
    probabilities = torch.softmax(scores, dim=-1)
    return torch.matmul(probabilities, value).reshape(batch, heads, q, dim)


# kind -> (weak reference to a mask, its version counter, what was made of it), for the verify pass under way only:
# `routed` empties it when a pass begins and ends
_last: dict[tuple, tuple] = {}


def _once_per_mask(mask: torch.Tensor, kind: tuple, make):
    """`make(mask)`, made once per forward: every layer of a pass gets the same mask tensor, so the last result of
    each `kind` is kept (beside a weak reference to its source) until another mask comes.

    The same live tensor (a weak reference: a new mask at a freed one's address is never taken for it) with the same
    in-place version counter is the same mask. A tensor made under `torch.inference_mode()` has no version counter
    (`version_counter` reads 0): within a pass its mask is not edited between layers, and `routed` forgets every
    kept result between passes, so a mask edited in place inside inference mode is not mistaken for its old self."""
    last = _last.get(kind)
    version = version_counter(mask)
    if last is not None and last[0]() is mask and last[1] == version:
        return last[2]
    made = make(mask)
    _last[kind] = (weakref.ref(mask), version, made)
    return made


def _bias(mask: torch.Tensor, n_rep: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask (B or 1, 1, q, L), bool or additive, as an additive bias of `dtype` with rows repeated for the packed
    heads, (B or 1, 1, n_rep q, L); None where a query sees no key (softmax would give NaN, SDPA decides those)."""

    def make(mask):
        if mask.dtype == torch.bool:
            sees = mask.any(dim=-1).all()
            bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        else:
            bias = mask.to(dtype)
            sees = (bias > torch.finfo(dtype).min).any(dim=-1).all()
        return bias.repeat(1, 1, n_rep, 1) if bool(sees) else None

    return _once_per_mask(mask, ("bias", n_rep, dtype), make)


def _repeated(mask: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`mask.repeat(1, 1, n_rep, 1)`, once per forward."""
    return _once_per_mask(mask, ("repeat", n_rep), lambda mask: mask.repeat(1, 1, n_rep, 1))


# The installed package's functions always; a flat copy of this file (a `trust_remote_code` or `custom_generate`
# folder, possibly of an older version) only where nothing is registered yet, so loading a Hub folder in a process
# that imported the package never replaces its kernel with the folder's.
if __name__.startswith("dspark_hf.") or ATTN_IMPLEMENTATION not in AttentionInterface():
    AttentionInterface.register(ATTN_IMPLEMENTATION, verify_sdpa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def routable(model) -> bool:
    """Whether `route` would switch this model's attention: "sdpa", one config (no sub-configs), CPU parameters."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "sub_configs", None):
        return False  # a composite model's sub-configs may differ; leave them alone
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ATTN_IMPLEMENTATION):
        return False
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu"


@contextlib.contextmanager
def routed(model):
    """Within the block, an "sdpa" model that `routable` accepts attends through `ATTN_IMPLEMENTATION`; its config
    is restored on exit (also after an exception). Any other model, or `OPTIONS.verify_attention` off, is left
    alone."""
    if not (OPTIONS.verify_attention and routable(model)) or model.config._attn_implementation == ATTN_IMPLEMENTATION:
        yield
        return
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    _last.clear()  # a pass's masks are its own (and the last pass's results are not kept alive past it)
    try:
        yield
    finally:
        model.config._attn_implementation = "sdpa"
        _last.clear()


__all__ = ["ATTN_IMPLEMENTATION", "routable", "routed", "verify_sdpa_attention_forward"]
