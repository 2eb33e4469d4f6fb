"""Greedy DSpark-assisted generate() is token-identical to plain greedy generate(): the heart of losslessness."""

import math

import pytest
import torch
from transformers import DynamicCache, pipeline
from transformers.generation.streamers import BaseStreamer

from conftest import make_drafter, make_target
from dspark_hf import speculative_generate
from helpers import char_tokenizer, pin_drafter


def greedy(target, ids, **kwargs):
    return target.generate(ids, do_sample=False, **kwargs)


@pytest.mark.parametrize("prompt_len", [1, 5, 17])
@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_random_drafter_matches_greedy(target, prompt_len, policy):
    drafter = make_drafter(target, verify_policy=policy)
    ids = torch.randint(0, 99, (1, prompt_len))
    ref = greedy(target, ids, max_new_tokens=23)  # 23: not a multiple of γ + 1
    out = greedy(target, ids, max_new_tokens=23, assistant_model=drafter)
    assert torch.equal(ref, out)
    stats = drafter.generation_stats
    assert stats.num_new_tokens == 23
    assert sum(stats.accepted_lengths) + stats.num_target_forwards + 1 == 23  # + 1: the prefill token


@pytest.mark.parametrize("head", ["markov", "gated_markov", "rnn", "none"])
def test_every_sequential_head_matches_greedy(target, head):
    extra = {"confidence_with_markov": False} if head == "none" else {}
    drafter = make_drafter(target, sequential_head=head, **extra)
    ids = torch.randint(0, 99, (1, 6))
    assert torch.equal(
        greedy(target, ids, max_new_tokens=15), greedy(target, ids, max_new_tokens=15, assistant_model=drafter)
    )


def test_oracle_drafter_accepts_everything(target):
    ids = torch.randint(0, 99, (1, 5))
    ref = greedy(target, ids, max_new_tokens=30)
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), ref)
    out = greedy(target, ids, max_new_tokens=30, assistant_model=drafter)
    assert torch.equal(ref, out)
    stats = drafter.generation_stats
    gamma = drafter.config.block_size
    # prefill gives 1 token; each verify pass commits γ drafts + 1 bonus
    assert stats.num_target_forwards == math.ceil((30 - 1) / (gamma + 1))
    assert stats.per_position_acceptance == [1.0] * gamma
    assert stats.acceptance_length > gamma


@pytest.mark.parametrize("diverge_at", [0, 1, 2, 3])
def test_drafter_diverging_at_each_position(target, diverge_at):
    ids = torch.randint(0, 99, (1, 4))
    ref = greedy(target, ids, max_new_tokens=21)
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), ref, diverge_at=diverge_at)
    out = greedy(target, ids, max_new_tokens=21, assistant_model=drafter)
    assert torch.equal(ref, out)
    stats = drafter.generation_stats
    for verified, accepted, stopped in zip(stats.verify_lengths, stats.accepted_lengths, stats.stopped):
        assert accepted == min(diverge_at, verified) or stopped
    rates = stats.per_position_acceptance
    assert rates[diverge_at] == 0.0
    assert all(r == 1.0 for r in rates[:diverge_at])
    # how each token was committed: the prefill's, then per round `diverge_at` drafts at depths 1.. and the bonus
    origins = stats.token_origins()
    assert len(origins) == 21 == stats.num_new_tokens
    round_ = [("drafter", k) for k in range(1, diverge_at + 1)] + [("target", 0)]
    full = 21 - len(round_)  # the last round may verify fewer drafts (the length limit caps them)
    assert origins[:full] == ([("target", 0)] + round_ * 21)[:full]
    assert all(kind == "target" or (kind == "drafter" and 1 <= k <= diverge_at) for kind, k in origins[full:])


def test_zero_drafts_when_confidence_is_never_enough(target):
    drafter = make_drafter(target, verify_policy="threshold", confidence_threshold=1.0)
    ids = torch.randint(0, 99, (1, 5))
    assert torch.equal(
        greedy(target, ids, max_new_tokens=9), greedy(target, ids, max_new_tokens=9, assistant_model=drafter)
    )
    assert set(drafter.generation_stats.verify_lengths) == {0}


