"""Attention in verify passes (`verify_attention`): SDPA's GQA on the unrepeated cache, same values, only while
verifying, and lossless end to end."""

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import DynamicCache
from transformers.integrations import sdpa_attention

from conftest import make_drafter, make_target
from dspark_hf.kernels import verify_attention, verify_head
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.verify_attention import ATTN_IMPLEMENTATION, routable, verify_sdpa_attention_forward
from dspark_hf.kernels.verify_head import padded_steps, verify_kernels
from dspark_hf.kernels.verify_linears import KernelTable, VerifyKernels
from dspark_hf.serving.engine import Engine


pytestmark = pytest.mark.usefixtures("two_threads")  # the attention packs its query heads by thread count


class Attention(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def qkv(batch=2, heads=6, kv_heads=2, q=3, length=11, dim=8):
    """query (batch, heads, q, dim), key and value (batch, kv_heads, length, dim)."""
    return torch.randn(batch, heads, q, dim), *torch.randn(2, batch, kv_heads, length, dim)


def causal_mask(batch, q, length, dtype=torch.bool):
    """(batch, 1, q, length): query i sees the cache and itself (cache of length - q), one left-padded position."""
    mask = torch.arange(length)[None, :] <= torch.arange(length - q, length)[:, None]
    mask = mask[None, None].repeat(batch, 1, 1, 1)
    mask[0, ..., 0] = False  # the first sequence is left-padded by one
    if dtype == torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


FAMILIES = {  # (config class, model class, overrides): sliding windows give Mistral and Gemma 3 their own masks
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 6}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"sliding_window": 6}),
}


def sdpa_target(family="llama", **overrides):
    config_cls, model_cls, fields = FAMILIES[family]
    return make_target(
        config_cls=config_cls, model_cls=model_cls, attn_implementation="sdpa", **{**fields, **overrides}
    )


KV_HEADS = 2  # `qkv`'s default and `make_target`'s key/value heads


def record_sdpa(monkeypatch, ways=None) -> list[bool]:
    """Record, for each SDPA product, whether it ran with a mask on the unrepeated cache of `KV_HEADS` key/value
    heads (transformers' sdpa repeats it on the CPU whenever there is a mask and more than one query); `ways` gets
    "packed" or "gqa" for each such product."""
    calls, original = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(query, key, value, *args, **kwargs):
        gqa, packed = bool(kwargs.get("enable_gqa")), query.shape[1] == key.shape[1] == KV_HEADS
        unrepeated = kwargs.get("attn_mask") is not None and key.shape[1] == KV_HEADS and (gqa or packed)
        calls.append(unrepeated)
        if unrepeated and ways is not None:
            ways.append("gqa" if gqa else "packed")
        return original(query, key, value, *args, **kwargs)

    matmul_attention = verify_attention._matmul_attention

    def by_matmul(query, key, *args):  # two matrix products per key/value head, on the unrepeated cache
        calls.append(key.shape[1] == KV_HEADS)
        if ways is not None:
            ways.append("matmul")
        return matmul_attention(query, key, *args)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(verify_attention, "_matmul_attention", by_matmul)
    return calls


