"""The batched `Engine`: each request's output is its own plain output, whatever else shares the batch."""

import itertools
import threading
import weakref

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from conftest import make_drafter, make_target
from dspark_hf import Engine
from dspark_hf.decoding.acceptance import accept_greedy
from dspark_hf.decoding.ragged_cache import RaggedCache


POLICIES = ["plain", "fixed", "threshold", "scheduler"]
FLAT_SPS = {b: 100.0 for b in range(1, 200)}  # verification is free: Algorithm 1 admits every draft it can
STEEP_SPS = {b: 100.0 / b for b in range(1, 200)}  # compute-bound: only confident drafts pay
LOADED_SPS = {b: 100.0 / (1 + b / 40) for b in range(1, 300)}  # in between: Algorithm 1 cuts some rows short


_PLAIN = weakref.WeakKeyDictionary()  # target -> {prompt: longest plain output computed so far (no EOS)}


def plain_output(target, prompt, max_new_tokens, eos_token_id=None) -> list[int]:
    """The oracle: `target.generate` on the prompt alone (without EOS, a shorter budget is a prefix of a longer)."""
    known = _PLAIN.setdefault(target, {}).get(tuple(prompt), []) if eos_token_id is None else []
    if len(known) >= max_new_tokens:
        return known[:max_new_tokens]
    ids = torch.tensor([prompt])
    out = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    out = out[0, len(prompt) :].tolist()
    if eos_token_id is None:
        _PLAIN[target][tuple(prompt)] = out
    return out


def make_engine(target, policy, drafter=None, sps=FLAT_SPS, **kwargs) -> Engine:
    """An engine for `policy`; under "scheduler" the draft gate is off unless asked for (its decisions follow the
    measured draft time, which would make which rounds draft depend on the machine)."""
    if policy == "plain":
        return Engine(target, **kwargs)
    drafter = drafter if drafter is not None else make_drafter(target)
    if policy == "scheduler":
        kwargs = {"gate_drafts": False, **kwargs}
    return Engine(target, drafter, verify_policy=policy, sps=sps if policy == "scheduler" else None, **kwargs)


def pin_engine_drafter(engine: Engine, references: dict[tuple, list[int]], diverge_at=None) -> Engine:
    """Make the engine's drafter propose each request's reference continuation (`references[prompt]`: prompt +
    plain output). One-hot ±1e4 base logits dominate the random Markov bias, so the real heads still run. With
    `diverge_at=k` (or {prompt: k}) the draft at block slot k is wrong, so at most k drafts survive a round."""
    drafter = engine.drafter
    vocab = drafter.config.vocab_size
    drafter.config.context_lookup = 0  # every chain the pinned drafter's (tests/test_lookup.py tests the lookup's)
    seen = {"round": None, "slot": 0}  # the engine may ask for a block's base logits in pieces, in order

    def base_logits(hidden_states, lm_head, *args):
        bsz, k = hidden_states.shape[:2]
        if seen["round"] != engine.stats["rounds"]:
            seen.update(round=engine.stats["rounds"], slot=0)
        first, seen["slot"] = seen["slot"], seen["slot"] + k
        logits = torch.full((bsz, k, vocab), -1e4)
        for i, row in enumerate(engine.rows):  # the engine's rows are the batch rows, in order
            prompt = tuple(row.request.prompt_ids)
            ref, start = references[prompt], len(row.seq) + first
            pinned = [ref[start + j] if start + j < len(ref) else 0 for j in range(k)]
            wrong = diverge_at.get(prompt) if isinstance(diverge_at, dict) else diverge_at
            if wrong is not None and 0 <= wrong - first < k:
                pinned[wrong - first] = (pinned[wrong - first] + 1) % vocab
            logits[i, torch.arange(k), torch.tensor(pinned)] = 1e4
        return logits

    drafter.base_logits = base_logits
    return engine


def references_for(target, prompts, max_new_tokens=45) -> dict[tuple, list[int]]:
    return {tuple(p): p + plain_output(target, p, max_new_tokens) for p in prompts}


def random_prompts(lengths, vocab=99) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,)).tolist() for n in lengths]


