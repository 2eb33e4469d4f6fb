"""No kept copy of the weights answers for weights that changed since it was made (kernels/freshness.py): whatever way
the target's weights change between two `generate()` calls, the second call's output is the changed model's own
plain greedy output."""

import copy

import pytest
import torch
from torch import nn

from conftest import make_drafter, make_target
from dspark_hf import Engine
from dspark_hf.kernels.few_rows import gathered_rows, kept_copies
from dspark_hf.kernels.fingerprint import fingerprint, same
from dspark_hf.kernels.freshness import drop_stale
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.verify_linears import packable, packs_for


needs_packing = pytest.mark.skipif(not packable(make_target()), reason="oneDNN's packed operators unavailable")


# -- fingerprints -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(37, 32), (32, 37), (99,), (5, 3, 7), ()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_fingerprint_sees_any_one_changed_element_and_a_swap(shape, dtype):
    w = torch.randn(shape).to(dtype)
    made = fingerprint(w)
    assert same(made, fingerprint(w.clone()))
    flat = w.view(-1)
    for i in {0, flat.numel() // 2, flat.numel() - 1}:
        edited = w.clone()
        bits = edited.view(-1).view(torch.int32 if dtype == torch.float32 else torch.int16)
        bits[i] += 1  # one ulp
        assert not same(made, fingerprint(edited)), f"element {i}"
    if flat.numel() > 1:
        swapped = w.clone()
        swapped.view(-1)[[0, -1]] = flat[[-1, 0]]
        assert torch.equal(swapped, w) or not same(made, fingerprint(swapped))
    assert not same(made, fingerprint(w.to(torch.float64)))  # another dtype


def test_a_fingerprint_reads_quantized_and_subclass_weights():
    dynamic = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(16, 8)), {nn.Linear}, torch.qint8)[0]
    made = fingerprint(dynamic)
    assert same(made, fingerprint(dynamic))
    other = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(16, 8)), {nn.Linear}, torch.qint8)[0]
    assert not same(made, fingerprint(other))
    dynamic.load_state_dict(other.state_dict())  # new packed weights in place of the old ones
    assert not same(made, fingerprint(dynamic))
    made = fingerprint(dynamic)
    dynamic.set_weight_bias(other.weight(), None)
    assert not same(made, fingerprint(dynamic))
    torchao = pytest.importorskip("torchao.quantization")
    linear = nn.Linear(32, 16)
    torchao.quantize_(linear, torchao.Int8WeightOnlyConfig())
    made = fingerprint(linear.weight)
    assert same(made, fingerprint(linear.weight))
    for inner in linear.weight.__tensor_flatten__()[0]:
        getattr(linear.weight, inner).data.view(-1)[0] += 1  # an edit inside the subclass's own tensors
        assert not same(made, fingerprint(linear.weight)), inner
        made = fingerprint(linear.weight)


# -- whole calls: the packed target -------------------------------------------------------------------------------


def _edit_down_proj(target):
    for layer in target.model.layers:
        layer.mlp.down_proj.weight.data.mul_(40.0)


def _negate_q_proj(target):
    for layer in target.model.layers:
        layer.self_attn.q_proj.weight.data.mul_(-300)
        layer.self_attn.k_proj.weight.data.mul_(300)


def _tied_head_slice(target):
    assert target.lm_head.weight is target.model.embed_tokens.weight
    target.lm_head.weight.data[:, :16] *= 20.0


def _load_state_dict(target):
    state = {k: v * 40.0 if k.endswith("down_proj.weight") else v for k, v in target.state_dict().items()}
    target.load_state_dict(state)


def _optimizer_step(target):
    optimizer = torch.optim.SGD(target.parameters(), lr=50.0)
    target.train()
    target(torch.randint(0, 99, (1, 6)), labels=torch.randint(0, 99, (1, 6))).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    target.eval()


