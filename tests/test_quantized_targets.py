"""Quantized and offloaded targets: what the package may do with each kind of target linear (`kernels/weights.py`),
and greedy decoding with a drafter that is token-identical to the quantized target's own plain greedy decoding."""

import importlib.util

import pytest
import torch
from torch import nn

from conftest import make_drafter, make_target
from dspark_hf.integrations.quantization import quantize_target
from dspark_hf.kernels import verify_head, weights
from dspark_hf.kernels.packed_linear import pack_linears
from dspark_hf.kernels.weights import DENSE, HOOKED, QUANTIZED, SUBCLASS, weight_kind
from dspark_hf.serving.engine import Engine
from helpers import pin_drafter


PROMPTS = [[5, 17, 3, 8], [40, 2, 9, 11, 7, 33, 8, 1], [61, 4]]
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


class RefusingWeight(torch.Tensor):
    """A minimal weight tensor subclass in the manner of torchao's: `F.linear` with it works (through
    `__torch_function__`), any other operation on it (`weight @ x`, indexing, casting) raises."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data):
        self.data_ = data

    def dequantize(self):
        return self.data_.clone()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.linear:
            x, weight, bias = (*args, None)[:3] if len(args) >= 2 else (args[0], kwargs["weight"], None)
            return nn.functional.linear(x, weight.data_, kwargs.get("bias", bias))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return RefusingWeight(args[0].data_)
        raise NotImplementedError(f"RefusingWeight refuses {func}")

    def __repr__(self):
        return f"RefusingWeight({tuple(self.shape)})"


def with_refusing_weights(target):
    for module in target.modules():
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(RefusingWeight(module.weight.detach().clone()), requires_grad=False)
    return target


def with_bitsandbytes(target, bits):
    """Every linear of the target as a bitsandbytes `Linear4bit` (nf4) or `Linear8bitLt` (int8), on the CPU."""
    import bitsandbytes as bnb

    for parent in list(target.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            weight = child.weight.detach().clone()
            if bits == 4:
                new = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, quant_type="nf4")
                new.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
                new.compute_dtype = torch.float32
            else:
                new = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=False, has_fp16_weights=False)
                new.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            setattr(parent, name, new.to("cpu"))  # bitsandbytes quantizes on the move to a device
    return target


def offloaded(target):
    from accelerate import cpu_offload

    cpu_offload(target, execution_device="cpu")
    return target


KINDS = {  # how the target's linears are made -> the kind `weight_kind` must name
    "int8-weight": (lambda t: quantize_target(t, "int8-weight"), SUBCLASS),
    "int4-weight": (lambda t: quantize_target(t, "int4-weight"), SUBCLASS),
    "dynamic-int8": (lambda t: quantize_target(t, "dynamic-int8"), QUANTIZED),
    "tensor-subclass": (with_refusing_weights, SUBCLASS),
    "accelerate-offloaded": (offloaded, HOOKED),
    "bnb-4bit": (lambda t: with_bitsandbytes(t, 4), QUANTIZED),
    "bnb-8bit": (lambda t: with_bitsandbytes(t, 8), QUANTIZED),
}


def built(kind, **target_kwargs):
    make, expected = KINDS[kind]
    if kind.endswith("-weight") and not HAS_TORCHAO:
        pytest.skip("torchao is not installed (pip install torchao)")
    if kind.startswith("bnb") and not HAS_BNB:
        pytest.skip("bitsandbytes is not installed (its CPU wheel: pip install bitsandbytes)")
    target = make_target(**target_kwargs)
    drafter = make_drafter(target)  # built on the float target, as a shipped drafter is
    return make(target), drafter, expected


def test_the_kinds_are_told_apart():
    assert weight_kind(nn.Linear(4, 3)) == DENSE
    refusing = with_refusing_weights(nn.Sequential(nn.Linear(4, 3)))[0]
    assert weight_kind(refusing) == SUBCLASS and weights.dense_weight(refusing) is None
    with pytest.raises(NotImplementedError):
        refusing.weight @ torch.randn(4, 2)
    hooked = nn.Linear(4, 3)
    hooked.register_forward_hook(lambda *a: None)
    assert weight_kind(hooked) == HOOKED

    class Params4bit(nn.Parameter):  # bitsandbytes' 4-bit weight class, recognised by its public name only
        pass

    bnb_like = nn.Linear(4, 3)
    bnb_like.weight = Params4bit(torch.zeros(6, 1, dtype=torch.uint8), requires_grad=False)
    bnb_like.compute_dtype = torch.bfloat16
    assert weight_kind(bnb_like) == QUANTIZED and weights.input_dtype(bnb_like) == torch.bfloat16

    gptq_like = nn.Module()  # GPTQ/AWQ QuantLinear: packed `qweight`, `scales`, no `weight`
    gptq_like.register_buffer("qweight", torch.zeros(4, 3, dtype=torch.int32))
    gptq_like.infeatures, gptq_like.outfeatures = 32, 3
    assert weight_kind(gptq_like) == QUANTIZED and weights.out_features(gptq_like) == 3


@pytest.mark.parametrize("kind", list(KINDS))
def test_kind_dequantization_and_the_kernels_leave_it_alone(kind):
    target, _, expected = built(kind)
    head = target.get_output_embeddings()
    assert weight_kind(head) == expected
    assert (weights.quantization(target) is None) == (kind == "accelerate-offloaded")
    assert verify_head.eligible_linears(target) == []  # no few-rows product on a weight that is not plain
    assert pack_linears(target) == 0
    # one explicit float copy, equal to what the module computes (exactly, for weight-only kinds)
    owner = nn.Module()
    copy = weights.dequantized(head, owner)
    assert weights.dequantized(head, owner) is copy and copy.shape == (99, 32)
    x = torch.randn(1, 32)
    tolerance = dict(atol=0.05, rtol=0.05) if kind in ("dynamic-int8", "bnb-8bit") else {}
    torch.testing.assert_close(nn.functional.linear(x, copy), head(x), **tolerance)


@pytest.mark.parametrize("kind", list(KINDS))
def test_generate_with_a_drafter_equals_the_quantized_targets_own_greedy(kind):
    target, drafter, _ = built(kind)
    plain = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=14)[0].tolist() for p in PROMPTS]
    # the drafter's heads through the borrowed quantized head (random drafts), then drafts right up to slot 2
    for use in (drafter, pin_drafter(make_drafter(target), plain, diverge_at=2)):
        for prompt, reference in zip(PROMPTS, plain):
            out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=14, assistant_model=use)
            assert out[0].tolist() == reference
    assert use.generation_stats.per_position_acceptance[:3] == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("kind", ["int8-weight", "dynamic-int8", "tensor-subclass"])
def test_batches_and_the_engine_give_each_row_its_own_greedy(kind):
    """Every row of a batch (generate() left-padded, the Engine) equals its prompt's plain batch-1 greedy output on the
    quantized target. For dynamic int8 (one activation scale per call, so its own batched generate() depends on the
    batch) the Engine prefills prompts one by one and verifies token by token; that makes it exact here, while on
    real targets the int8 rounding step can still turn float rounding in attention into a flipped near-tie
    (docs/quantization.md has the count). A batched generate() on such a target decodes plain instead (token by
    token verifies would make it slower than plain): exactly the target's own batched generate(), no drafts."""
    target, drafter, _ = built(kind)
    plain = [
        target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12)[0, len(p) :].tolist() for p in PROMPTS
    ]
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in PROMPTS])[:, None]).long()
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, assistant_model=drafter)
    if kind == "dynamic-int8":
        batched = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
        assert torch.equal(out, batched)
        stats = drafter.generation_stats
        assert stats.num_new_tokens == 12 * len(PROMPTS) and stats.gated_rounds == 11 * len(PROMPTS)
        assert stats.acceptance_length == 1.0 and sum(stats.verify_lengths) == 0
    else:
        assert out[:, width:].tolist() == plain
    engine = Engine(target, make_drafter(target), verify_policy="fixed")
    assert engine.generate(PROMPTS, max_new_tokens=12) == plain


