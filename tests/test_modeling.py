"""The drafter's building blocks: shapes, KV injection with a cropped context cache, heads, block sampling, stats."""

import pytest
import torch
from transformers import DynamicCache

from conftest import make_drafter
from dspark_hf import DSparkGenerationStats
from dspark_hf.decoding.randomness import gumbel_choice, gumbel_noise
from dspark_hf.models.heads import DSparkGatedMarkovHead, DSparkMarkovHead, DSparkRNNHead, survival_probabilities
from helpers import sample_block


def features(target, ids):
    """Concatenated raw target features of the drafter's layers: (1, L, m·d)."""
    states = target(ids, output_hidden_states=True).hidden_states
    return torch.cat([states[i + 1] for i in (0, 2)], dim=-1)


@torch.no_grad()
def test_forward_shapes_and_finite(target, drafter):
    ids = torch.randint(0, 99, (1, 9))
    noise = drafter.block_input_embeds(ids[:, -1:], target.get_input_embeddings())
    assert noise.shape == (1, 4, 32)
    out = drafter(noise_embeds=noise, context_hidden_states=features(target, ids[:, :-1]))
    assert out.last_hidden_state.shape == (1, 4, 32) and torch.isfinite(out.last_hidden_state).all()


@torch.no_grad()
def test_mask_token_or_learned_mask_embedding(target):
    embed = target.get_input_embeddings()
    with_token = make_drafter(target, mask_token_id=7)
    assert with_token.mask_embedding is None
    noise = with_token.block_input_embeds(torch.tensor([[3, 5]]), embed)  # two blocks
    assert noise.shape == (1, 8, 32)
    assert torch.equal(noise[0, 1], embed.weight[7]) and torch.equal(noise[0, 4], embed.weight[5])
    learned = make_drafter(target, mask_token_id=None)
    assert learned.mask_embedding is not None
    assert torch.equal(learned.block_input_embeds(torch.tensor([[3]]), embed)[0, 2], learned.mask_embedding)