def test_eos_inside_an_accepted_block():
    target = make_target()
    ids = torch.randint(0, 99, (1, 5))
    ref_long = greedy(target, ids, max_new_tokens=20)
    eos = int(ref_long[0, 5 + 6])  # the 7th generated token becomes EOS
    first = (ref_long[0, 5:] == eos).nonzero()[0].item()
    target.generation_config.eos_token_id = eos
    ref = greedy(target, ids, max_new_tokens=20)
    assert ref.shape[1] == 5 + first + 1  # plain greedy stops at the EOS
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), ref_long)
    out = greedy(target, ids, max_new_tokens=20, assistant_model=drafter)
    assert torch.equal(ref, out)


@pytest.mark.parametrize("max_length", [6, 7, 12, 13])
def test_max_length_boundary(target, max_length):
    ids = torch.randint(0, 99, (1, 5))
    ref = greedy(target, ids, max_length=max_length)
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), greedy(target, ids, max_length=40))
    out = greedy(target, ids, max_length=max_length, assistant_model=drafter)
    assert torch.equal(ref, out) and out.shape[1] == max_length


def test_stop_strings(target):
    tok = char_tokenizer(99)
    ids = torch.randint(0, 99, (1, 5))
    ref_long = greedy(target, ids, max_new_tokens=20)
    stop = tok.decode(ref_long[0, 5 + 8 : 5 + 10])
    ref = greedy(target, ids, max_new_tokens=20, stop_strings=[stop], tokenizer=tok)
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), ref_long)
    out = greedy(target, ids, max_new_tokens=20, stop_strings=[stop], tokenizer=tok, assistant_model=drafter)
    assert torch.equal(ref, out)
    assert ref.shape[1] < ref_long.shape[1]


