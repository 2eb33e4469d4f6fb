"""The few-rows products of verify passes (`verify_head`): same products, used only while verifying, lossless."""

import functools

import pytest
import torch
from torch import nn

from clocks import FakeClock
from conftest import make_drafter, make_target
from dspark_hf.kernels import verify_head, verify_linears
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.runtime import runtime_for
from dspark_hf.kernels.verify_head import (
    VerifyHead,
    VerifyLinear,
    eligible,
    eligible_linears,
    padded_steps,
    verify_kernels,
)
from dspark_hf.kernels.verify_linears import kernel_choice
from dspark_hf.serving.engine import Engine


def count_calls(monkeypatch) -> list[tuple[int, int]]:
    """Record (out features, rows) of every few-rows product."""
    calls, original = [], verify_head.linear_few_rows

    def counted(hidden, weight, bias=None):
        calls.append((weight.shape[0], hidden.numel() // hidden.shape[-1]))
        return original(hidden, weight, bias)

    monkeypatch.setattr(verify_head, "linear_few_rows", counted)
    return calls


def test_verify_kernels_take_the_plain_float32_cpu_linears_and_give_them_back():
    target = make_target()
    head, linears = target.lm_head, [m for m in target.modules() if type(m) is nn.Linear]
    weight, attributes = head.weight, [sorted(vars(m)) for m in linears]
    assert eligible(target) and len(eligible_linears(target)) == len(linears) == 4 * 7 + 1
    with verify_kernels(target):
        assert type(head) is VerifyHead and all(isinstance(m, VerifyLinear) for m in linears)
        assert head.max_rows == verify_head.MAX_ROWS_HEAD and linears[0].max_rows == verify_head.MAX_ROWS
        with verify_kernels(target):  # nested: a no-op, and the outer scope stays
            pass
        assert type(head) is VerifyHead
    assert all(type(m) is nn.Linear for m in linears) and [sorted(vars(m)) for m in linears] == attributes
    assert head.weight is weight and target.state_dict().keys() == make_target().state_dict().keys()
    with pytest.raises(RuntimeError), verify_kernels(target):
        raise RuntimeError("a failed verify")
    assert all(type(m) is nn.Linear for m in linears)  # restored after an exception too
    assert not eligible(make_target().to(torch.bfloat16))  # bf16 linears have no slow few-row path

    class Custom(nn.Linear):
        pass

    model = nn.Sequential(Custom(8, 50), nn.Linear(8, 50), nn.Embedding(5, 8))
    model[1].forward = lambda x: x  # someone else's forward (e.g. a hook library): left alone
    assert not eligible(model) and eligible_linears(model) == []


def test_few_rows_only_while_verifying(monkeypatch):
    calls = count_calls(monkeypatch)
    model = nn.Sequential(nn.Linear(8, 8))
    model(torch.randn(1, 4, 8))
    assert calls == []  # not verifying: nn.Linear's own forward
    with verify_kernels(model):
        for rows in (1, 2, 5, 6):
            model(torch.randn(1, rows, 8))
        model(torch.randn(2, 2, 8))  # 4 rows over two sequences
    assert calls == [(8, 2), (8, 2), (8, 5), (8, 4)]  # one row runs as two (a matrix-vector product can be slow)
    model(torch.randn(1, 3, 8))
    monkeypatch.setattr(OPTIONS, "verify_head", False)
    with verify_kernels(model):
        model(torch.randn(1, 3, 8))
    assert len(calls) == 4


def test_one_row_computes_the_linear_of_that_row():
    model = nn.Sequential(nn.Linear(64, 96))
    weight, bias, x = model[0].weight, model[0].bias, torch.randn(1, 1, 64)
    with verify_kernels(model):
        out = model(x)
    assert out.shape == (1, 1, 96)
    torch.testing.assert_close(out, nn.functional.linear(x, weight, bias))
    assert not torch.allclose(out, nn.functional.linear(x.flip(-1), weight, bias))  # the check can tell


def test_tied_head_stays_tied():
    target = make_target(tie_word_embeddings=True)
    with verify_kernels(target):
        assert target.lm_head.weight is target.model.embed_tokens.weight


def _fingerprint(model) -> list:
    """Everything generate() must leave as it found it: module classes, instance attributes, the config."""
    modules = [(name, type(m), sorted(vars(m))) for name, m in model.named_modules()]
    return [modules, model.config.to_json_string(), model.config._attn_implementation, sorted(vars(model))]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_generate_leaves_the_target_as_it_found_it(attn):
    target = make_target(attn_implementation=attn)
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (2, 7))
    target(ids, output_hidden_states=True)  # transformers marks its own output-capture hooks on first use
    before = _fingerprint(target)
    target.generate(ids, do_sample=False, max_new_tokens=9, assistant_model=drafter)
    assert _fingerprint(target) == before

    def fail(*args, **kwargs):
        raise RuntimeError("device lost")

    handle = target.model.layers[1].register_forward_hook(lambda *a: fail() if a[1][0].shape[1] > 1 else None)
    with pytest.raises(RuntimeError, match="device lost"):  # the prefill (7 rows) raises inside a forward
        target.generate(ids, do_sample=False, max_new_tokens=9, assistant_model=drafter)
    handle.remove()
    assert _fingerprint(target) == before


def test_generate_verifies_with_few_rows_and_stays_identical(monkeypatch):
    monkeypatch.setattr(OPTIONS, "verify_way", "few rows")  # every verify with the few-row products
    calls = count_calls(monkeypatch)
    target = make_target()
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (1, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=25)
    assert calls == [] and type(target.lm_head) is nn.Linear  # plain generate() does not touch the target
    out = target.generate(ids, do_sample=False, max_new_tokens=25, assistant_model=drafter)
    assert torch.equal(out, plain)
    assert type(target.lm_head) is nn.Linear  # the kernels were scoped to each verify pass
    gamma = drafter.config.block_size
    head_rows = [rows for out_features, rows in calls if out_features == 99]
    assert max(head_rows) == gamma + 1 and min(head_rows) >= 2  # verifies (the last may be cut by max_length)
    assert len(head_rows) <= drafter.generation_stats.num_target_forwards  # never the prefill
    assert len(calls) == len(head_rows) * (1 + 4 * 7)  # every linear of the target in each verify
    calls.clear()
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=25), plain)
    assert calls == []  # plain decoding never verifies


