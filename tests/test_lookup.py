"""Context lookup (`drafter.config.context_lookup`): the suffix index, the learned confidence, and lossless decoding
with lookup drafts taking rounds from the drafter."""

import pytest
import torch
from huggingface_hub.errors import StrictDataclassFieldValidationError

from conftest import make_drafter, make_target
from dspark_hf import DSparkConfig, Engine
from dspark_hf.decoding.lookup import LookupConfidence, SuffixIndex, expected_depth


# -- the index and the confidence as pure functions ----------------------------------------------------------------


def test_the_longest_suffix_match_continues_from_its_latest_earlier_occurrence():
    index = SuffixIndex(min_n=2)
    seq = [5, 1, 2, 9, 9, 1, 2, 7, 3, 1, 2]
    # [1, 2] occurred at 1-2 and 5-6; the latest is followed by 7, 3, 1, 2 (the suffix itself is not a match)
    assert index.continuation(seq, 3) == ([7, 3, 1], 2)
    seq += [7]  # suffix [1, 2, 7] matches 5-7 (3 tokens), which beats any 2-token match
    assert index.continuation(seq, 4) == ([3, 1, 2, 7], 3)
    seq += [3, 1, 2, 7, 3]  # a loop: the longest match is 8 tokens, its continuation runs into the suffix itself
    assert index.continuation(seq, 2) == ([1, 2], 8)


def test_no_draft_without_an_earlier_occurrence_of_min_n_tokens():
    index = SuffixIndex(min_n=3)
    assert index.continuation([1, 2, 3, 4, 1, 2], 4) == ([], 0)  # only a 2-token match
    assert index.continuation([1, 2, 3, 4, 1, 2, 3], 4) == ([4, 1, 2, 3], 3)
    assert index.continuation([1, 2, 3], 4) == ([], 0)
    assert SuffixIndex(min_n=1).continuation([4, 4], 0) == ([], 0)


def test_the_index_grows_with_the_sequence_as_a_fresh_one_finds():
    torch.manual_seed(0)
    seq = torch.randint(0, 6, (300,)).tolist()
    grown = SuffixIndex(min_n=2)
    for end in range(1, len(seq) + 1, 7):
        assert grown.continuation(seq[:end], 5) == SuffixIndex(min_n=2).continuation(seq[:end], 5)


def test_confidence_learns_from_verified_rounds():
    confidence = LookupConfidence()
    before = confidence.conditional(3, 3)
    assert before[1] == before[2] == LookupConfidence.NEXT
    for _ in range(50):
        confidence.update(3, verified=3, accepted=0)  # the first draft always rejected: c_1 falls, c_k untouched
    after = confidence.conditional(3, 3)
    assert after[0] < 0.1 and after[1] == before[1]
    assert confidence.conditional(8, 1)[0] == pytest.approx(LookupConfidence.FIRST[8])  # other lengths keep theirs
    for _ in range(50):
        confidence.update(4, verified=4, accepted=4)
    assert confidence.conditional(4, 2)[1] > 0.95
    assert expected_depth([0.5, 0.5, 0.5], 2) == pytest.approx(0.75)


@pytest.mark.parametrize("value", [-1, 9, True, 2.0])
def test_bad_context_lookup_is_refused(target, value):
    with pytest.raises((ValueError, StrictDataclassFieldValidationError), match="context_lookup"):
        DSparkConfig.for_target(target.config, num_hidden_layers=1, block_size=4, target_layer_ids=[0],
                                context_lookup=value)  # fmt: skip


# -- decoding ------------------------------------------------------------------------------------------------------


def _repetitive_prompts(vocab: int = 99) -> torch.Tensor:
    """Two rows whose prompts repeat a phrase, so a suffix of the sequence recurs from the first round on."""
    torch.manual_seed(3)
    phrases = torch.randint(0, vocab, (2, 6))
    return torch.cat([phrases, torch.randint(0, vocab, (2, 3)), phrases, phrases[:, :3]], dim=1)