# -- greedy: token-identical to plain decoding -------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_queued_batch_matches_plain_greedy(target, policy):
    """7 prompts of different lengths and budgets through a batch of 3: queueing, joining and finishing mid-flight."""
    prompts = random_prompts([1, 5, 17, 9, 3, 12, 2])
    budgets = [23, 9, 30, 1, 14, 5, 18]
    engine = make_engine(target, policy, max_batch_size=3)
    requests = [engine.add_request(p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    while engine.has_unfinished():
        engine.step()
        assert len(engine.rows) <= 3
    for request, prompt, n in zip(requests, prompts, budgets):
        assert request.output_ids == plain_output(target, prompt, n)
        assert request.finish_reason == "length"
    assert engine.decoder.target_cache.batch_size == 0 and not engine.stats["active"]


@pytest.mark.parametrize("policy", ["plain", "fixed", "scheduler"])
def test_requests_added_between_steps(target, policy):
    prompts = random_prompts([4, 11, 2, 7, 6])
    engine = make_engine(target, policy, max_batch_size=4)
    requests = [engine.add_request(prompts[0], max_new_tokens=20), engine.add_request(prompts[1], max_new_tokens=7)]
    for prompt in prompts[2:]:
        for _ in range(2):
            engine.step()
        requests.append(engine.add_request(prompt, max_new_tokens=15))
    while engine.has_unfinished():
        engine.step()
    for request, prompt in zip(requests, prompts):
        assert request.output_ids == plain_output(target, prompt, len(request.output_ids))
    assert [len(r.output_ids) for r in requests] == [20, 7, 15, 15, 15]


@pytest.mark.parametrize(
    "policy, diverge_at",
    [("fixed", None), ("fixed", 0), ("fixed", 2), ("threshold", None), ("threshold", 1), ("scheduler", None),
     ("scheduler", 2)],
)  # fmt: skip
def test_oracle_and_diverging_drafters(target, policy, diverge_at):
    prompts = random_prompts([3, 8, 5, 13])
    engine = make_engine(target, policy, drafter=make_drafter(target, confidence_threshold=0.0))
    pin_engine_drafter(engine, references_for(target, prompts), diverge_at)
    outputs = engine.generate(prompts, max_new_tokens=26)
    assert outputs == [plain_output(target, p, 26) for p in prompts]
    stats, gamma = engine.stats, engine.block_size
    if diverge_at is None:  # every verified draft is accepted
        assert stats["accepted_drafts"] == stats["verified_drafts"] > 0
        assert stats["per_position_acceptance"] == [1.0] * gamma
    else:
        assert stats["per_position_acceptance"][diverge_at] == 0.0
        assert all(rate == 1.0 for rate in stats["per_position_acceptance"][:diverge_at])


def test_eos_inside_a_block_ends_only_that_request(target):
    prompts = random_prompts([5, 6, 4])
    refs = references_for(target, prompts)
    long = plain_output(target, prompts[0], 30)
    eos = long[6]  # the 7th generated token of request 0 becomes its EOS
    engine = pin_engine_drafter(make_engine(target, "fixed"), refs)
    first = engine.add_request(prompts[0], max_new_tokens=30, eos_token_id=eos)
    others = [engine.add_request(p, max_new_tokens=30) for p in prompts[1:]]
    while engine.has_unfinished():
        engine.step()
    assert first.output_ids == plain_output(target, prompts[0], 30, eos_token_id=eos)
    assert first.output_ids[-1] == eos and len(first.output_ids) == long.index(eos) + 1
    assert first.finish_reason == "stop"
    for request, prompt in zip(others, prompts[1:]):
        assert request.output_ids == plain_output(target, prompt, 30) and request.finish_reason == "length"


def test_eos_as_first_token(target):
    prompt = random_prompts([5])[0]
    eos = plain_output(target, prompt, 1)[0]
    engine = make_engine(target, "fixed")
    request = engine.add_request(prompt, max_new_tokens=10, eos_token_id=[eos, 98])
    finished = engine.step()
    assert finished == [request] and request.output_ids == [eos] and request.finish_reason == "stop"


@pytest.mark.parametrize("compact_fraction", [0.01, 1.0])
def test_compaction_keeps_outputs(target, compact_fraction):
    """Compacting every round or never: the same tokens (holes are invisible either way)."""
    prompts = random_prompts([2, 9, 5])
    engine = make_engine(target, "fixed", compact_fraction=compact_fraction)
    outputs = engine.generate(prompts, max_new_tokens=25)
    assert outputs == [plain_output(target, p, 25) for p in prompts]
    assert (engine.stats["compactions"] > 0) == (compact_fraction < 1.0)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_other_target_families(family):
    """Qwen3 (QK-norm) and Gemma3 (scaled embeddings, soft-capping, alternating 5-token sliding windows)."""
    if family == "qwen3":
        target = make_target(config_cls=Qwen3Config, model_cls=Qwen3ForCausalLM)
    else:
        layer_types = ["sliding_attention", "full_attention"] * 2
        target = make_target(
            config_cls=Gemma3TextConfig, model_cls=Gemma3ForCausalLM, sliding_window=5, layer_types=layer_types
        )
    prompts = random_prompts([6, 2, 10])
    for policy in ("plain", "threshold", "scheduler"):
        drafter = make_drafter(target, mask_token_id=None)
        outputs = make_engine(target, policy, drafter=drafter, max_batch_size=2).generate(prompts, max_new_tokens=14)
        assert outputs == [plain_output(target, p, 14) for p in prompts], policy


def test_sliding_window_target():
    """Mistral with a 6-token window: the target cache is kept right-aligned, so the window counts no holes."""
    target = make_target(config_cls=MistralConfig, model_cls=MistralForCausalLM, sliding_window=6)
    prompts = random_prompts([9, 3, 14])
    engine = make_engine(target, "fixed")
    refs = references_for(target, prompts)
    pin_engine_drafter(engine, refs, diverge_at={tuple(p): k for p, k in zip(prompts, (1, 3, None))})
    outputs = engine.generate(prompts, max_new_tokens=20)
    assert outputs == [plain_output(target, p, 20) for p in prompts]
    assert engine.stats["compactions"] > 0


# -- cost -------------------------------------------------------------------------------------------------------


def test_oracle_drafter_saves_target_forwards(target):
    prompts = random_prompts([3, 8, 5, 13])
    plain = make_engine(target, "plain")
    assert plain.generate(prompts, max_new_tokens=30) == [plain_output(target, p, 30) for p in prompts]
    engine = pin_engine_drafter(make_engine(target, "fixed"), references_for(target, prompts))
    assert engine.generate(prompts, max_new_tokens=30) == [plain_output(target, p, 30) for p in prompts]
    gamma = engine.block_size
    # one batched prefill gives every first token; then plain: 29 rounds, oracle: ceil(29 / (γ + 1)) rounds
    assert plain.stats["target_forwards"] == 1 + 29
    assert engine.stats["target_forwards"] == 1 + -(-29 // (gamma + 1))
    assert engine.stats["acceptance_length"] > gamma


def test_num_assistant_tokens_is_a_shorter_fixed_gamma(target):
    """`num_assistant_tokens=2` verifies 2 drafts of each block: still the plain output, with an oracle drafter
    1 + ceil(29 / 3) target forwards, and no draft ever examined past position 2."""
    prompts = random_prompts([3, 8, 5, 13])
    engine = make_engine(target, "fixed", num_assistant_tokens=2)
    pin_engine_drafter(engine, references_for(target, prompts))
    assert engine.generate(prompts, max_new_tokens=30) == [plain_output(target, p, 30) for p in prompts]
    stats = engine.stats
    assert stats["target_forwards"] == 1 + -(-29 // 3) and stats["num_assistant_tokens"] == 2
    assert stats["per_position_acceptance"][:2] == [1.0, 1.0]
    assert stats["per_position_acceptance"][2:] == [None] * (engine.block_size - 2)


def test_steep_sps_profile_verifies_less(target):
    """Algorithm 1 across the batch: a compute-bound profile cuts verify lengths, a flat one verifies everything."""
    prompts = random_prompts([3, 8, 5, 13])
    lengths = {}
    for name, sps in (("flat", FLAT_SPS), ("steep", STEEP_SPS)):
        engine = make_engine(target, "scheduler", drafter=make_drafter(target), sps=sps)
        assert engine.generate(prompts, max_new_tokens=12) == [plain_output(target, p, 12) for p in prompts]
        lengths[name] = engine.stats["mean_verify_length"]
    assert lengths["steep"] < lengths["flat"]


@pytest.mark.parametrize("policy", ["threshold", "scheduler"])
def test_shorter_rows_fill_the_verify_width_with_their_own_drafts(target, policy):
    """The verify is (B, W) wide for W = max ℓ_r + 1 anyway: a row whose policy cut it shorter verifies its further
    drafts up to W, as far as it sampled them (its confidences) and its cap allow; "fixed" is left as it is."""
    drafter = make_drafter(target, confidence_threshold=0.5)
    engine = make_engine(target, policy, drafter=drafter, sps={b: 10.0 if b <= 5 else 1.0 for b in range(1, 14)})
    # cumulative survivals: row 0 stays high for 3 positions, row 1 falls at once, row 2 sampled only 2 positions
    confidences = [[0.99, 0.99, 0.99, 0.1], [0.1, 0.9, 0.9, 0.9], [0.3, 0.9]]
    cut = {"threshold": [3, 0, 0], "scheduler": [2, 0, 0]}[policy]  # Algorithm 1: 5 tokens (3 anchors + 2) pay
    assert engine.decoder.policy.lengths(confidences, [4, 4, 2]) == [cut[0], min(cut[0], 4), min(cut[0], 2)]
    fixed = make_engine(target, "fixed", drafter=drafter)
    assert fixed.decoder.policy.lengths([[], []], [4, 1]) == [4, 1]


def test_scheduler_stops_sampling_once_the_lengths_are_settled(target):
    """Under a compute-bound profile Algorithm 1 verifies little, and the engine stops sampling a block there
    (before its last position) instead of running the sequential head to the end; outputs stay the plain ones."""
    prompts = random_prompts([3, 8, 5, 13])
    engine = make_engine(target, "scheduler", sps=STEEP_SPS)
    policy = engine.decoder.policy
    early, settled = [], policy.settled
    policy.settled = lambda conditional, caps: early.append(settled(conditional, caps)) or early[-1]
    assert engine.generate(prompts, max_new_tokens=12) == [plain_output(target, p, 12) for p in prompts]
    assert any(early)  # it is only asked before a block's last position


@pytest.mark.parametrize("draft_seconds", [None, 1.0, 0.0])
def test_draft_gate_keeps_outputs_and_skips_drafts_that_cannot_pay(target, draft_seconds):
    """The gate turns rounds into plain steps when a draft costs more than it can save (1 s against 10 ms
    verifies: only the first round and the probes draft), not while drafts are free, and whatever it decides,
    and however the measured cost falls, every output is the plain one."""
    prompts = random_prompts([3, 8, 5, 13])
    engine = make_engine(target, "scheduler", gate_drafts=True, draft_seconds=draft_seconds)
    decoder = engine.decoder
    pays, decisions = decoder._drafting_pays, []
    decoder._drafting_pays = lambda: decisions.append((pays(), max(decoder._caps()))) or decisions[-1][0]
    assert engine.generate(prompts, max_new_tokens=30) == [plain_output(target, p, 30) for p in prompts]
    rounds, gated = engine.stats["rounds"], engine.stats["gated_rounds"]
    if draft_seconds == 0.0:  # skipped only where no row has room for a draft (each has one token left)
        assert all(drafted or room == 0 for drafted, room in decisions)
    if draft_seconds == 1.0:
        probe = engine.gate.probe_interval
        assert gated >= rounds * probe // (probe + 1) - 1 and rounds - gated >= 2


def test_draft_gate_leaves_the_context_for_the_next_draft(target):
    """Rounds the gate skips still commit target features; the next draft pass appends all of them, so the drafter
    cache always holds every committed position before the anchor when it drafts."""
    prompts = random_prompts([3, 8, 5, 13])
    costs = itertools.cycle([0.0, 1.0, 1.0])  # free, dear, dear: the gate opens every third round
    engine = make_engine(target, "scheduler", gate_drafts=True, draft_seconds=lambda rows: next(costs))
    decoder = engine.decoder
    draft, checked = decoder._draft, []

    def checked_draft():
        drafts = draft()
        assert decoder.candidates.cache.lengths().tolist() == [row.anchor_position for row in engine.rows]
        checked.append(len(engine.rows))
        return drafts

    decoder._draft = checked_draft
    assert engine.generate(prompts, max_new_tokens=30) == [plain_output(target, p, 30) for p in prompts]
    assert engine.stats["gated_rounds"] > 0 and len(checked) > 2


# -- streaming, background loop, abort ----------------------------------------------------------------------------


def test_stream_chunks_concatenate_to_output(target):
    prompts = random_prompts([4, 7, 2])
    engine = make_engine(target, "fixed")
    engine.start()
    try:
        requests = [engine.add_request(p, max_new_tokens=17) for p in prompts]
        streamed = {}

        def consume(request):
            streamed[request.request_id] = [list(chunk) for chunk in request.stream(timeout=30)]

        threads = [threading.Thread(target=consume, args=(r,)) for r in requests]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        engine.stop()
    for request, prompt in zip(requests, prompts):
        chunks = streamed[request.request_id]
        assert sum(chunks, []) == request.output_ids == plain_output(target, prompt, 17)
        assert len(chunks) == request.num_rounds + 1  # the prefill's token, then one chunk per round
    assert not engine.is_running


def test_a_request_added_after_stop_is_served_by_wait_and_stream(target):
    """stop() leaves a restartable engine: a request added afterwards is served by wait() / stream() in the caller's
    thread (they never block on a round nobody runs), and by the loop once it starts again."""
    prompts = random_prompts([4, 7, 2])
    engine = make_engine(target, "fixed")
    engine.start()
    assert engine.add_request(prompts[0], max_new_tokens=9).wait(timeout=60) == plain_output(target, prompts[0], 9)
    engine.stop()
    late = engine.add_request(prompts[1], max_new_tokens=11)
    assert late.wait(timeout=60) == plain_output(target, prompts[1], 11) and not engine.is_running
    streamed = engine.add_request(prompts[2], max_new_tokens=13)
    assert sum(streamed.stream(timeout=60), []) == plain_output(target, prompts[2], 13)
    engine.start()  # and the loop serves requests again
    try:
        assert engine.add_request(prompts[0], max_new_tokens=5).wait(timeout=60) == plain_output(target, prompts[0], 5)
    finally:
        engine.stop()


def test_wait_on_an_engine_never_started_runs_its_rounds(target):
    engine = make_engine(target, "threshold", max_batch_size=2)
    prompts = random_prompts([3, 6, 5])
    requests = [engine.add_request(p, max_new_tokens=8) for p in prompts]
    assert [r.wait(timeout=60) for r in requests] == [plain_output(target, p, 8) for p in prompts]
    assert not engine.has_unfinished()


def test_empty_prompts_are_refused(target):
    engine = make_engine(target, "fixed")
    for empty in ([], torch.zeros(0, dtype=torch.long), torch.zeros(1, 0, dtype=torch.long), torch.tensor([[]])):
        with pytest.raises(ValueError, match="empty"):
            engine.add_request(empty)


def test_abort_running_and_queued_requests(target):
    prompts = random_prompts([4, 7, 2])
    engine = make_engine(target, "fixed", max_batch_size=2)
    running, other, queued = (engine.add_request(p, max_new_tokens=40) for p in prompts)
    engine.step()
    engine.step()
    engine.abort(running.request_id)
    engine.abort(queued.request_id)
    assert queued.finished and queued.finish_reason == "abort" and queued.output_ids == []
    engine.step()
    assert running.finish_reason == "abort" and 0 < len(running.output_ids) < 40
    assert running.output_ids == plain_output(target, prompts[0], len(running.output_ids))
    engine.abort(running.request_id)  # already finished: a no-op
    while engine.has_unfinished():
        engine.step()
    assert other.output_ids == plain_output(target, prompts[1], 40)


def test_concurrent_adds_while_the_loop_runs(target):
    prompts = random_prompts([3, 5, 8, 2, 6, 4, 7, 9])
    engine = make_engine(target, "threshold", max_batch_size=3)
    engine.start()
    requests = [None] * len(prompts)

    def add(i):
        requests[i] = engine.add_request(prompts[i], max_new_tokens=6 + i)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(len(prompts))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        outputs = [request.wait(timeout=60) for request in requests]
    finally:
        engine.stop()
    assert outputs == [plain_output(target, p, 6 + i) for i, p in enumerate(prompts)]
    assert len({r.request_id for r in requests}) == len(prompts) and not engine.has_unfinished()


def test_failed_step_ends_every_request(target, monkeypatch):
    engine = make_engine(target, "fixed", max_batch_size=1)
    running, queued = engine.add_request([1, 2, 3]), engine.add_request([4, 5])
    monkeypatch.setattr(engine.decoder, "_verify", lambda drafts: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert running.finish_reason == queued.finish_reason == "error" and not engine.has_unfinished()
    with pytest.raises(RuntimeError, match="engine failed"):
        running.wait(timeout=1)
    monkeypatch.undo()
    assert engine.generate([[1, 2, 3]], max_new_tokens=4) == [plain_output(target, [1, 2, 3], 4)]  # usable again


# -- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, kwargs, error, match",
    [
        ([], {}, ValueError, "empty"),
        ([1, 2], {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ([1, 2], {"do_sample": True, "temperature": 0.0}, ValueError, "temperature"),
        ([1, 2], {"top_p": 0.0}, ValueError, "top_p"),
        ([1, 2], {"top_k": -1}, ValueError, "top_k"),
        ([1, 500], {}, ValueError, "vocabulary"),
        (torch.ones(2, 3, dtype=torch.long), {}, ValueError, "1-D"),
        ("hello", {}, TypeError, "tokenizer"),
        ([1.5, 2], {}, TypeError, "list of ints"),
    ],
)
def test_bad_requests_raise(target, prompt, kwargs, error, match):
    engine = Engine(target)
    with pytest.raises(error, match=match):
        engine.add_request(prompt, **kwargs)
    assert not engine.has_unfinished()


def test_bad_engine_arguments(target, drafter):
    with pytest.raises(ValueError, match="max_batch_size"):
        Engine(target, drafter, max_batch_size=0)
    with pytest.raises(ValueError, match="verify_policy"):
        Engine(target, drafter, verify_policy="sometimes")
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target, verify_policy="fixed")
    with pytest.raises(TypeError, match="DSpark or EAGLE-3 drafter"):
        Engine(target, make_target())
    for bad in (0, drafter.config.block_size + 1, 2.0, True):
        with pytest.raises(ValueError, match="num_assistant_tokens"):
            Engine(target, drafter, num_assistant_tokens=bad)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(target, num_assistant_tokens=2)
    with pytest.raises(ValueError, match="gate_drafts=True needs verify_policy='scheduler'"):
        Engine(target, drafter, verify_policy="threshold", gate_drafts=True)
    with pytest.raises(TypeError, match="gate_drafts"):
        Engine(target, drafter, verify_policy="scheduler", sps=FLAT_SPS, gate_drafts="yes")
    for bad in (-1.0, "fast", True):
        with pytest.raises(ValueError, match="draft_seconds"):
            Engine(target, drafter, verify_policy="scheduler", sps=FLAT_SPS, draft_seconds=bad)
    with pytest.raises(ValueError, match="draft_seconds` prices the draft gate"):
        Engine(target, drafter, verify_policy="scheduler", sps=FLAT_SPS, gate_drafts=False, draft_seconds=0.1)
    other_target = make_target(num_layers=3)
    with pytest.raises(ValueError):
        Engine(other_target, drafter)  # the drafter was made for another target (config.check_target)


def test_duplicate_request_id(target):
    engine = Engine(target)
    engine.add_request([1, 2], request_id="a")
    with pytest.raises(ValueError, match="unique"):
        engine.add_request([3], request_id="a")


# -- acceptance rules -------------------------------------------------------------------------------------------


def test_accept_greedy_ragged():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    target = torch.tensor([[5, 6, 9, 4], [5, 0, 7, 4], [1, 2, 3, 8]])
    accepted, bonus = accept_greedy(drafts, target, torch.tensor([3, 3, 2]))
    assert accepted.tolist() == [2, 1, 2] and bonus.tolist() == [9, 0, 3]


# -- sampling: exactly the target's distribution per request -----------------------------------------------------


def sample_groups(policy, n_per_group, sps=FLAT_SPS, max_batch_size=32, **engine_kwargs):
    """Requests with two sampling settings interleaved in one engine; returns the first 3 tokens of each, per
    setting, and the exact target distributions under those settings."""
    from test_sampling import PROMPT, exact_joint, setup_models, warpers

    target, drafter = setup_models()
    settings = [dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.9)]
    probs = [exact_joint(target, warpers(**s)) for s in settings]
    engine = make_engine(target, policy, drafter=drafter, sps=sps, max_batch_size=max_batch_size, **engine_kwargs)
    requests = [[], []]
    for seeds in range(10**5, 10**5 + 2 * n_per_group, 2):
        for group, setting in enumerate(settings):
            kwargs = {"top_k": 0, "top_p": 1.0, **setting}
            request = engine.add_request(PROMPT[0], max_new_tokens=5, do_sample=True, seed=seeds + group, **kwargs)
            requests[group].append(request)
    while engine.has_unfinished():
        engine.step()
    samples = [[tuple(r.output_ids[:3]) for r in group] for group in requests]
    return samples, probs, engine


@pytest.mark.parametrize("policy", ["threshold"])
def test_sampling_matches_target_distribution(policy):
    from test_sampling import chi_square_rejects

    samples, probs, engine = sample_groups(policy, 1500)
    for group_samples, group_probs in zip(samples, probs):
        rejects, stat, critical = chi_square_rejects(group_samples, group_probs)
        assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}: engine sampling differs from the target's"
    assert engine.stats["verified_drafts"] > 0 and engine.stats["accepted_drafts"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy, sps",
    [("plain", None), ("fixed", None), ("threshold", None), ("scheduler", FLAT_SPS), ("scheduler", "load"),
     ("scheduler", "gated")],
)  # fmt: skip
def test_sampling_matches_target_distribution_many_samples(policy, sps):
    """Also with the draft gate turning about half the rounds into plain steps (a draft costing 5 ms per row)."""
    from test_sampling import chi_square_rejects

    gated = {"gate_drafts": True, "draft_seconds": lambda rows: 0.005 * rows} if sps == "gated" else {}
    sps = LOADED_SPS if sps in ("load", "gated") else sps
    samples, probs, engine = sample_groups(policy, 6000, sps=sps, **gated)
    if gated:
        assert 0 < engine.stats["gated_rounds"] < engine.stats["rounds"]
    if policy != "plain":
        assert 0 < engine.stats["mean_verify_length"] < engine.block_size
    for group_samples, group_probs in zip(samples, probs):
        rejects, stat, critical = chi_square_rejects(group_samples, group_probs)
        assert not rejects, f"chi2 {stat:.1f} > {critical:.1f}"


@pytest.mark.slow
def test_negative_control_accepting_every_draft_is_detected(monkeypatch):
    """An engine that skips the comparison with the target's choices must fail the same chi-square test."""
    from test_sampling import chi_square_rejects

    from dspark_hf.decoding import core

    def accept_all(draft_ids, target_ids, lengths):
        return lengths, target_ids.gather(1, lengths[:, None])[:, 0]

    monkeypatch.setattr(core, "accept_greedy", accept_all)  # the round's rule, which the Engine drives
    samples, probs, _ = sample_groups("fixed", 1500)
    rejects, stat, critical = chi_square_rejects(samples[0], probs[0])
    assert rejects, f"the test failed to notice unverified drafts (chi2 {stat:.1f} <= {critical:.1f})"


def seeded_outputs(engine, prompts, seeds, gate_coin=None, **kwargs) -> list[list[int]]:
    """Each prompt sampled once with its seed; `gate_coin` (a `random.Random`) makes the draft gate's decisions
    random, as a machine's load makes them (its decisions are appended to `engine.coin_flips`)."""
    if gate_coin is not None:
        pays, engine.coin_flips = engine.decoder._drafting_pays, []

        def coin():
            if not pays():
                return False
            engine.coin_flips.append(gate_coin.random() < 0.5)
            return engine.coin_flips[-1]

        engine.decoder._drafting_pays = coin
    requests = [
        engine.add_request(p, max_new_tokens=14, do_sample=True, seed=s, **kwargs) for p, s in zip(prompts, seeds)
    ]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=3, top_p=0.9)])
