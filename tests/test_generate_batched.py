"""generate() with a drafter at batch > 1: every row is its own plain greedy decoding, and the round is one core."""

import pytest
import torch
from transformers import SynthIDTextWatermarkingConfig, pipeline
from transformers.generation.streamers import BaseStreamer

from conftest import make_drafter, make_target
from dspark_hf import speculative_generate
from dspark_hf.decoding.core import SpeculativeDecoder
from dspark_hf.decoding.policy import VerifyPolicy
from dspark_hf.decoding.rows import Row
from helpers import char_tokenizer, pin_drafter


PAD = 0


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def plain_rows(target, prompts, **kwargs) -> list[list[int]]:
    """Each prompt decoded alone with plain greedy generate(): its new tokens."""
    return [target.generate(torch.tensor([p]), do_sample=False, **kwargs)[0, len(p) :].tolist() for p in prompts]


def new_tokens(out: torch.Tensor, width: int) -> list[list[int]]:
    return out[:, width:].tolist()


PROMPTS = [[5, 17, 3], [40, 2, 9, 11, 7, 33, 8], [61], [12, 90, 4, 4, 71]]


@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_rows_of_different_lengths_match_their_own_greedy(target, policy):
    drafter = make_drafter(target, verify_policy=policy)
    ids, mask = left_padded(PROMPTS)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=19, assistant_model=drafter)
    assert new_tokens(out, ids.shape[1]) == plain_rows(target, PROMPTS, max_new_tokens=19)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=19, pad_token_id=PAD)
    assert torch.equal(out, plain)  # and the batch is plain batched generate()'s, padding included
    assert drafter.generation_stats.num_new_tokens == 4 * 19


def test_oracle_rows_verify_their_own_drafts(target):
    ids, mask = left_padded(PROMPTS)
    refs = [p + r for p, r in zip(PROMPTS, plain_rows(target, PROMPTS, max_new_tokens=21))]
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), refs, diverge_at=None)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=21, assistant_model=drafter)
    assert new_tokens(out, ids.shape[1]) == [r[len(p) :] for p, r in zip(PROMPTS, refs)]
    stats = drafter.generation_stats
    assert stats.per_position_acceptance == [1.0] * drafter.config.block_size
    assert stats.num_target_forwards == 4 * 4  # (21 - 1) new tokens per row, γ + 1 = 5 a round, 4 rows


def test_diverging_drafter_in_a_batch(target):
    ids, mask = left_padded(PROMPTS)
    refs = [p + r for p, r in zip(PROMPTS, plain_rows(target, PROMPTS, max_new_tokens=17))]
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), refs, diverge_at=2)
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=17, assistant_model=drafter)
    assert new_tokens(out, ids.shape[1]) == [r[len(p) :] for p, r in zip(PROMPTS, refs)]
    assert drafter.generation_stats.per_position_acceptance[:3] == [1.0, 1.0, 0.0]


def test_a_row_that_hits_eos_first_is_padded_and_stops_costing():
    target = make_target()
    ids, mask = left_padded(PROMPTS)
    long = plain_rows(target, PROMPTS, max_new_tokens=20)
    eos = long[1][4]  # row 1's 5th new token becomes EOS: it finishes early, the others run on (or stop too)
    target.generation_config.eos_token_id = eos
    target.generation_config.pad_token_id = PAD
    drafter = make_drafter(target, verify_policy="fixed")
    out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, assistant_model=drafter)
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20)
    assert torch.equal(out, plain)
    row = out[1, ids.shape[1] :].tolist()
    assert row[: row.index(eos) + 1] == long[1][: long[1].index(eos) + 1] and set(row[row.index(eos) + 1 :]) <= {PAD}
    rounds = drafter.generation_stats.num_target_forwards
    assert rounds < 4 * drafter.generation_stats.num_new_tokens  # a finished row takes no more verify rounds


@pytest.mark.parametrize("with_eos", [True, False])
def test_rows_stopping_on_different_stop_strings(with_eos):
    target = make_target()
    tok = char_tokenizer(99)
    ids, mask = left_padded(PROMPTS)
    long = plain_rows(target, PROMPTS, max_new_tokens=24)
    stops = [tok.decode(long[0][6:8]), tok.decode(long[2][10:12])]  # rows 0 and 2 stop early, on different strings
    if with_eos:
        target.generation_config.eos_token_id = 98  # with an EOS criterion a stopped row is padded, else it runs on
        target.generation_config.pad_token_id = PAD
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=24, stop_strings=stops, tokenizer=tok)
    plain = target.generate(ids, **kw)
    out = target.generate(ids, assistant_model=make_drafter(target, verify_policy="fixed"), **kw)
    assert torch.equal(out, plain)