def _run(target, drafter, ids, lookup, **kwargs):
    drafter.config.context_lookup = lookup
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, assistant_model=drafter, **kwargs
    )
    return out, drafter.generation_stats


@pytest.mark.parametrize("budget", [0, 6])  # 6: the lookup's continuation grafted into a draft tree
@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduler"])
def test_lookup_drafts_keep_greedy_output_identical_row_by_row(policy, budget):
    target = make_target(num_layers=2)
    drafter = make_drafter(
        target, num_hidden_layers=1, target_layer_ids=[0], verify_policy=policy
    )  # random: its own drafts are nearly always rejected
    drafter.config.tree_budget = budget
    ids = _repetitive_prompts()
    for row in range(2):
        one = ids[row : row + 1]
        plain = target.generate(one, attention_mask=torch.ones_like(one), max_new_tokens=40, do_sample=False)
        looked, stats = _run(target, drafter, one, 3, do_sample=False)
        assert looked.tolist() == plain.tolist()
        assert stats.lookup_rounds > 0
        without, control = _run(target, drafter, one, 0, do_sample=False)
        assert without.tolist() == plain.tolist() and control.lookup_rounds == 0
        if policy == "fixed":  # every draft verified: the lookup's copies are what lifts τ over the random drafter
            assert stats.acceptance_length > control.acceptance_length
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    batched, stats = _run(target, drafter, ids, 3, do_sample=False)
    assert batched.tolist() == plain.tolist() and stats.lookup_rounds > 0


@pytest.mark.parametrize("budget", [0, 6])
@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_lookup_drafts_keep_seeded_sampling_identical(policy, budget):
    # a random tiny target is nearly uniform: a low temperature lets it fall into the loops lookup drafts copy
    target = make_target(num_layers=2)
    drafter = make_drafter(target, num_hidden_layers=1, target_layer_ids=[0])
    prompts = _repetitive_prompts().tolist()
    drafter.config.context_lookup = 3
    drafter.config.tree_budget = budget
    engine = Engine(target, drafter, verify_policy=policy)  # threshold: the drafter may stop sampling early
    sampled = [engine.generate([p], max_new_tokens=40, do_sample=True, temperature=0.02, seed=7)[0] for p in prompts]
    assert engine.stats["lookup_rounds"] > 0
    plain = [Engine(target).generate([p], max_new_tokens=40, do_sample=True, temperature=0.02, seed=7)[0]
             for p in prompts]  # fmt: skip
    assert sampled == plain
    batch = engine.generate(prompts, max_new_tokens=40, do_sample=True, temperature=0.02, seed=7)
    assert batch == plain


def test_gated_rounds_still_verify_lookup_drafts(monkeypatch):
    """A draft pass priced at 1 s shuts the gate; rounds without a draft pass may still verify a recurring suffix's
    continuation (Algorithm 1 prices it on the SPS profile, with no draft cost), and the output is plain greedy's."""
    from dspark_hf.decoding import policy
    from dspark_hf.decoding.drafting import DSparkCandidateGenerator
    from dspark_hf.decoding.gate import DraftGate

    monkeypatch.setattr(policy, "DraftGate", lambda sps, _seconds=None, **_: DraftGate(sps, draft_seconds=1.0))
    passes = []
    propose = DSparkCandidateGenerator.propose

    def counted(self, *args, **kwargs):
        passes.append(1)
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(DSparkCandidateGenerator, "propose", counted)
    target = make_target(num_layers=2)
    ids = _repetitive_prompts()[:1]
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    for lookup in (3, 0):
        drafter = make_drafter(target, num_hidden_layers=1, target_layer_ids=[0], verify_policy="scheduler")
        drafter.sps_profile = {b: 100.0 for b in range(1, 10)}  # width is free: any likely draft is worth verifying
        passes.clear()
        out, stats = _run(target, drafter, ids, lookup, do_sample=False)
        assert out.tolist() == plain.tolist()
        assert stats.gated_rounds >= 10 and len(passes) <= 2 + stats.num_target_forwards // 8  # first pass + probes
        verifying = sum(1 for v in stats.verify_lengths if v > 0)
        if lookup:  # more rounds verified drafts than drafted: the gated ones verified lookup drafts
            assert stats.lookup_rounds > len(passes) and verifying > len(passes)
        else:  # negative control: without lookup only the drafted rounds verify drafts
            assert stats.lookup_rounds == 0 and verifying <= len(passes)


