"""The drafter's CPU linears through oneDNN's packed weights (`packed_linear`), and bf16 drafters beside a float32
target: same products up to rounding, gradients untouched, caches rebuilt when weights change, outputs lossless."""

import copy

import pytest
import torch
from torch import nn

from conftest import make_drafter, make_target
from dspark_hf.evaluation.harness import load_assistant
from dspark_hf.kernels import packed_linear
from dspark_hf.kernels.few_rows import kept_copies
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.packed_linear import PackedLinear, inference_dtype, pack_linears, packed_count


needs_packing = pytest.mark.skipif(
    not packed_linear._check_available(), reason="this torch build has no oneDNN packed linear operators"
)
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def packed_copy(linear: nn.Linear) -> PackedLinear:
    module = nn.Sequential(linear)
    assert pack_linears(module) == 1
    return module[0]


@needs_packing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_packed_linear_computes_the_linear(dtype, bias):
    reference = nn.Linear(24, 37, bias=bias).to(dtype)
    layer = packed_copy(nn.Linear(24, 37, bias=bias).to(dtype))
    layer.load_state_dict(reference.state_dict())
    # 2-D, 3-D and a sliced (non-contiguous) 3-D input, from one row to more than the packed range
    for x in (torch.randn(1, 24), torch.randn(2, 7, 24), torch.randn(1, 9, 24)[:, :3], torch.randn(1, 80, 24)):
        x = x.to(dtype)
        torch.testing.assert_close(layer(x), reference(x), **TOLERANCE[dtype])
    # the packed path ran (and keeps its copy); bf16 only where the CPU computes it natively
    assert bool(packed_count(layer)) == (dtype == torch.float32 or packed_linear.bf16_native())


@needs_packing
def test_packed_copy_follows_weight_updates_and_gradients_take_the_plain_path():
    layer = packed_copy(nn.Linear(16, 8))
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # in place, as an optimizer step: the packed copy must be rebuilt
        torch.testing.assert_close(layer(x), 2 * (before - layer.bias) + layer.bias)
    out = layer(x)  # with gradients: nn.Linear.forward, so training is unaffected
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(8, 16))


def test_pack_linears_is_idempotent_and_skips_what_it_must():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 1), nn.Linear(6, 6))
    model[2].forward = lambda x: x  # a replaced forward: leave it alone
    assert pack_linears(model) == 1 and pack_linears(model) == 1
    assert [type(m) for m in model] == [PackedLinear, nn.Linear, nn.Linear]


@needs_packing
def test_disabled_packing_uses_the_plain_linear(monkeypatch):
    layer = packed_copy(nn.Linear(8, 8))
    monkeypatch.setattr(OPTIONS, "packed_linear", False)
    with torch.no_grad():
        layer(torch.randn(2, 8))
    assert packed_count(layer) == 0


def test_the_availability_check_leaves_the_global_rng_alone():
    packed_linear._check_available.cache_clear()
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    packed_linear._check_available()
    assert torch.equal(torch.rand(4), expected)


def test_inference_dtype(monkeypatch):
    monkeypatch.setattr(packed_linear, "bf16_native", lambda: True)
    assert inference_dtype("cpu", torch.float32) == torch.bfloat16
    assert inference_dtype("cuda", torch.float16) == torch.float16  # other devices: the target's dtype
    monkeypatch.setattr(packed_linear, "bf16_native", lambda: False)
    assert inference_dtype("cpu", torch.float32) == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_assistant_loads_drafters_in_the_inference_dtype(target, tmp_path, monkeypatch, dtype):
    make_drafter(target).save_pretrained(tmp_path)
    monkeypatch.setattr(packed_linear, "bf16_native", lambda: dtype == torch.bfloat16)
    assert load_assistant(str(tmp_path)).dtype == dtype
    assert load_assistant(str(tmp_path), dtype=torch.float32).dtype == torch.float32


@torch.no_grad()
def test_bf16_drafter_drafts_against_a_bf16_copy_of_the_float32_head(target):
    drafter32 = make_drafter(target)
    drafter16 = make_drafter(target).to(torch.bfloat16)
    lm_head = target.get_output_embeddings()
    hidden = torch.randn(1, drafter32.config.block_size, target.config.hidden_size)
    ref = drafter32.base_logits(hidden, lm_head)
    out = drafter16.base_logits(hidden.bfloat16(), lm_head)
    assert out.dtype == torch.float32 and lm_head.weight.dtype == torch.float32  # the target is untouched
    torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)
    (rows,) = kept_copies(drafter16, "rows")
    assert rows.dtype == torch.bfloat16 and rows.shape == lm_head.weight.shape
    drafter16.base_logits(hidden.bfloat16(), lm_head)
    assert kept_copies(drafter16, "rows")[0] is rows  # the copy is kept between calls