def test_seeded_sampling_is_reproducible(sampling):
    """A seed fixes a request's output: the same tokens with no drafter, under every policy, with the draft gate
    deciding at random which rounds draft, alone or beside other requests (noise keyed by seed and position)."""
    import random

    from test_sampling import setup_models

    target, drafter = setup_models()  # vocabulary 4: most drafts are accepted, some rejected
    prompts, seeds = [[1, 2, 3, 0, 1], [3, 1], [2, 2, 0, 1, 3, 1, 0]], [42, 7, 2**62 + 5]
    reference = seeded_outputs(Engine(target), prompts, seeds, **sampling)
    assert len({tuple(r) for r in reference}) == 3
    for policy, coin in [("fixed", None), ("threshold", None), ("scheduler", None), ("scheduler", 1), ("fixed", 2)]:
        gate = random.Random(coin) if coin is not None else None
        gated = {"gate_drafts": True} if coin is not None and policy == "scheduler" else {}  # the coin decides too
        engine = make_engine(target, policy, drafter=drafter, **gated)
        assert seeded_outputs(engine, prompts, seeds, gate, **sampling) == reference, (policy, coin)
        verified, accepted = engine.stats["verified_drafts"], engine.stats["accepted_drafts"]
        assert 0 < accepted < verified
        if coin is not None:
            assert True in engine.coin_flips and False in engine.coin_flips
        alone = make_engine(target, policy, drafter=drafter, max_batch_size=1)
        assert seeded_outputs(alone, prompts[1:2], seeds[1:2], **sampling) == reference[1:2]
    assert seeded_outputs(Engine(target), prompts[:1], [43], **sampling) != reference[:1]  # the seed matters


