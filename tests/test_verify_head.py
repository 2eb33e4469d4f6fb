"""The few-rows LM head of verify passes (`verify_head`): same product, used only while verifying, lossless."""

import copy
import pickle

import torch
from torch import nn

from conftest import make_drafter, make_target
from dspark_hf import verify_head
from dspark_hf.engine import Engine
from dspark_hf.verify_head import VerifyLinear, attach, verifying


def test_attach_only_takes_plain_float32_cpu_linears():
    head = nn.Linear(8, 50, bias=False)
    weight = head.weight
    assert attach(head) and isinstance(head, VerifyLinear)
    assert attach(head)  # idempotent
    assert head.weight is weight and list(head.state_dict()) == ["weight"]
    assert not attach(nn.Linear(8, 50).to(torch.bfloat16))  # bf16 linears have no slow few-row path
    assert not attach(nn.Embedding(50, 8))

    class Custom(nn.Linear):
        pass

    assert not attach(Custom(8, 50))  # a subclass may compute something else: left alone
    replaced = nn.Linear(8, 50)
    replaced.forward = lambda x: x  # someone else's forward (e.g. a hook library): left alone
    assert not attach(replaced)
    assert not attach(None)


def test_fast_product_only_while_verifying_and_for_few_rows(monkeypatch):
    calls = []
    original = verify_head.linear_few_rows
    monkeypatch.setattr(verify_head, "linear_few_rows", lambda *a: calls.append(a[0].shape) or original(*a))
    head = nn.Linear(8, 50, bias=False)
    attach(head)
    head(torch.randn(1, 4, 8))
    assert calls == []  # not verifying: nn.Linear's own forward
    with verifying(head):
        for rows in (1, 2, 8, 9):
            head(torch.randn(1, rows, 8))
        head(torch.randn(2, 3, 8))  # 6 rows over two sequences
    assert calls == [(1, 2, 8), (1, 8, 8), (2, 3, 8)]
    assert not head.verifying  # the block restores the flag
    monkeypatch.setattr(verify_head, "ENABLED", False)
    with verifying(head):
        head(torch.randn(1, 4, 8))
    assert len(calls) == 3


def test_attached_head_survives_copy_and_pickle():
    target = make_target()
    attach(target.get_output_embeddings())
    for clone in (copy.deepcopy(target), pickle.loads(pickle.dumps(target))):
        assert isinstance(clone.lm_head, VerifyLinear)
        torch.testing.assert_close(clone.lm_head.weight, target.lm_head.weight)


def test_tied_head_stays_tied():
    target = make_target(tie_word_embeddings=True)
    attach(target.get_output_embeddings())
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_generate_verifies_with_the_fast_head_and_stays_identical(monkeypatch):
    calls = []
    original = verify_head.linear_few_rows
    monkeypatch.setattr(verify_head, "linear_few_rows", lambda *a: calls.append(a[0].shape[1]) or original(*a))
    target = make_target()
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (1, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=25)
    assert calls == [] and type(target.lm_head) is nn.Linear  # plain generate() does not touch the head
    out = target.generate(ids, do_sample=False, max_new_tokens=25, assistant_model=drafter)
    assert torch.equal(out, plain)
    assert isinstance(target.lm_head, VerifyLinear) and not target.lm_head.verifying
    gamma = drafter.config.block_size
    assert calls and max(calls) == gamma + 1 and min(calls) >= 2  # verifies (the last may be cut by max_length)
    assert len(calls) <= drafter.generation_stats.num_target_forwards - 1  # never the prefill
    calls.clear()
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=25), plain)
    assert calls == []  # attached, but plain decoding never verifies


def test_engine_verifies_with_the_fast_head(monkeypatch):
    calls = []
    original = verify_head.linear_few_rows
    monkeypatch.setattr(verify_head, "linear_few_rows", lambda *a: calls.append(tuple(a[0].shape[:2])) or original(*a))
    target = make_target()
    prompt = torch.randint(0, 99, (5,)).tolist()
    plain = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, 5:].tolist()
    engine = Engine(target, make_drafter(target), verify_policy="fixed")
    request = engine.add_request(prompt, max_new_tokens=12)
    while engine.has_unfinished():
        engine.step()
    assert request.output_ids == plain
    assert calls and all(rows == 1 and 2 <= width <= 5 for rows, width in calls)


def test_drafter_still_multiplies_an_attached_head_itself():
    """An attached head is still a plain linear to the drafter: its draft vocabulary and few-rows product apply (the
    head's module forward would compute the whole vocabulary)."""
    target = make_target()
    drafter = make_drafter(target)
    drafter.set_draft_vocab(torch.arange(0, 99, 2))
    attach(target.get_output_embeddings())
    logits = drafter.draft_base_logits(torch.randn(1, 4, 32), target.get_output_embeddings())
    assert torch.isinf(logits[..., 1::2]).all() and torch.isfinite(logits[..., 0::2]).all()
