"""A draft vocabulary (`set_draft_vocab`): drafts come from a token subset, outputs stay exactly the target's."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import make_drafter
from dspark_hf import DSparkDraftModel
from dspark_hf.kernels.few_rows import kept_copies
from dspark_hf.serving.engine import Engine
from helpers import sample_block


HALF = list(range(0, 99, 2))  # the even token ids of the tiny 99-token target


def greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


def block_hidden(drafter, target):
    torch.manual_seed(5)
    return torch.randn(1, drafter.config.block_size, target.config.hidden_size)


@torch.no_grad()
def test_draft_logits_are_the_full_logits_on_the_draft_vocabulary(target):
    drafter = make_drafter(target)
    hidden, prev = block_hidden(drafter, target), torch.tensor([[3]])
    lm_head = target.get_output_embeddings()
    full_base = drafter.draft_base_logits(hidden, lm_head)
    full_bias, _ = drafter.draft_sequential_bias(prev, hidden[:, :1])
    drafter.set_draft_vocab(HALF)
    base = drafter.draft_base_logits(hidden, lm_head)
    bias, _ = drafter.draft_sequential_bias(prev, hidden[:, :1])
    torch.testing.assert_close(base[..., HALF], full_base[..., HALF])
    torch.testing.assert_close(bias[..., HALF], full_bias[..., HALF])
    odd = list(range(1, 99, 2))
    assert torch.isneginf(base[..., odd]).all() and (bias[..., odd] == 0).all()
    # the gathered LM-head rows are reused between calls, and rebuilt when the head's weight changes in place
    (cached,) = kept_copies(drafter, "rows")
    (cached_w2,) = kept_copies(drafter.markov_head, "rows")
    drafter.draft_base_logits(hidden, lm_head)
    drafter.draft_sequential_bias(prev, hidden[:, :1])
    assert kept_copies(drafter, "rows")[0] is cached
    assert kept_copies(drafter.markov_head, "rows")[0] is cached_w2
    lm_head.weight.mul_(2.0)
    torch.testing.assert_close(drafter.draft_base_logits(hidden, lm_head)[..., HALF], 2 * base[..., HALF])


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_with_a_bias_keeps_its_gathered_bias(target, dtype):
    drafter = make_drafter(target).to(dtype)
    hidden = block_hidden(drafter, target)
    head = torch.nn.Linear(target.config.hidden_size, 99, bias=True)  # float32, like the target's
    torch.nn.init.normal_(head.bias)
    full = drafter.draft_base_logits(hidden, head)
    drafter.set_draft_vocab(HALF)
    base = drafter.draft_base_logits(hidden, head)
    tolerance = {} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(base[..., HALF], full[..., HALF], **tolerance)
    kept = {tuple(t.shape) for t in kept_copies(drafter, "rows")}
    assert kept == {(len(HALF), target.config.hidden_size), (len(HALF),)}  # the rows and the bias, gathered once
    head.bias.add_(1.0)  # changed in place: the kept bias is rebuilt
    torch.testing.assert_close(drafter.draft_base_logits(hidden, head)[..., HALF], base[..., HALF] + 1, **tolerance)


def test_sampled_blocks_stay_in_the_draft_vocabulary(target):
    drafter = make_drafter(target, verify_policy="fixed")
    drafter.set_draft_vocab(HALF)
    hidden = block_hidden(drafter, target)
    for do_sample in (False, True):
        block = sample_block(drafter, target, hidden, torch.tensor([[1, 2, 3]]), do_sample=do_sample)
        assert len(block.tokens[0]) == drafter.config.block_size
        assert all(t % 2 == 0 for t in block.tokens[0].tolist())


@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_greedy_with_a_draft_vocabulary_matches_plain_greedy(target, policy):
    drafter = make_drafter(target, verify_policy=policy)
    drafter.set_draft_vocab(HALF)
    ids = torch.randint(0, 99, (1, 7))
    ref = greedy(target, ids, max_new_tokens=25)
    assert torch.equal(greedy(target, ids, max_new_tokens=25, assistant_model=drafter), ref)
    assert drafter.generation_stats.num_new_tokens == 25


class BanEven(LogitsProcessor):
    """Rules out every even token: the whole draft vocabulary of these tests."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, ::2] = float("-inf")
        return scores


@pytest.mark.parametrize("do_sample", [False, True])
def test_processors_that_rule_out_the_draft_vocabulary_fall_back_to_the_whole(target, do_sample):
    """No draft is drawn from an all -inf row (argmax of nothing, NaN probabilities): that position drafts over the
    whole vocabulary, and the output is still the target's."""
    drafter = make_drafter(target, verify_policy="fixed")
    drafter.set_draft_vocab(HALF)
    ids = torch.randint(0, 99, (1, 5))
    kwargs = dict(max_new_tokens=20, logits_processor=LogitsProcessorList([BanEven()]), do_sample=do_sample)
    torch.manual_seed(0)
    out = target.generate(ids, assistant_model=drafter, **kwargs)
    assert all(t % 2 == 1 for t in out[0, 5:].tolist())
    if not do_sample:
        assert torch.equal(out, target.generate(ids, **kwargs))