def _swap_a_linear(target):
    for layer in target.model.layers:
        old = layer.mlp.down_proj
        new = nn.Linear(old.in_features, old.out_features, bias=False)
        with torch.no_grad():
            new.weight.copy_(old.weight * -40.0)
        layer.mlp.down_proj = new


class _Scaled(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 40.0 * self.inner(x)


def _wrap_a_linear(target):
    for layer in target.model.layers:
        layer.self_attn.o_proj = _Scaled(layer.self_attn.o_proj)


def _assign_data(target):
    for layer in target.model.layers:
        weight = layer.mlp.down_proj.weight
        weight.data = weight.data * -40.0  # the same Parameter, new storage


def _under_inference_mode(target):
    with torch.inference_mode():
        for layer in target.model.layers:
            layer.mlp.down_proj.weight.mul_(40.0)


EDITS = {
    "down_proj.data.mul_": _edit_down_proj,
    "q_proj, k_proj .data.mul_": _negate_q_proj,
    "slice of the tied lm_head.data": _tied_head_slice,
    "load_state_dict": _load_state_dict,
    "optimizer step": _optimizer_step,
    "linear swapped": _swap_a_linear,
    "linear wrapped": _wrap_a_linear,
    "param.data assigned": _assign_data,
    "edited under inference_mode": _under_inference_mode,
}


@needs_packing
@pytest.mark.parametrize("edit", EDITS)
def test_the_second_call_after_an_edit_is_the_edited_targets_plain_greedy(monkeypatch, edit):
    monkeypatch.setattr(OPTIONS, "verify_way", "packed")  # every verify and plain round through the packed copies
    target = make_target(attn_implementation="sdpa", tie_word_embeddings=True, initializer_range=0.5)
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (2, 7))
    before = target.generate(ids, do_sample=False, max_new_tokens=24, assistant_model=drafter)
    assert packs_for(target).nbytes > 0  # copies kept for the next call
    EDITS[edit](target)
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    assert not torch.equal(plain, before)  # the edit changes the output (else the test could not fail)
    out = target.generate(ids, do_sample=False, max_new_tokens=24, assistant_model=drafter)
    assert torch.equal(out, plain)


@needs_packing
def test_a_dtype_move_drops_the_packs_and_stays_exact(monkeypatch):
    monkeypatch.setattr(OPTIONS, "verify_way", "packed")
    target = make_target(attn_implementation="sdpa")
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (1, 7))
    target.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=drafter)
    target.to(torch.float64)
    drafter.to(torch.float64)
    plain = target.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=drafter), plain)
    target.to(torch.float32)
    drafter.to(torch.float32)
    with torch.no_grad():
        _edit_down_proj(target)
    plain = target.generate(ids, do_sample=False, max_new_tokens=16)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=16, assistant_model=drafter), plain)


@needs_packing
def test_the_engine_sees_an_edit_made_while_it_was_idle(monkeypatch):
    monkeypatch.setattr(OPTIONS, "verify_way", "packed")
    target = make_target(attn_implementation="sdpa")
    engine = Engine(target, make_drafter(target, verify_policy="fixed"), max_batch_size=2)
    prompts = [torch.randint(0, 99, (7,)).tolist() for _ in range(2)]
    before = engine.generate(prompts, max_new_tokens=16)
    _edit_down_proj(target)
    plain = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16)[0, 7:].tolist() for p in prompts]
    assert plain != before
    assert engine.generate(prompts, max_new_tokens=16) == plain


# -- peft: LoRA layers loaded, updated and merged ------------------------------------------------------------------


@needs_packing
def test_peft_lora_before_and_after_merge_and_unload(monkeypatch):
    peft = pytest.importorskip("peft")
    monkeypatch.setattr(OPTIONS, "verify_way", "packed")
    target = make_target(attn_implementation="sdpa")
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (1, 7))
    target.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=drafter)  # packed before any adapter
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(target, config).eval()
    base = model.get_base_model()

    def check():
        plain = base.generate(ids, do_sample=False, max_new_tokens=24)
        assert torch.equal(base.generate(ids, do_sample=False, max_new_tokens=24, assistant_model=drafter), plain)
        return plain

    with_adapter = check()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(3.0)  # the adapter updated in place
    assert not torch.equal(check(), with_adapter)
    merged = model.merge_and_unload()  # adds the deltas into the base weights through `.data`
    assert merged is target
    plain = target.generate(ids, do_sample=False, max_new_tokens=24)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=24, assistant_model=drafter), plain)