def test_unseeded_requests_record_a_fresh_seed(target):
    """Without a seed a request gets a fresh one, kept on the request: passing it again gives the same output."""
    engine = Engine(target)
    first, second = (engine.add_request([1, 2, 3], max_new_tokens=8, do_sample=True) for _ in range(2))
    while engine.has_unfinished():
        engine.step()
    assert first.seed != second.seed and 0 <= first.seed < 2**63
    assert engine.generate([[1, 2, 3]], max_new_tokens=8, do_sample=True, seed=first.seed) == [first.output_ids]


# -- the ragged cache ---------------------------------------------------------------------------------------------


def filled_cache(valid: list[list[int]], layers: int = 2) -> tuple[RaggedCache, torch.Tensor]:
    """A RaggedCache whose key at (row, slot) is 100·row + slot (values: the negation), with `valid` recorded."""
    valid = torch.tensor(valid, dtype=torch.bool)
    bsz, slots = valid.shape
    keys = (100 * torch.arange(bsz)[:, None] + torch.arange(slots)).float()  # (B, T)
    cache = RaggedCache("cpu", batch_size=bsz)
    for layer in range(layers):
        kv = keys[:, None, :, None].expand(bsz, 2, slots, 3)  # (B, H, T, hd)
        cache.cache.update(kv.clone(), -kv.clone(), layer)
    cache.commit(valid)
    return cache, keys