def test_engine_verifies_with_few_rows(monkeypatch):
    monkeypatch.setattr(OPTIONS, "verify_way", "few rows")
    calls = count_calls(monkeypatch)
    target = make_target()
    prompt = torch.randint(0, 99, (5,)).tolist()
    plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, 5:].tolist()
    engine = Engine(target, make_drafter(target), verify_policy="fixed")
    request = engine.add_request(prompt, max_new_tokens=12)
    while engine.has_unfinished():
        engine.step()
    assert request.output_ids == plain
    assert calls and all(2 <= rows <= 5 for _, rows in calls)


def test_drafter_still_multiplies_a_verify_head_itself():
    """Inside a verify scope the head is still a plain linear to the drafter: its draft vocabulary and few-rows
    product apply (the head's module forward would compute the whole vocabulary)."""
    target = make_target()
    drafter = make_drafter(target)
    drafter.set_draft_vocab(torch.arange(0, 99, 2))
    with verify_kernels(target):
        logits = drafter.draft_base_logits(torch.randn(1, 4, 32), target.get_output_embeddings())
    assert torch.isinf(logits[..., 1::2]).all() and torch.isfinite(logits[..., 0::2]).all()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_steps_decode_plainly_with_two_rows(monkeypatch, family):
    """The kernel-neutral baseline: each decoding step runs as two rows (few-rows products on), the junk row is cropped
    again, and the tokens are plain decoding's: greedy, a left-padded batch, and seeded sampling."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    classes = {"qwen3": dict(config_cls=Qwen3Config, model_cls=Qwen3ForCausalLM)}.get(family, {})
    target = make_target(**classes)
    ids = torch.randint(0, 99, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    widths = []
    target.model.register_forward_pre_hook(lambda m, a, k: widths.append(k["input_ids"].shape[1]), with_kwargs=True)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    torch.manual_seed(3)
    sampled = target.generate(ids[:1], do_sample=True, max_new_tokens=12)
    assert widths == [7] + [1] * 11 + [7] + [1] * 11
    widths.clear()
    calls = count_calls(monkeypatch)
    with padded_steps(target):
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
        assert widths == [7] + [2] * 11  # prefill, then every step with its junk copy
        torch.manual_seed(3)
        assert torch.equal(target.generate(ids[:1], do_sample=True, max_new_tokens=12), sampled)
    assert torch.equal(out, plain)
    step_rows = {rows for _, rows in calls}
    assert step_rows == {4, 2} and len(calls) == 22 * (1 + 4 * 7)  # batch 2 x 2 rows, then 1 x 2; every linear
    calls.clear(), widths.clear()
    assert torch.equal(target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12), plain)
    assert calls == [] and widths == [7] + [1] * 11  # the hooks are gone
    assert type(target.lm_head) is nn.Linear  # no verify scope left open


def test_padded_steps_reject_a_4d_mask():
    target = make_target()
    ids = torch.randint(0, 99, (1, 5))
    with padded_steps(target):
        out = target(input_ids=ids, use_cache=True)
        with pytest.raises(ValueError, match="2-D attention mask"):
            target(input_ids=ids[:, :1], cache=out.past_key_values, attention_mask=torch.ones(1, 1, 1, 6))
    assert type(target.lm_head) is nn.Linear  # no verify scope left open


def test_slow_kernels_are_dropped_and_output_stays_identical(monkeypatch):
    """Few-row products made 50 ms slower per LM-head product (packing off) on a simulated clock that moves only by
    those 50 ms, so the machine's load cannot change what is measured: the measurement keeps them out of every
    verify; the tokens are plain decoding's throughout, and the choice lives beside the target."""
    monkeypatch.setattr(OPTIONS, "packs", False)
    target = make_target()
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (1, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=40)
    original = verify_head.linear_few_rows
    calls, clock = [], FakeClock(tick=1e-6)  # every reading 1 us on: no way measures 0 s

    def slow(hidden, weight, bias=None):
        calls.append(hidden.numel() // hidden.shape[-1])
        if weight.shape[0] == 99:  # the LM head, once per pass
            clock.sleep(0.05)
        return original(hidden, weight, bias)

    monkeypatch.setattr(verify_head, "linear_few_rows", slow)
    # the first verify measures the kernels (`VerifyKernels.ensure` -> `measure`) and every verify is timed: both on
    # the simulated clock
    monkeypatch.setattr(verify_linears, "measure", functools.partial(verify_linears.measure, clock=clock))
    monkeypatch.setattr(runtime_for(target), "kernels", verify_linears.VerifyKernels(clock=clock))
    out = target.generate(ids, do_sample=False, max_new_tokens=40, assistant_model=drafter)
    assert torch.equal(out, plain)
    table = kernel_choice(target).table
    assert table.choice and all(way == "linear" for way, _ in table.choice.values())
    assert max(table.ms["linear"].values()) < 1 and min(table.ms["few rows"].values()) > 49  # simulated ms
    assert "_dspark" not in str(sorted(vars(target)))
    choice, calls_per_pass = kernel_choice(target), len(eligible_linears(target))
    assert all(
        choice.seconds[(r, "few rows", t)] > choice.seconds[(r, "linear", t)]
        for r, w, t in choice.seconds
        if w != "linear"
    )
    calls.clear()
    seen = dict(choice.verifies)
    out = target.generate(ids, do_sample=False, max_new_tokens=40, assistant_model=drafter)
    assert torch.equal(out, plain)
    assert kernel_choice(target) is choice and table.choice  # measured once per target, held across generate() calls
    # the slow way runs only on the tries of a row count first seen now (2) and on the retries (every 16th verify)
    new = {r: n - seen.get(r, 0) for r, n in choice.verifies.items() if n > seen.get(r, 0)}
    tries = sum(2 * (r not in seen) + n // choice.retry + 1 for r, n in new.items())
    assert len(calls) // calls_per_pass <= tries < sum(new.values())