# -- the drafter's kept copies ------------------------------------------------------------------------------------


@torch.no_grad()  # copies are kept in inference only
def test_a_kept_copy_is_dropped_when_its_weight_changes_through_data():
    owner = nn.Module()
    weight = torch.randn(50, 16)
    ids = torch.tensor([3, 7, 11])
    rows = gathered_rows(owner, weight, ids, torch.bfloat16)
    assert kept_copies(owner, "rows")[0] is rows and gathered_rows(owner, weight, ids, torch.bfloat16) is rows
    assert drop_stale(owner) == 0  # nothing changed: the copy stays
    weight.data[7] += 1.0  # invisible to the version counter
    assert gathered_rows(owner, weight, ids, torch.bfloat16) is rows  # the per-use check cannot see it ...
    assert drop_stale(owner) == 1  # ... the per-call one does
    fresh = gathered_rows(owner, weight, ids, torch.bfloat16)
    assert torch.equal(fresh, weight[ids].to(torch.bfloat16))
    ids.data[0] = 4  # the gathered ids changed
    assert drop_stale(owner) == 1


def test_a_check_without_changes_keeps_every_copy_and_reads_shared_weights_once(monkeypatch):
    target = make_target(tie_word_embeddings=True)
    drafter = make_drafter(target)
    drafter.set_draft_vocab(torch.arange(0, 99, 2))
    target.generate(torch.randint(0, 99, (1, 5)), do_sample=False, max_new_tokens=6, assistant_model=drafter)
    kept = copy.copy(kept_copies(drafter, "rows"))
    assert kept
    reads = []
    from dspark_hf.kernels import fingerprint as module

    original = module.fingerprint
    monkeypatch.setattr(module, "fingerprint", lambda source: reads.append(id(source)) or original(source))
    assert drop_stale(target, drafter) == 0
    assert all(a is b for a, b in zip(kept_copies(drafter, "rows"), kept))
    assert len(reads) == len(set(reads))  # a shared weight is read once per check


class _Opaque(torch.Tensor):
    """A weight subclass that keeps its values its own way and refuses every operation (as some quantizers do)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func}")


@torch.no_grad()
def test_a_copy_of_values_that_cannot_be_read_is_never_trusted_across_calls():
    owner, opaque = nn.Module(), _Opaque(torch.randn(4, 4))
    assert not same(fingerprint(opaque), fingerprint(opaque))
    from dspark_hf.kernels.few_rows import kept_copy

    made = kept_copy(owner, "dequantized", opaque, ("key",), lambda: torch.ones(4, 4))
    assert kept_copy(owner, "dequantized", opaque, ("key",), lambda: torch.zeros(4, 4)) is made  # within a call
    assert drop_stale(owner) == 1  # but dropped at the next call's check, made again from the weight


def test_a_dynamic_int8_linear_is_fingerprinted_without_unpacking_it(monkeypatch):
    """Its packed weights change only by being replaced, so the fingerprint is that object: reading it unpacks
    nothing (unpacking SmolLM2's int8 LM head took ~0.4 s a call)."""
    from torch.ao.nn.quantized.modules.linear import LinearPackedParams

    dynamic = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(16, 8)), {nn.Linear}, torch.qint8)[0]

    def refuse(*args, **kwargs):
        raise AssertionError("unpacked")

    monkeypatch.setattr(LinearPackedParams, "_weight_bias", refuse)
    made = fingerprint(dynamic)
    assert same(made, fingerprint(dynamic))