@torch.no_grad()
def test_incremental_context_cache_equals_one_shot(target, drafter):
    """Appending context round by round, cropping each block, gives what a fresh pass over all context gives."""
    ids = torch.randint(0, 99, (1, 12))
    feats = features(target, ids)
    embed = target.get_input_embeddings()
    anchor = ids[:, 11:12]
    noise = drafter.block_input_embeds(anchor, embed)

    def positions(start, n):
        return torch.arange(start, start + n + 4)[None]

    cache = DynamicCache()
    for start, stop in ((0, 5), (5, 6), (6, 11)):  # three rounds of newly committed positions
        out = drafter(
            noise_embeds=noise,
            context_hidden_states=feats[:, start:stop],
            position_ids=positions(start, stop - start),
            cache=cache,
        )
        cache.crop(-4)
        assert cache.get_seq_length() == stop
    fresh = drafter(noise_embeds=noise, context_hidden_states=feats[:, :11], position_ids=positions(0, 11))
    torch.testing.assert_close(out.last_hidden_state, fresh.last_hidden_state, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_block_attention_is_bidirectional(target, drafter):
    ids = torch.randint(0, 99, (1, 6))
    ctx = features(target, ids[:, :-1])
    noise = drafter.block_input_embeds(ids[:, -1:], target.get_input_embeddings())
    changed = noise.clone()
    changed[:, 3] += 1.0  # perturb the last slot
    a = drafter(noise_embeds=noise, context_hidden_states=ctx).last_hidden_state
    b = drafter(noise_embeds=changed, context_hidden_states=ctx).last_hidden_state
    assert not torch.allclose(a[:, 0], b[:, 0])  # the first slot sees the last one


def test_generator_taps_hidden_state_index_plus_one(target, drafter):
    """Context features given to the drafter are `hidden_states[i + 1]` of the prompt positions."""
    ids = torch.randint(0, 99, (1, 7))
    seen = []
    original = drafter.forward

    def spy(*args, **kwargs):
        seen.append(kwargs["context_hidden_states"].clone())
        return original(*args, **kwargs)

    drafter.forward = spy
    target.generate(ids, max_new_tokens=3, do_sample=False, assistant_model=drafter)
    with torch.no_grad():
        torch.testing.assert_close(seen[0], features(target, ids))


@pytest.mark.parametrize("head_cls", [DSparkMarkovHead, DSparkGatedMarkovHead, DSparkRNNHead])
def test_sequential_heads_parallel_equals_stepwise(head_cls):
    """Teacher-forced (all positions at once) and token-by-token (carried state) give the same bias."""
    torch.manual_seed(0)
    head = head_cls(vocab_size=11, hidden_size=6, rank=5)
    torch.nn.init.normal_(head.markov_w2.weight)
    prev, hidden = torch.randint(0, 11, (2, 4)), torch.randn(2, 4, 6)
    parallel, _ = head(prev, hidden)
    state, steps = None, []
    for k in range(4):
        bias, state = head(prev[:, k : k + 1], hidden[:, k : k + 1], state)
        steps.append(bias)
    assert parallel.shape == (2, 4, 11)
    torch.testing.assert_close(parallel, torch.cat(steps, dim=1))


def test_markov_bias_depends_only_on_previous_token():
    head = DSparkMarkovHead(vocab_size=11, hidden_size=6, rank=5)
    torch.nn.init.normal_(head.markov_w2.weight)
    prev = torch.tensor([[3, 3]])
    bias, _ = head(prev, torch.randn(1, 2, 6))
    torch.testing.assert_close(bias[0, 0], bias[0, 1])
    torch.testing.assert_close(bias[0, 0], head.markov_w2(head.markov_w1.weight[3]))


def test_untrained_markov_head_starts_at_zero_bias(target):
    drafter = make_drafter(target, randomize_heads=False)
    assert torch.count_nonzero(drafter.markov_head.markov_w2.weight) == 0


def test_survival_probabilities_apply_sts_temperatures():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    temps = torch.tensor([2.0, 1.0, 0.5])
    expected = torch.cumprod(torch.sigmoid(logits / temps), dim=-1)
    torch.testing.assert_close(survival_probabilities(logits, temps), expected)


class _StopAfter:
    """A policy that can stop sampling early and verifies `limit` drafts, settled once it has seen position
    `limit + 1`'s confidence."""

    stops_early = True

    def __init__(self, limit):
        self.limit = limit

    def settled_width(self, conditional, caps):
        return self.limit if len(conditional[0]) > self.limit else None


@torch.no_grad()
@pytest.mark.parametrize("do_sample", [False, True])
def test_block_sampling_returns_processed_biased_logits(target, drafter, do_sample):
    ids = torch.randint(0, 99, (1, 6))
    hidden = torch.randn(1, 4, 32)
    lm_head = target.get_output_embeddings()
    draft = sample_block(drafter, target, hidden, ids, processors=lambda seq, x: x / 0.5, do_sample=do_sample)
    assert draft.tokens.shape == (1, 4)
    prev = torch.cat([ids[:, -1:], draft.tokens[:, :-1]], dim=1)
    bias, _ = drafter.sequential_bias(prev, hidden)
    expected = (drafter.base_logits(hidden, lm_head) + bias) / 0.5
    if do_sample:  # the distributions the drafts were drawn from, with the row's noise at their positions
        torch.testing.assert_close(draft.logits, expected)
        noise = gumbel_noise(0, range(6, 10), expected.shape[-1], "cpu")  # sample_block's seed, positions 6..9
        assert torch.equal(draft.tokens[0], gumbel_choice(expected[0], noise))
    else:  # greedy drafts are the argmax of the processed, biased logits
        assert torch.equal(draft.tokens, expected.argmax(-1))
    # confidence is computed before each token: its input is the previous token's Markov embedding
    conf = torch.sigmoid(drafter.confidence_logits(hidden, prev) / drafter.sts_temperatures)
    torch.testing.assert_close(torch.tensor(draft.conditional), conf)


@torch.no_grad()
def test_block_sampling_stops_where_the_policy_is_settled(target, drafter):
    hidden, ids = torch.randn(1, 4, 32), torch.randint(0, 99, (1, 3))
    draft = sample_block(drafter, target, hidden, ids, policy=_StopAfter(2))
    # position 3's confidence was examined, its token never sampled (nor position 4's)
    assert len(draft.conditional[0]) == 3 and draft.tokens[0, 2:].tolist() == [0, 0]


@torch.no_grad()
def test_block_sampling_computes_base_logits_as_far_as_it_goes(target, drafter, monkeypatch):
    """Under a policy that can stop early the LM head runs on the first two positions, and on the rest only if
    sampling gets there; the drafts are those of one whole-block product."""
    hidden, ids = torch.randn(1, 4, 32), torch.randint(0, 99, (1, 3))
    whole = sample_block(drafter, target, hidden, ids)  # "fixed": one product for the block
    rows, original = [], drafter.draft_base_logits
    monkeypatch.setattr(drafter, "draft_base_logits", lambda h, head: rows.append(h.shape[1]) or original(h, head))
    for limit, products in ((1, [2]), (2, [2]), (3, [2, 2]), (4, [2, 2])):
        rows.clear()
        draft = sample_block(drafter, target, hidden, ids, policy=_StopAfter(limit))
        assert rows == products and torch.equal(draft.tokens[:, :limit], whole.tokens[:, :limit])


def test_stats_per_position_and_tau():
    stats = DSparkGenerationStats(block_size=3, num_prompt_tokens=5)
    stats.record_step(3, 3)  # all accepted
    stats.record_step(3, 1)  # position 2 rejected
    stats.record_step(2, 0)  # position 1 rejected
    stats.record_step(3, 1, stopped=True)  # EOS after position 1: the rest says nothing
    assert stats.num_target_forwards == 4
    assert stats.acceptance_length == pytest.approx((3 + 1 + 0 + 1 + 4) / 4)
    reached, accepted = stats.position_counts()
    assert reached == [4, 2, 1] and accepted == [3, 1, 1]
    assert stats.per_position_acceptance == [0.75, 0.5, 1.0]
    with pytest.raises(ValueError):
        stats.record_step(2, 3)


def test_token_origins_follow_each_steps_source_and_clipping():
    stats = DSparkGenerationStats(block_size=3, num_new_tokens=10)
    stats.record_step(3, 2)  # two drafts, then the bonus
    stats.record_step(3, 3, source="lookup")  # a lookup chain, all accepted, then the bonus
    stats.record_step(0, 0)  # a plain round
    stats.record_step(3, 3, stopped=True, committed=1)  # the row stopped after one draft
    assert stats.token_origins() == [
        ("target", 0), ("drafter", 1), ("drafter", 2), ("target", 0),
        ("lookup", 1), ("lookup", 2), ("lookup", 3), ("target", 0), ("target", 0), ("drafter", 1),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="source"):
        stats.record_step(1, 1, source="oracle")


@pytest.mark.parametrize("shape", [(1, 7, 32), (3, 32), (2, 9, 32), (1, 0, 32), (40, 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_few_rows_equals_linear(shape, with_bias):
    from dspark_hf.kernels.few_rows import linear_few_rows

    x, weight = torch.randn(*shape), torch.randn(50, 32)
    bias = torch.randn(50) if with_bias else None
    out = linear_few_rows(x, weight, bias)
    assert out.shape == (*shape[:-1], 50) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))


def test_base_logits_equal_the_lm_head_and_respect_its_hooks(target, drafter):
    lm_head = target.get_output_embeddings()
    hidden = torch.randn(1, drafter.config.block_size, target.config.hidden_size)
    torch.testing.assert_close(drafter.base_logits(hidden, lm_head), lm_head(hidden))
    calls = []
    handle = lm_head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    try:  # a hooked head (accelerate offloading, quantisation wrappers) is called as a module, hooks and all
        drafter.base_logits(hidden, lm_head)
    finally:
        handle.remove()
    assert calls == [(1, drafter.config.block_size, target.config.vocab_size)]