class _Collect(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens += value.flatten().tolist()

    def end(self):
        self.ended = True


def test_streamer_receives_the_same_tokens(target, drafter):
    ids = torch.randint(0, 99, (1, 5))
    plain, assisted = _Collect(), _Collect()
    greedy(target, ids, max_new_tokens=17, streamer=plain)
    greedy(target, ids, max_new_tokens=17, streamer=assisted, assistant_model=drafter)
    assert plain.tokens == assisted.tokens and assisted.ended


def test_pipeline_with_assistant_model(target, drafter):
    tok = char_tokenizer(99)
    pipe = pipeline("text-generation", model=target, tokenizer=tok)
    text = "Hello DSpark"
    ref = pipe(text, max_new_tokens=12, do_sample=False)
    out = pipe(text, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert ref == out
    assert drafter.generation_stats.num_new_tokens == 12


@pytest.mark.parametrize("rows", [1, 3])
def test_return_dict_with_scores_and_logits(target, drafter, rows):
    ids = torch.randint(0, 99, (rows, 5))
    kw = dict(max_new_tokens=10, return_dict_in_generate=True, output_scores=True, output_logits=True,
              repetition_penalty=1.2)  # fmt: skip
    ref = greedy(target, ids, **kw)
    out = greedy(target, ids, assistant_model=drafter, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits) == len(ref.logits) == 10
    for a, b in zip(ref.scores, out.scores):
        assert a.shape == b.shape == (rows, 99)
        assert torch.allclose(a, b, atol=1e-4)  # the processed logits each token was chosen from
    for a, b in zip(ref.logits, out.logits):
        assert torch.allclose(a, b, atol=1e-4)  # the raw ones (the penalty makes them differ from the scores)
    assert not torch.allclose(out.scores[-1], out.logits[-1])
    only_logits = greedy(target, ids, assistant_model=drafter, **{**kw, "output_scores": False})
    assert only_logits.scores is None and len(only_logits.logits) == 10


@pytest.mark.parametrize("rows", [1, 3])
def test_return_dict_with_hidden_states(target, drafter, rows):
    """Per new token, per layer, the hidden states of the forward that chose it, as plain generate() returns them:
    the prompt's for the first token (left padding: zeros here, whatever plain decoding computed there), then one
    position each."""
    ids = torch.randint(0, 99, (rows, 6))
    mask = torch.ones_like(ids)
    mask[1:, :2] = 0  # left padding in the other rows
    kw = dict(attention_mask=mask, max_new_tokens=9, return_dict_in_generate=True, output_hidden_states=True)
    ref = greedy(target, ids, **kw)
    out = greedy(target, ids, assistant_model=drafter, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    assert len(out.hidden_states) == len(ref.hidden_states) == 9
    for step, (a, b) in enumerate(zip(ref.hidden_states, out.hidden_states)):
        assert len(a) == len(b) == target.config.num_hidden_layers + 1
        for layer_a, layer_b in zip(a, b):
            assert layer_a.shape == layer_b.shape == (rows, 6 if step == 0 else 1, 32)
            real = mask.bool() if step == 0 else torch.ones(rows, 1, dtype=torch.bool)
            assert torch.allclose(layer_a[real], layer_b[real], atol=1e-4)
    assert out.hidden_states[0][0][1:, :2].abs().sum() == 0  # padding positions


@pytest.mark.parametrize("return_dict", [True, False])
def test_attentions_are_refused_by_name(target, drafter, return_dict):
    """Refused, naming the option, why, and what to do instead, both ways in."""
    ids = torch.randint(0, 99, (1, 5))
    for way in (dict(assistant_model=drafter), dict(custom_generate=speculative_generate, drafter=drafter)):
        with pytest.raises(ValueError) as err:
            greedy(target, ids, max_new_tokens=4, return_dict_in_generate=return_dict, output_attentions=True, **way)
        message = str(err.value)
        assert "`output_attentions`" in message and "Drop it" in message and "without the drafter" in message
        assert "cache with holes" in message and "\n" not in message


def test_qwen3_target_with_qk_norm():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target = make_target(config_cls=Qwen3Config, model_cls=Qwen3ForCausalLM)
    drafter = make_drafter(target, mask_token_id=None)
    assert drafter.config.use_qk_norm and hasattr(drafter.layers[0].self_attn, "q_norm")
    ids = torch.randint(0, 99, (1, 6))
    assert torch.equal(
        greedy(target, ids, max_new_tokens=14), greedy(target, ids, max_new_tokens=14, assistant_model=drafter)
    )


def test_repetition_penalty_processor_is_applied_to_drafts(target, drafter):
    ids = torch.randint(0, 99, (1, 5))
    kw = dict(max_new_tokens=16, repetition_penalty=1.3)
    assert torch.equal(greedy(target, ids, **kw), greedy(target, ids, assistant_model=drafter, **kw))


def test_a_filled_cache_is_refused(target, drafter):
    ids = torch.randint(0, 99, (1, 5))
    cache = DynamicCache()
    target(ids, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="filled `cache`"):
        greedy(target, torch.randint(0, 99, (1, 7)), max_new_tokens=5, assistant_model=drafter, cache=cache)


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_continuing_a_conversation_cache_is_refused_with_the_way_that_works(target, drafter, name):
    """A chat continues the previous turn's cache (`past_key_values=out.past_key_values`): refused, naming it and
    the cached length, and saying to pass the whole conversation as `input_ids`, which gives plain's tokens."""
    first = greedy(target, torch.randint(0, 99, (1, 5)), max_new_tokens=4, return_dict_in_generate=True)
    conversation = torch.cat([first.sequences, torch.randint(0, 99, (1, 3))], dim=1)  # + the next user turn
    cached = first.past_key_values.get_seq_length()
    for way in (dict(assistant_model=drafter), dict(custom_generate=speculative_generate, drafter=drafter)):
        with pytest.raises(ValueError) as err:
            greedy(target, conversation, max_new_tokens=6, **{name: first.past_key_values}, **way)
        message = str(err.value)
        assert "`past_key_values`" in message and "`cache`" in message and f"{cached} tokens" in message
        assert "whole conversation" in message and "`input_ids`" in message and "\n" not in message
    plain = greedy(target, conversation, max_new_tokens=6, **{name: first.past_key_values})
    assert torch.equal(plain, greedy(target, conversation, max_new_tokens=6, assistant_model=drafter))


def test_left_padded_prompt(target, drafter):
    """Padded prompt positions are hidden from the drafter (and the target): output equals plain greedy."""
    ids = torch.randint(1, 99, (1, 8))
    mask = torch.ones_like(ids)
    mask[:, :3] = 0
    ref = greedy(target, ids, attention_mask=mask, max_new_tokens=12)
    out = greedy(target, ids, attention_mask=mask, max_new_tokens=12, assistant_model=drafter)
    assert torch.equal(ref, out)