def stored_keys(cache: RaggedCache) -> torch.Tensor:
    """(B, T) key ids of layer 0, with holes as -1."""
    key = next(iter(cache.cache))[0][:, 0, :, 0]
    return torch.where(cache.valid, key, torch.full_like(key, -1))


def test_ragged_cache_compact_trim_select_extend():
    cache, _ = filled_cache([[1, 0, 1, 1, 0], [0, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    cache.trim()  # the last slot is a hole in every row
    assert cache.num_slots == 4 and cache.cache.get_seq_length() == 4
    assert not cache.is_right_aligned()
    cache.compact()  # each row's valid keys, in order, right-aligned
    assert stored_keys(cache).tolist() == [[-1, 0, 2, 3], [-1, -1, 101, 102], [200, 201, 202, 203]]
    assert cache.is_right_aligned() and cache.lengths().tolist() == [3, 2, 4]
    assert all(torch.equal(v, -k) for k, v, *_ in cache.cache)  # values moved with their keys
    cache.select([2, 0])
    assert stored_keys(cache).tolist() == [[200, 201, 202, 203], [-1, 0, 2, 3]]
    other, _ = filled_cache([[1, 1, 1, 1, 1, 1]])
    cache.extend(other)  # both sides left-padded with holes to 6 slots
    assert stored_keys(cache).tolist() == [[-1, -1, 200, 201, 202, 203], [-1, -1, -1, 0, 2, 3], [0, 1, 2, 3, 4, 5]]
    cache.extend(RaggedCache("cpu", batch_size=1))  # a row without K/V yet: all holes
    assert cache.batch_size == 4 and not bool(cache.valid[3].any()) and cache.cache.get_seq_length() == 6
    cache.select([])
    assert cache.batch_size == 0 and cache.num_slots == 0


def test_ragged_cache_emptied_by_trim_keeps_its_batch_axis():
    """Rows whose slots are all holes trim to no slots at all; selecting and extending rows afterwards must keep
    K/V and `valid` on the same batch (transformers' `batch_select_indices` skips a layer with no tokens)."""
    cache, _ = filled_cache([[0, 0], [0, 0], [0, 0]])
    cache.trim()
    assert cache.num_slots == 0
    cache.select([0, 2])
    cache.extend(RaggedCache("cpu", batch_size=2))
    kv = torch.ones(4, 2, 1, 3)
    for layer in range(2):
        cache.cache.update(kv, -kv, layer)  # the next forward writes one slot for all 4 rows
    cache.commit(torch.ones(4, 1, dtype=torch.bool))
    assert cache.batch_size == 4 and all(k.shape[0] == 4 for k, *_ in cache.cache)


def test_short_sps_profile_is_extended():
    from dspark_hf.decoding.policy import covering_sps as _covering_sps

    table = {b: 50.0 for b in range(1, 6)}
    sps = _covering_sps(table, 40)
    assert sps(3) == 50.0 and sps(40) == pytest.approx(50.0 * 5 / 40)
    assert _covering_sps({b: 1.0 for b in range(1, 41)}, 40)[40] == 1.0  # a covering table is used as it is


def test_a_string_prompt_with_a_lone_surrogate_is_named():
    from helpers import char_tokenizer

    target = make_target()
    engine = Engine(target, make_drafter(target), tokenizer=char_tokenizer(99))
    with pytest.raises(ValueError, match=r"lone UTF-16 surrogate \('\\ud800' at character 1\)"):
        engine.add_request("a\ud800b", max_new_tokens=4)
    assert engine.generate(["ab"], max_new_tokens=3)  # the engine serves on