class _Recorder(BaseStreamer):
    """Every put() as (shape, values), and whether end() came."""

    def __init__(self):
        self.calls, self.ended = [], False

    def put(self, value):
        self.calls.append((tuple(value.shape), value.tolist()))

    def end(self):
        self.ended = True


@pytest.mark.parametrize("pad_id", [PAD, None], ids=["pad", "no pad: first EOS"])
def test_a_batch_streamer_gets_what_plain_generate_sends(pad_id):
    """Batch 3, rows finishing at different rounds and committing chunks of different lengths: the same put() calls
    as plain batched generate(): the prompt (B, L), then one (B,) tensor per position, padding for finished rows."""
    target = make_target()
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    ids, mask = left_padded(prompts)
    long = plain_rows(target, prompts, max_new_tokens=20)
    eos = target.generation_config.eos_token_id = [long[1][3], long[2][7]]  # rows 1 and 2 end early, differently
    target.generation_config.pad_token_id = pad_id
    refs = [p + r for p, r in zip(prompts, long)]
    wrong = refs[0][:9] + [(refs[0][9] + 1) % 99] + refs[0][10:]  # row 0's drafts fail once mid-block
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), [wrong, *refs])
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=20)
    plain, assisted = _Recorder(), _Recorder()
    target.generate(ids, streamer=plain, **kw)
    target.generate(ids, streamer=assisted, assistant_model=drafter, **kw)
    assert assisted.calls == plain.calls and assisted.ended
    assert plain.calls[0] == (tuple(ids.shape), ids.tolist()) and len(plain.calls) == 1 + 20  # row 0 runs on
    pad = eos[0] if pad_id is None else pad_id
    for r, end in ((1, 3), (2, 7)):  # row 1 is padded after its 4th token, row 2 after its 8th
        column = [values[r] for _, values in plain.calls[1:]]
        assert column[: end + 1] == long[r][: end + 1] and set(column[end + 1 :]) == {pad}


def test_a_streamer_at_batch_1_gets_each_rounds_tokens():
    """Batch 1: the prompt (1, L), then each round's tokens as one (n,) tensor (plain sends (1,) per token); the
    concatenation is plain's."""
    target = make_target()
    ids = torch.tensor([PROMPTS[1]])
    ref = plain_rows(target, PROMPTS[1:2], max_new_tokens=17)[0]
    drafter = pin_drafter(make_drafter(target, verify_policy="fixed"), [PROMPTS[1] + ref])
    plain, assisted = _Recorder(), _Recorder()
    target.generate(ids, do_sample=False, max_new_tokens=17, streamer=plain)
    target.generate(ids, do_sample=False, max_new_tokens=17, streamer=assisted, assistant_model=drafter)
    assert plain.calls[0] == assisted.calls[0] == ((1, len(PROMPTS[1])), ids.tolist())
    assert plain.calls[1:] == [((1,), [token]) for token in ref]
    assert [len(values) for _, values in assisted.calls[1:]] == [1, 5, 5, 5, 1]  # prefill, then γ + 1 a round
    assert sum((values for _, values in assisted.calls[1:]), []) == ref and assisted.ended


def test_explicit_custom_generate_form(target, drafter):
    ids, mask = left_padded(PROMPTS[:2])
    out = target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=12, custom_generate=speculative_generate,
        drafter=drafter,
    )  # fmt: skip
    assert new_tokens(out, ids.shape[1]) == plain_rows(target, PROMPTS[:2], max_new_tokens=12)
    assert drafter.generation_stats.num_target_forwards > 0


def test_pipeline_with_batch_size(target, drafter):
    tok = char_tokenizer(99)
    tok.pad_token, tok.padding_side = tok.convert_ids_to_tokens(PAD), "left"
    pipe = pipeline("text-generation", model=target, tokenizer=tok)
    texts = ["Hello DSpark", "abc", "a longer prompt here"]
    ref = [pipe(t, max_new_tokens=10, do_sample=False) for t in texts]
    out = pipe(texts, max_new_tokens=10, do_sample=False, batch_size=3, assistant_model=drafter)
    assert out == ref