@pytest.mark.parametrize(  # 3 query heads per key/value head
    "q, matmul_rows, way",
    [(2, 0, "packed"), (4, 0, "packed"), (5, 0, "gqa"), (2, 24, "matmul"), (5, 24, "matmul"), (9, 24, "gqa")],
)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("mask_batch", [2, 1])  # a mask per sequence, or one broadcast over the batch
def test_same_values_as_sdpa_with_repeated_keys(monkeypatch, q, matmul_rows, way, mask_dtype, mask_batch):
    monkeypatch.setattr(verify_attention, "MATMUL_ROWS", matmul_rows)
    ways = []
    calls = record_sdpa(monkeypatch, ways=ways)
    module = Attention(groups=3)
    query, key, value = qkv(q=q)
    mask = causal_mask(2, q, 11, mask_dtype)[:mask_batch]
    ours, _ = verify_sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    reference, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert calls == [True, False] and ways == [way]  # ours on the unrepeated cache, transformers' through repeat_kv
    assert ours.shape == reference.shape == (2, q, 6, 8) and ours.is_contiguous()
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("masked", [False, True])
def test_one_query_is_packed_with_or_without_a_mask(monkeypatch, masked):
    """transformers packs a single query only under a mask; without one (a cache without holes) it takes SDPA's
    GQA, which reads each key/value head once per query head."""
    calls, original = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(query, key, value, *args, **kwargs):
        calls.append((query.shape[1], key.shape[1], bool(kwargs.get("enable_gqa"))))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    query, key, value = qkv(q=1)
    mask = causal_mask(2, 1, 11) if masked else None
    ours, _ = verify_sdpa_attention_forward(Attention(groups=3), query, key, value, mask, scaling=0.3)
    reference, _ = sdpa_attention.sdpa_attention_forward(Attention(groups=3), query, key, value, mask, scaling=0.3)
    assert calls[0] == (2, 2, False)  # ours: 2 key/value heads, 3 query heads packed into each
    assert calls[1] == ((2, 2, False) if masked else (6, 2, True))  # transformers' own
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["a query sees no key", "scores over budget", "bfloat16"])
def test_matrix_products_only_where_they_are_safe(monkeypatch, case):
    """A query that sees no key (softmax would give NaN), scores beyond `MATMUL_SCORES_BYTES` and half precision
    (no float32 accumulation in the products) go to SDPA as before."""
    ways = []
    record_sdpa(monkeypatch, ways=ways)
    query, key, value = qkv(q=3)
    mask = causal_mask(2, 3, 11)
    verify_sdpa_attention_forward(Attention(groups=3), query, key, value, mask, scaling=0.3)
    assert ways == ["matmul"]  # negative control: the same shapes in float32, every query seeing the cache
    ways.clear()
    if case == "a query sees no key":
        mask[1, 0, 1] = False
    if case == "scores over budget":
        monkeypatch.setattr(verify_attention, "MATMUL_SCORES_BYTES", 2 * 2 * 9 * 11 * 4 - 1)  # one byte short
    if case == "bfloat16":
        query, key, value = query.bfloat16(), key.bfloat16(), value.bfloat16()
    verify_sdpa_attention_forward(Attention(groups=3), query, key, value, mask, scaling=0.3)
    assert ways == ["packed"]


def test_not_packed_where_threads_would_idle(monkeypatch):
    monkeypatch.setattr(verify_attention, "MATMUL_ROWS", 0)
    ways = []
    record_sdpa(monkeypatch, ways=ways)
    query, key, value = qkv(batch=1, q=2)  # 2 key/value heads: 2 packed products
    mask = causal_mask(1, 2, 11)
    for threads in (2, 3):
        torch.set_num_threads(threads)
        ours, _ = verify_sdpa_attention_forward(Attention(groups=3), query, key, value, mask)
        torch.testing.assert_close(
            ours,
            sdpa_attention.sdpa_attention_forward(Attention(groups=3), query, key, value, mask)[0],
            rtol=0,
            atol=1e-6,
        )
    assert ways == ["packed", "gqa"]


def test_a_mask_per_head_is_not_packed(monkeypatch):
    ways = []
    record_sdpa(monkeypatch, ways=ways)
    query, key, value = qkv(q=2)
    mask = causal_mask(2, 2, 11).repeat(1, 6, 1, 1)  # (batch, heads, q, length): rows of a packing would not match
    mask[:, 1, :, 3] = False  # one head sees less
    ours, _ = verify_sdpa_attention_forward(Attention(groups=3), query, key, value, mask, scaling=0.3)
    reference, _ = sdpa_attention.sdpa_attention_forward(Attention(groups=3), query, key, value, mask, scaling=0.3)
    assert ways == ["gqa"]
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "case",
    ["no grouping", "no mask", "softcap", "dropout", "position bias"],
)
def test_every_other_case_goes_to_transformers(monkeypatch, case):
    delegated, original = [], sdpa_attention.sdpa_attention_forward

    def counted(*args, **kwargs):
        delegated.append(case)
        return original(*args, **kwargs)

    monkeypatch.setattr(verify_attention, "sdpa_attention_forward", counted)
    groups, q, kwargs = 3, 3, {}
    if case == "no grouping":
        groups = 1
    if case == "softcap":
        kwargs["softcap"] = 30.0
    if case == "dropout":
        kwargs["dropout"] = 0.1
    if case == "position bias":
        kwargs["position_bias"] = torch.zeros(1, 6, q, 11)
    query, key, value = qkv(q=q, kv_heads=6 // groups)
    mask = None if case == "no mask" else causal_mask(2, q, 11)
    try:
        verify_sdpa_attention_forward(Attention(groups), query, key, value, mask, **kwargs)
    except ValueError:
        assert case == "softcap"  # transformers' sdpa refuses a softcap itself, with its own message
    assert delegated == [case]


def test_routed_only_while_verifying():
    target = sdpa_target()
    assert routable(target)
    with verify_kernels(target):
        assert target.config._attn_implementation == ATTN_IMPLEMENTATION
        with verify_kernels(target):  # nested: still routed, and the outer pass stays routed after it
            pass
        assert target.config._attn_implementation == ATTN_IMPLEMENTATION
    assert target.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), verify_kernels(target):
        raise RuntimeError("a failed verify")
    assert target.config._attn_implementation == "sdpa"  # restored however the pass ends

    eager = make_target()  # eager (and flash, flex, ...) attention is never routed
    with verify_kernels(eager):
        assert eager.config._attn_implementation == "eager"
    assert not routable(sdpa_target().to("meta"))  # not on the CPU