def test_a_lookup_chain_longer_than_the_drafters_widens_the_round():
    """The drafter stopped sampling after one position (a confidence policy on the CPU); the row's suffix recurs with
    four tokens after it: the round's chains widen to hold them, the caps follow the lookup's length."""
    from dspark_hf.decoding.core import SpeculativeDecoder
    from dspark_hf.decoding.rows import Drafts
    from helpers import _Row

    target = make_target(num_layers=2)
    decoder = SpeculativeDecoder(target, make_drafter(target, num_hidden_layers=1, target_layer_ids=[0]))
    decoder.rows = [_Row([7, 8, 9, 1, 2, 3, 4, 5, 7, 8, 9]), _Row([1, 2, 3])]  # row 1: nothing recurs
    vocab = target.config.vocab_size
    drafts = Drafts(torch.tensor([[6], [6]]), torch.zeros(2, 1, vocab), [1, 1], [[0.1], [0.1]])
    drafts, caps = decoder.lookup.merge(decoder.rows, drafts, [5, 5], min_n=3)
    assert drafts.tokens.tolist() == [[1, 2, 3, 4, 5], [6, 0, 0, 0, 0]] and drafts.logits.shape == (2, 5, vocab)
    assert caps == [5, 5] and drafts.lookup == {0: 3} and drafts.conditional[1] == [0.1]
    assert drafts.conditional[0] == decoder.lookup.confidence.conditional(3, 5)
    drafts = Drafts(torch.tensor([[6], [6]]), None, [1, 1], [[0.1], [0.1]])
    _, caps = decoder.lookup.merge(decoder.rows, drafts, [2, 0], min_n=3)
    assert caps == [2, 0]  # a cap bounds the lookup too; a row without room is left alone


def test_a_chain_grafted_into_a_tree_shares_its_nodes_and_keeps_join_order():
    from dspark_hf.decoding.trees import Tree, graft

    tree = Tree()
    a = tree.add(5, -1, 0.6, None)  # anchor -> 5 (0.6) -> 7 (0.3); anchor -> 8 (0.2)
    tree.add(8, -1, 0.2, None)
    tree.add(7, a, 0.3, None)
    grafted, path = graft(tree, [5, 9, 4], [0.9, 0.5, 0.1], budget=16)
    assert [grafted.path(node) for node in path] == [[5], [5, 9], [5, 9, 4]]  # 5 shared, 9 and 4 new
    assert grafted.scores == sorted(grafted.scores, reverse=True) == [0.9, 0.5, 0.3, 0.2, 0.1]  # 5 raised to 0.9
    assert all(p < i for i, p in enumerate(grafted.parents))  # every parent joins before its children
    assert sorted(map(tuple, (grafted.path(i) for i in range(5)))) == [(5,), (5, 7), (5, 9), (5, 9, 4), (8,)]
    capped, path = graft(tree, [8, 1], [0.1, 0.9], budget=16)  # a child is never above its parent
    assert [capped.scores[node] for node in path] == [0.2, 0.2]
    small, path = graft(tree, [5, 9, 4], [0.9, 0.5, 0.1], budget=3)  # the best three: a prefix of the join order
    assert [small.path(i) for i in range(3)] == [[5], [5, 9], [5, 7]]
    assert [small.path(node) for node in path] == [[5], [5, 9]]