def test_a_dynamic_int8_batch_decodes_plain_and_says_why(caplog):
    """generate() with a drafter on a dynamically quantized target: batch 1 drafts; a batch decodes plain, with one
    info line naming the reason, and leaves the target as it found it."""
    import logging

    from transformers.utils import logging as hf_logging

    target, drafter, _ = built("dynamic-int8")
    drafter.config.verify_policy = "fixed"
    target.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=8, assistant_model=drafter)
    assert sum(drafter.generation_stats.verify_lengths) > 0  # batch 1: drafted
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    hf_logging.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO):
            out = target.generate(ids, do_sample=False, max_new_tokens=8, assistant_model=drafter)
    finally:
        hf_logging.set_verbosity_warning()
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=8))
    said = [r.getMessage() for r in caplog.records if "dynamically quantized" in r.getMessage()]
    assert len(said) == 1 and "2 rows" in said[0] and "decodes plain" in said[0]
    assert sum(drafter.generation_stats.verify_lengths) == 0
    assert not any(k.startswith("_dspark") for k in vars(target))


def test_a_plain_decoded_batch_counts_each_rows_own_tokens():
    """A batch decoded plain (dynamic int8) whose first row a stopping criterion ends early: the statistics count the
    tokens each row decoded, not the padding the batch added after its stop."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopFirstRow(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            done[0] = input_ids.shape[1] >= width + 4
            return done

    target, drafter, _ = built("dynamic-int8")
    width, pad = max(map(len, PROMPTS)), 98
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in PROMPTS])[:, None]).long()
    # transformers pads a row stopped early only where an EOS ends rows too (97: one no row here decodes)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=pad, eos_token_id=97)
    kw["stopping_criteria"] = StoppingCriteriaList([StopFirstRow()])
    plain = target.generate(ids, **kw)
    assert plain[0, width + 4 :].eq(pad).all() and not plain[1:, width:].eq(pad).any()  # the case this test needs
    assert not plain[:, width:].eq(97).any()
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kw), plain)
    assert drafter.generation_stats.num_new_tokens == 4 + 12 * (len(PROMPTS) - 1)


def test_a_draft_vocabulary_takes_rows_of_one_dequantized_copy():
    target, drafter, _ = built("tensor-subclass")
    drafter.set_draft_vocab(list(range(0, 99, 2)))
    plain = target.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=10)
    out = target.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=10, assistant_model=drafter)
    assert torch.equal(out, plain)
    from dspark_hf.kernels.few_rows import kept_copies

    (copy,) = kept_copies(drafter, "dequantized")
    assert copy.shape == (99, 32) and type(copy) is torch.Tensor


def test_dynamic_int8_verifies_each_token_with_its_own_scale(monkeypatch):
    """One activation scale per call makes a token's output depend on its neighbours; within
    `per_token_activations` a k-token call gives each token exactly its one-token result. `OPTIONS.per_token_verify`
    off: no linear is computed token by token."""
    from dspark_hf.kernels.options import OPTIONS

    model = quantize_target(nn.Sequential(nn.Linear(16, 8)), "dynamic-int8")
    (linear,) = weights.per_token_linears(model)
    monkeypatch.setattr(OPTIONS, "per_token_verify", False)
    assert weights.per_token_linears(model) == []
    monkeypatch.setattr(OPTIONS, "per_token_verify", True)
    x = torch.randn(1, 3, 16)
    x[0, 2] *= 50  # one large activation widens the shared scale
    alone = torch.cat([linear(x[:, i : i + 1]) for i in range(3)], dim=1)
    assert not torch.equal(linear(x), alone)
    cls = type(linear)
    with weights.per_token_activations(linear, [linear]):
        assert torch.equal(linear(x), alone)
    assert type(linear) is cls


def test_profiles_tell_a_quantized_target_from_its_float_original():
    from dspark_hf.decoding.profiling import _target_key, target_fingerprint

    target = make_target()
    before = _target_key(target)
    assert "quantization" not in target_fingerprint(target)  # the shipped profiles' fingerprints stay valid
    quantized = quantize_target(target, "dynamic-int8")
    assert target_fingerprint(quantized)["quantization"] == weights.quantization(quantized)
    assert _target_key(quantized) != before


def test_calibrate_refits_temperatures_for_a_quantized_target_into_a_copy(tmp_path):
    import json

    from dspark_hf import DSparkDraftModel
    from dspark_hf.cli import main
    from dspark_hf.training.dataset import TokenDataset
    from helpers import char_tokenizer

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(99).save_pretrained(tmp_path / "target")
    original = make_drafter(target, block_size=3)
    original.save_pretrained(tmp_path / "drafter")
    seqs = [torch.randint(0, 99, (30,)).tolist() for _ in range(6)]
    TokenDataset.from_sequences(seqs, [2] * 6).save(tmp_path / "heldout.npz")
    args = ["calibrate", "--data", str(tmp_path / "heldout.npz"), "--seq-len", "32", "--batches", "2"]
    args += ["--anchors", "8", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
    args += ["--quantize", "dynamic-int8"]
    assert main([*args, "--out", str(tmp_path / "int8")]) == 0
    report = json.loads((tmp_path / "int8/calibration.json").read_text())
    assert report["quantize"] == "dynamic-int8" and len(report["shipped"]["ece"]) == 3
    copy = DSparkDraftModel.from_pretrained(tmp_path / "int8")
    assert copy.config.sts_temperatures == pytest.approx(report["temperatures"])
    kept = DSparkDraftModel.from_pretrained(tmp_path / "drafter")
    assert kept.config.sts_temperatures == original.config.sts_temperatures  # the checkpoint's own: untouched
    for mine, theirs in zip(copy.state_dict().values(), original.state_dict().values()):
        assert torch.equal(mine, theirs.to(mine.dtype))  # the backbone and heads: untouched


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_scheduler_profiles_a_quantized_target_then_decodes_its_own_greedy(kind):
    """With no profile for it, the scheduler policy profiles the target first, memory floor included: the bytes of a
    tensor-subclass weight are those of the plain tensors inside it (a torchao weight's own storage pointer raises),
    and the decoding that follows is the target's greedy."""
    from dspark_hf.decoding.profiling import weight_bytes

    target, drafter, _ = built(kind)
    assert weight_bytes(target) > 0
    for prompt in PROMPTS:
        plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10)
        out = target.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=10, assistant_model=drafter,
            verify_policy="scheduler",
        )  # fmt: skip
        assert torch.equal(out, plain)


def test_weight_bytes_count_each_quantized_weight_once():
    """Dynamic int8 stores a byte per weight (each layer's own, though `weight()` unpacks a new tensor each call);
    float32 four."""
    from dspark_hf.decoding.profiling import weight_bytes

    target = make_target()
    linears = [m for m in target.modules() if isinstance(m, nn.Linear)]
    elements = sum(m.weight.numel() for m in linears)
    assert weight_bytes(target) == 4 * elements
    quantized, _, _ = built("dynamic-int8")
    assert weight_bytes(quantized) == elements