def test_switch_off(monkeypatch):
    target = sdpa_target()
    assert verify_head.version(target) == verify_head.VERSION == 5
    monkeypatch.setattr(OPTIONS, "verify_attention", False)
    with verify_kernels(target):
        assert target.config._attn_implementation == "sdpa"
    assert verify_head.version(target) == 2  # profiles taken now record the kernels without the attention


def test_profiles_record_whether_the_attention_is_routed():
    assert verify_head.version(make_target()) == 2  # eager: few-rows products only
    assert verify_head.version(sdpa_target()) == verify_head.VERSION
    assert verify_head.version(sdpa_target().to(torch.bfloat16)) == 0  # no few-rows products at all


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_verify_logits_unchanged(monkeypatch, family):
    target = sdpa_target(family)
    ids = torch.randint(0, 99, (1, 9))
    with torch.no_grad():
        cache = DynamicCache(config=target.config)
        target(ids[:, :6], cache=cache, use_cache=True)
        with verify_kernels(target):
            routed = target(ids[:, 6:], cache=cache, use_cache=True).logits
        cache.crop(-3)
        monkeypatch.setattr(OPTIONS, "verify_attention", False)
        with verify_kernels(target):
            plain = target(ids[:, 6:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(routed, plain, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "family, dtype",
    [("llama", torch.float32), ("qwen3", torch.float32), ("mistral", torch.float32), ("gemma3", torch.bfloat16)],
)
@pytest.mark.parametrize("packed_rows, matmul_rows", [(12, 0), (0, 0), (12, 24)])  # 2 query heads per key/value head
def test_generate_identical_with_gqa_verifies(monkeypatch, family, dtype, packed_rows, matmul_rows):
    monkeypatch.setattr(verify_attention, "PACKED_ROWS", packed_rows)
    monkeypatch.setattr(verify_attention, "MATMUL_ROWS", matmul_rows)
    target = sdpa_target(family).to(dtype)
    drafter = make_drafter(target, verify_policy="fixed").to(dtype)
    ids = torch.randint(0, 99, (1, 9))  # longer than the sliding windows
    plain = target.generate(ids, do_sample=False, max_new_tokens=25)
    ways = []
    calls = record_sdpa(monkeypatch, ways=ways)
    out = target.generate(ids, do_sample=False, max_new_tokens=25, assistant_model=drafter)
    assert torch.equal(out, plain)
    assert calls.count(True) >= 4 * 2  # every layer of at least two verify passes
    # (a sliding window gives single-query steps a mask too, which transformers' sdpa packs itself)
    if matmul_rows and dtype == torch.float32:  # half precision keeps SDPA
        assert "matmul" in ways and "gqa" not in ways
    else:
        assert ("gqa" not in ways and "packed" in ways) if packed_rows else ("gqa" in ways)
    assert target.config._attn_implementation == "sdpa"


def test_engine_and_padded_baseline_use_it(monkeypatch):
    target = sdpa_target()
    prompt = torch.randint(0, 99, (5,)).tolist()
    plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
    calls = record_sdpa(monkeypatch)
    engine = Engine(target, make_drafter(target), verify_policy="fixed")
    request = engine.add_request(prompt, max_new_tokens=12)
    while engine.has_unfinished():
        engine.step()
    assert request.output_ids == plain[0, 5:].tolist() and True in calls
    calls.clear()
    with padded_steps(target):
        padded = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
    assert torch.equal(padded, plain) and calls.count(True) == 4 * 11  # 11 padded steps, 4 layers each
    assert target.config._attn_implementation == "sdpa"


def test_verifies_without_the_products_still_read_the_cache_unrepeated():
    """A kernel choice that drops the few-rows products keeps the attention routed (SDPA's own GQA): that halves a
    verify over a long cache and is never slower (docs/long_context.md)."""
    target = sdpa_target()
    choice = VerifyKernels(KernelTable({3: ("linear", 3)}))  # measured: plain linears win at 3 rows here
    with choice.verify(target, 3):
        assert target.config._attn_implementation == ATTN_IMPLEMENTATION
        assert not any(type(m) is not torch.nn.Linear for m in verify_head.eligible_linears(target))
    assert target.config._attn_implementation == "sdpa"