# processors built with one entry per batch row (padding lengths, prompts, a batch index): each row gets its own.
# Rows 0 and 1 hold a token plain decoding repeats (83, 14), which row 2 generates too without having it.
ROW_PROMPTS = [[5, 17, 3, 83], [40, 2, 9, 14, 11, 7, 33, 8], [61], [12, 90, 4, 4, 71]]
ROW_PROCESSORS = {
    "repetition_penalty": dict(repetition_penalty=2.0),
    "encoder_repetition_penalty": dict(encoder_repetition_penalty=3.0),
    "encoder_no_repeat_ngram_size": dict(encoder_no_repeat_ngram_size=1),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=lambda row, ids: list(range(10 * row, 10 * row + 40))),
    "penalty, n-grams and sequence bias": dict(
        repetition_penalty=1.5, no_repeat_ngram_size=2, sequence_bias={(5,): 4.0, (17, 3): -5.0}
    ),
}


@pytest.mark.parametrize("option", sorted(ROW_PROCESSORS))
def test_processors_with_per_row_state_on_a_left_padded_batch(target, option):
    """Each row is processed as plain batched generate() processes it (padding included), row by row identical."""
    ids, mask = left_padded(ROW_PROMPTS)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=PAD, **ROW_PROCESSORS[option])
    plain = target.generate(ids, **kw)
    assert not torch.equal(plain, target.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=PAD))
    out = target.generate(ids, assistant_model=make_drafter(target, verify_policy="fixed"), **kw)
    assert torch.equal(out, plain)


@pytest.mark.parametrize(
    "option",
    [
        dict(guidance_scale=1.5),
        dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[1, 2, 3], ngram_len=3)),
    ],
    ids=["guidance_scale", "synthid"],
)
def test_processors_that_need_the_whole_batch_or_call_history_are_refused(target, drafter, option):
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match=f"`{next(iter(option))}"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter, **option)


def test_wrong_target_is_named_before_transformers_checks(drafter):
    other = make_target(vocab_size=120)
    with pytest.raises(ValueError, match="made for"):
        other.generate(torch.randint(0, 99, (1, 4)), max_new_tokens=3, assistant_model=drafter)


# -- host syncs -----------------------------------------------------------------------------------------------------


class _Greedy(Row):
    def __init__(self, prompt, budget):
        super().__init__(prompt)
        self.budget = budget

    @property
    def remaining(self):
        return self.budget - (len(self.seq) - self.stats.num_prompt_tokens)

    def commit(self, tokens, scores=None, logits=None, hidden_states=None):
        taken = tokens[: self.remaining]
        self.finished = len(taken) == self.remaining
        return len(taken)


def syncs_per_round(monkeypatch, block_size: int, batch: int) -> list[int]:
    """Host syncs (.item, .tolist, .cpu, bool/int/float of a tensor) in each of a decoder's rounds."""
    target = make_target()
    drafter = make_drafter(target, block_size=block_size, verify_policy="threshold", confidence_threshold=0.0)
    decoder = SpeculativeDecoder(
        target, drafter, policy=VerifyPolicy.for_drafter(drafter, target), stop_sampling_early=False
    )
    decoder.prefill([_Greedy(torch.randint(0, 99, (5 + i,)).tolist(), 200) for i in range(batch)])
    count = [0]
    for name in ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    per_round = []
    for _ in range(4):
        count[0] = 0
        decoder.step()
        per_round.append(count[0])
    monkeypatch.undo()
    return per_round


def test_host_syncs_per_round_do_not_grow_with_block_or_batch(monkeypatch):
    counts = {(g, b): syncs_per_round(monkeypatch, g, b) for g in (4, 8) for b in (1, 3)}
    assert len({tuple(c) for c in counts.values()}) == 1, counts  # the same, whatever the block and batch size
    assert max(counts[4, 1]) <= 12, counts


@pytest.mark.parametrize("ids", [torch.zeros(1, 0, dtype=torch.long), torch.tensor([[]])], ids=["long", "float"])
def test_an_empty_prompt_is_a_clear_error(target, drafter, ids):
    with pytest.raises(ValueError, match=r"at least one token; `input_ids` has shape \(1, 0\)"):
        target.generate(ids, max_new_tokens=3, assistant_model=drafter)
