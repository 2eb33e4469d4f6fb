"""Decoding with a drafter under `torch.inference_mode()` as under `torch.no_grad()`: `generate()`, `pipeline()`,
the Engine and trees give plain greedy's tokens with the verify kernels and the routed attention running.

Tensors made under inference mode have no in-place version counter: every kernel cache keyed on one
(`verify_attention._once_per_mask`, the kept weight copies) must not read it, and must still see a new mask."""

import pytest
import torch
from transformers import pipeline

from conftest import make_drafter, make_target
from dspark_hf import Engine
from dspark_hf.kernels import verify_attention
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.verify_attention import routed, verify_sdpa_attention_forward
from helpers import char_tokenizer


MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


pytestmark = pytest.mark.usefixtures("two_threads")  # the attention packs its query heads by thread count


@pytest.fixture
def kernels_seen(monkeypatch):
    """Counts the routed attention's per-mask products (the matrix-product bias or the packed mask), the code that
    read the mask's version counter."""
    seen = []
    original = verify_attention._once_per_mask
    monkeypatch.setattr(verify_attention, "_once_per_mask", lambda *a: seen.append(a[1][0]) or original(*a))
    return seen


def sdpa_pair(**drafter_overrides):
    target = make_target(attn_implementation="sdpa")
    return target, make_drafter(target, **{"verify_policy": "fixed", **drafter_overrides})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("way", ["linear", "few rows", "packed"])
@pytest.mark.parametrize("matmul_rows", [24, 0])  # the bias of two products, or the packed heads' repeated mask
def test_generate_under_each_mode_is_plain_greedy(monkeypatch, kernels_seen, mode, way, matmul_rows):
    monkeypatch.setattr(OPTIONS, "verify_way", way)
    monkeypatch.setattr(verify_attention, "MATMUL_ROWS", matmul_rows)
    target, drafter = sdpa_pair()
    ids = torch.randint(0, 99, (2, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=20)
    with MODES[mode]():
        out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter)
    assert torch.equal(out, plain)
    assert ("bias" if matmul_rows else "repeat") in kernels_seen  # the routed attention ran on the verify masks
    assert target.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("mode", MODES)
def test_pipeline_under_each_mode_is_plain_greedy(kernels_seen, mode):
    target, drafter = sdpa_pair()
    pipe = pipeline("text-generation", model=target, tokenizer=char_tokenizer(99))
    text = "Hello DSpark, hello"
    plain = pipe(text, max_new_tokens=16, do_sample=False)
    with MODES[mode]():
        out = pipe(text, max_new_tokens=16, do_sample=False, assistant_model=drafter)
    assert out == plain and kernels_seen


@pytest.mark.parametrize("mode", MODES)
def test_engine_under_each_mode_is_plain_greedy(kernels_seen, mode):
    target, drafter = sdpa_pair()
    prompts = [torch.randint(0, 99, (n,)).tolist() for n in (5, 8)]
    plain = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16)[0, len(p) :] for p in prompts]
    engine = Engine(target, drafter, verify_policy="fixed")
    requests = [engine.add_request(p, max_new_tokens=16) for p in prompts]
    with MODES[mode]():
        while engine.has_unfinished():
            engine.step()
    assert [r.output_ids for r in requests] == [p.tolist() for p in plain]
    assert kernels_seen


@pytest.mark.parametrize("mode", MODES)
def test_trees_under_each_mode_are_plain_greedy(kernels_seen, mode):
    target, drafter = sdpa_pair()
    drafter.config.tree_budget = 8
    ids = torch.randint(0, 99, (2, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=20)
    with MODES[mode]():
        out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter)
    assert torch.equal(out, plain) and kernels_seen


def test_modes_in_turn_on_the_same_models(monkeypatch):
    """Kernel state kept between calls (packed weights, measured choices, kept copies) made under one mode serves
    the other: inference mode, no_grad, inference mode again, each plain greedy."""
    monkeypatch.setattr(OPTIONS, "verify_way", "packed")
    target, drafter = sdpa_pair()
    ids = torch.randint(0, 99, (1, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=20)
    for mode in ("inference_mode", "no_grad", "inference_mode"):
        with MODES[mode]():
            out = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter)
        assert torch.equal(out, plain), mode


def _mask(q=3, length=11, hidden=()):
    """A (2, 1, q, length) bool mask: each query sees the cache and itself, minus the `hidden` key positions."""
    mask = (torch.arange(length)[None, :] <= torch.arange(length - q, length)[:, None])[None, None].repeat(2, 1, 1, 1)
    for position in hidden:
        mask[..., position] = False
    return mask


class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal = 3, True


@pytest.mark.parametrize("matmul_rows", [24, 0])
def test_a_new_inference_mask_is_never_served_a_stale_result(monkeypatch, matmul_rows):
    """Inference tensors carry no version counter, so the per-mask result is held by identity within a verify pass:
    a new mask gets its own, and a mask edited in place (possible only inside inference mode) between passes too."""
    monkeypatch.setattr(verify_attention, "MATMUL_ROWS", matmul_rows)
    module = _Attention()
    query, key, value = torch.randn(2, 6, 3, 8), *torch.randn(2, 2, 2, 11, 8)

    def check(mask):
        ours, _ = verify_sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        reference = verify_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)[0]
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)

    target = make_target(attn_implementation="sdpa")
    with torch.inference_mode():
        first = _mask()
        assert first.is_inference()
        with routed(target):
            check(first)
            check(first)  # the kept result
        with routed(target):
            first[..., 2] = False  # the same tensor, edited between passes: no version counter tells
            check(first)
            check(_mask(hidden=(0, 4)))  # a new mask in the same pass
            check(first)