def test_engine_with_a_draft_vocabulary_matches_plain(target):
    drafter = make_drafter(target)
    drafter.set_draft_vocab(HALF)
    prompts = [torch.randint(0, 99, (n,)).tolist() for n in (3, 9, 14)]
    engine = Engine(target, drafter, verify_policy="fixed", max_batch_size=3)
    outputs = engine.generate(prompts, max_new_tokens=16)
    for prompt, out in zip(prompts, outputs):
        ref = greedy(target, torch.tensor([prompt]), max_new_tokens=16)[0, len(prompt) :].tolist()
        assert out == ref


def test_draft_vocabulary_is_saved_and_loaded(target, tmp_path):
    drafter = make_drafter(target)
    drafter.set_draft_vocab([40, 2, 7, 98])
    assert drafter.config.draft_vocab_size == 4 and drafter.draft_vocab_ids.tolist() == [2, 7, 40, 98]
    drafter.save_pretrained(tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        loaded = DSparkDraftModel.from_pretrained(tmp_path, dtype=dtype)
        assert loaded.draft_vocab_ids.dtype == torch.long and loaded.draft_vocab_ids.tolist() == [2, 7, 40, 98]
    loaded.set_draft_vocab(None)
    assert loaded.draft_vocab_ids is None and loaded.config.draft_vocab_size == 0
    loaded.save_pretrained(tmp_path / "full")
    assert DSparkDraftModel.from_pretrained(tmp_path / "full").draft_vocab_ids is None


@pytest.mark.parametrize(
    "bad, match",
    [([], "non-empty"), ([[1, 2]], "1-D"), ([1.5, 2.0], "token ids"), ([3, 3], "duplicates"), ([5, 99], r"\[0, 99\)")],
)
def test_bad_draft_vocabularies_are_refused(target, bad, match):
    with pytest.raises(ValueError, match=match):
        make_drafter(target).set_draft_vocab(bad)


def test_config_refuses_a_draft_vocabulary_larger_than_the_vocabulary(target):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        make_drafter(target, draft_vocab_size=100)


def drafts_close(a: list[list[float]], b: list[list[float]]) -> bool:
    return [len(x) for x in a] == [len(y) for y in b] and all(
        x == pytest.approx(y, rel=1e-5, abs=1e-7) for x, y in zip(a, b)
    )


@pytest.mark.parametrize("budget", [0, 8])
@pytest.mark.parametrize("do_sample", [False, True])
def test_greedy_chains_are_drafted_among_the_draft_vocabulary_alone(target, monkeypatch, do_sample, budget):
    """Greedy rows without processors draft over the draft vocabulary's V' columns, never spreading them over the
    whole vocabulary (`OPTIONS.narrow_draft`), and propose the very drafts the whole-vocabulary way proposes (a
    tree's estimates to rounding: its softmax sums V' columns, not V); sampling rows keep the whole vocabulary
    (their noise and processors see every column). Chains and trees alike."""
    from dspark_hf.decoding.drafting import DSparkCandidateGenerator
    from dspark_hf.kernels.options import OPTIONS

    drafter = make_drafter(target, verify_policy="fixed")
    drafter.set_draft_vocab(HALF)
    drafter.config.tree_budget = budget
    ids = torch.randint(0, 99, (1, 6))
    monkeypatch.setattr(OPTIONS, "verify_way", "linear")  # one kernel way: the features, so the drafts, repeat exactly
    proposed, spread = [], []
    propose, scatter = DSparkCandidateGenerator.propose, DSparkDraftModel._scatter

    def recorded(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        proposed[-1].append((drafts.tokens.clone(), drafts.conditional, drafts.parents))
        return drafts

    def counted(self, *args, **kwargs):
        spread[-1] += 1
        return scatter(self, *args, **kwargs)

    target.generate(ids, max_new_tokens=20, do_sample=do_sample, assistant_model=drafter)  # packs the weights
    monkeypatch.setattr(DSparkCandidateGenerator, "propose", recorded)
    monkeypatch.setattr(DSparkDraftModel, "_scatter", counted)
    outs = []
    for narrow in (True, False):
        monkeypatch.setattr(OPTIONS, "narrow_draft", narrow)
        proposed.append([])
        spread.append(0)
        torch.manual_seed(3)
        outs.append(target.generate(ids, max_new_tokens=20, do_sample=do_sample, assistant_model=drafter))
    assert torch.equal(outs[0], outs[1])
    assert len(proposed[0]) == len(proposed[1]) > 0
    for (tokens, conditional, parents), (ref_tokens, ref_conditional, ref_parents) in zip(*proposed):
        assert torch.equal(tokens, ref_tokens)
        if budget:
            assert torch.equal(parents, ref_parents) and drafts_close(conditional, ref_conditional)
        else:
            assert conditional == ref_conditional
    assert spread[1] > 0  # the whole-vocabulary way spreads every position's logits
    assert (spread[0] == 0) == (not do_sample)  # the narrow way only for greedy rows
    if not do_sample:
        assert torch.equal(outs[0], greedy(target, ids, max_new_tokens=20))