@pytest.mark.parametrize("sequential_head", ["markov", "rnn"])
def test_bf16_drafter_is_lossless_beside_a_float32_target(target, sequential_head):
    drafter = make_drafter(target, sequential_head=sequential_head).to(torch.bfloat16)
    ids = torch.randint(0, 99, (1, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=20)
    assisted = target.generate(ids, do_sample=False, max_new_tokens=20, assistant_model=drafter)
    assert torch.equal(plain, assisted)
    assert sum(drafter.generation_stats.verify_lengths) > 0  # it drafted
    assert all(type(m) is not nn.Linear or m.out_features == 1 for m in drafter.modules())  # packed for inference


@needs_packing
@torch.no_grad()
def test_linear_routes_few_float32_rows_to_the_transposed_product_and_packs_the_rest():
    owner, weight = nn.Module(), torch.randn(40, 16)
    for rows, packs in ((2, False), (4, False), (7, True)):
        x = torch.randn(1, 9, 16)[:, :rows]  # sliced, as the drafter's first block positions are
        torch.testing.assert_close(
            packed_linear.linear(x, weight, owner=owner), x @ weight.T, **TOLERANCE[torch.float32]
        )
        assert bool(packed_count(owner)) == packs
    bf16 = weight.bfloat16()
    x = torch.randn(1, 2, 16).bfloat16()
    torch.testing.assert_close(packed_linear.linear(x, bf16, owner=owner), x @ bf16.T, **TOLERANCE[torch.bfloat16])
    assert packed_count(owner) == (2 if packed_linear.bf16_native() else 1)  # bf16 packs from the first row


@torch.no_grad()
def test_a_float32_drafter_beside_a_bf16_head_keeps_no_float32_copy():
    target = make_target().to(torch.bfloat16)
    drafter = make_drafter(target)  # float32
    lm_head = target.get_output_embeddings()
    hidden = torch.randn(1, drafter.config.block_size, target.config.hidden_size)
    logits = drafter.base_logits(hidden, lm_head)
    torch.testing.assert_close(logits, (hidden.bfloat16() @ lm_head.weight.T).float(), atol=0.1, rtol=0.05)
    assert not kept_copies(drafter, "rows")  # the head's own bf16 weight, no cast copy kept


@torch.no_grad()
def test_bf16_is_not_packed_on_a_cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(packed_linear, "bf16_native", lambda: False)
    reference = nn.Linear(16, 8).bfloat16()
    layer = packed_copy(nn.Linear(16, 8).bfloat16())
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(3, 16).bfloat16()
    torch.testing.assert_close(layer(x), reference(x))
    assert packed_count(layer) == 0


@needs_packing
def test_a_drafter_that_has_drafted_can_still_be_copied_and_saved(target, tmp_path):
    drafter = make_drafter(target)
    drafter.set_draft_vocab(list(range(0, 99, 2)))  # kept copies of both kinds: gathered head rows, packed weights
    target.generate(torch.randint(0, 99, (1, 5)), do_sample=False, max_new_tokens=6, assistant_model=drafter)
    assert any(packed_count(m) for m in drafter.modules())  # it drafted through packed weights
    assert kept_copies(drafter, "rows")  # and the head's draft-vocabulary rows
    twin = copy.deepcopy(drafter)
    torch.save(drafter.state_dict(), tmp_path / "weights.pt")
    torch.save(drafter, tmp_path / "model.pt")
    ids = torch.randint(0, 99, (1, 5))
    assert torch.equal(
        target.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=twin),
        target.generate(ids, do_sample=False, max_new_tokens=8),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_under_inference_mode(target, dtype):
    """Pipelines run generate() under `torch.inference_mode`: the kept copies made there have no version counter."""
    drafter = make_drafter(target).to(dtype)
    drafter.set_draft_vocab(list(range(0, 99, 2)))
    ids = torch.randint(0, 99, (1, 5))
    with torch.inference_mode():
        plain = target.generate(ids, do_sample=False, max_new_tokens=8)
        for _ in range(2):  # the second call reuses what the first kept
            assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=drafter), plain)
