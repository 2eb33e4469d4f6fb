"""Verify-length policies: Algorithm 1 (prefix schedule with early stop), its incremental form, thresholds."""

import math

import pytest

from dspark_hf.decoding.gate import DraftGate, GateMemory, RoundCosts, drafting_pays
from dspark_hf.decoding.policy import VerifyPolicy
from dspark_hf.decoding.scheduler import (
    SPSCurve,
    conditional_confidences,
    prefix_schedule,
    settled_prefix_schedule,
    verify_width,
)


def test_flat_sps_admits_the_whole_block():
    assert prefix_schedule([[0.9, 0.8, 0.7], [0.5, 0.5]], {b: 10.0 for b in range(1, 10)}) == [3, 2]


def test_steep_sps_admits_nothing():
    # compute-bound: SPS ~ 1/B, so every extra token costs more than any survival < 1 gains
    assert prefix_schedule([[0.9, 0.9], [0.8]], lambda b: 1.0 / b) == [0, 0]


def test_greedy_order_across_requests():
    # B = 2 requests; survivals r0: 0.9, 0.45; r1: 0.6. With SPS(B) = 1 for B <= 4 and tiny after, the two best
    # candidates (0.9 of r0, 0.6 of r1) are admitted before the budget ends.
    sps = {2: 1.0, 3: 1.0, 4: 1.0, 5: 0.1}
    assert prefix_schedule([[0.9, 0.5], [0.6]], sps) == [1, 1]


def test_early_stop_at_the_first_non_improvement():
    # Θ(B=1) = 1.0; admitting 0.8 gives 1.8 * 0.5 = 0.9 < 1.0 -> stop, even though a later candidate could win.
    sps = {1: 1.0, 2: 0.5, 3: 0.45}
    assert prefix_schedule([[0.8, 1.0]], sps) == [0]


def test_sps_lookup_rounds_up_and_rejects_unprofiled_sizes():
    assert prefix_schedule([[0.9]], {1: 1.0, 4: 1.0}) == [1]  # B = 2 looks up the profiled 4
    with pytest.raises(ValueError, match="covers verify batches up to"):
        prefix_schedule([[0.99, 0.99, 0.99]], {1: 1.0, 2: 1.0})


def test_confidences_must_be_probabilities():
    with pytest.raises(ValueError, match="not a probability"):
        prefix_schedule([[1.5]], {1: 1.0, 2: 1.0})


def test_the_scheduler_policy_is_algorithm_1_for_one_request():
    sps = {1: 31.0, 2: 28.0, 3: 26.0, 4: 20.0, 5: 19.0, 6: 18.5, 7: 17.0, 8: 16.5}  # no cheaper wider width
    policy = VerifyPolicy("scheduler", sps=SPSCurve(sps))
    for conf in ([0.9, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4], [0.3, 0.9, 0.9], [0.99] * 7, [0.05]):
        assert policy.lengths([conf], [len(conf)]) == prefix_schedule([conf], sps)


# Verify times measured on this 2-core CPU for SmolLM2-135M (ms, context 256): 2, 3 and 7 tokens cost more than 5 or 8.
CPU_MS = {1: 65, 2: 110, 3: 131, 4: 96, 5: 89, 6: 95, 7: 127, 8: 93, 9: 100}
CPU_SPS = {b: 1000.0 / ms for b, ms in CPU_MS.items()}


def test_padded_rates_are_the_best_width_within_reach():
    lookup = SPSCurve(CPU_SPS).lookup(8)
    assert [round(1000 / lookup(b)) for b in range(1, 9)] == [65, 89, 89, 89, 89, 93, 93, 93]
    assert [verify_width(CPU_SPS, b, 8) for b in range(1, 9)] == [1, 5, 5, 5, 5, 8, 8, 8]
    assert verify_width(CPU_SPS, 2, 4) == 4 and verify_width(CPU_SPS, 2, 3) == 2  # never wider than reach
    assert round(1000 / SPSCurve(CPU_SPS).lookup(7)(6)) == 95  # 8 tokens are out of reach at 7
    assert SPSCurve(CPU_SPS)(3) == CPU_SPS[3]  # without max_tokens: the rate of the width itself


def test_a_curve_builds_each_padded_table_once():
    calls = []

    def sps(b):
        calls.append(b)
        return CPU_SPS[b]

    curve = SPSCurve(sps)
    first = [curve.lookup(8)(b) for b in range(1, 9)]
    assert sorted(calls) == list(range(1, 9))
    assert [curve.lookup(8)(b) for b in range(1, 9)] == first and curve.width(2, 8) == 5
    prefix_schedule([[0.9, 0.8, 0.7]] * 2, curve, max_tokens=8)  # the scheduler reuses a curve it is given
    assert len(calls) == 8
    assert SPSCurve.of(curve) is curve
    with pytest.raises(ValueError, match="empty"):
        SPSCurve({})


def test_padding_makes_cheap_widths_worth_verifying():
    """On CPU_MS a 2-token verify (110 ms) costs more than 1.5 tokens are worth, so plain Algorithm 1 drafts nothing;
    padded to 5 tokens (89 ms) the same survivals pay: 2.1 expected tokens per 89 ms against 1 per 65 ms."""
    conf = [0.5, 0.6, 0.67, 0.5, 0.8, 0.5, 0.5]
    assert prefix_schedule([conf], CPU_SPS) == [0]
    assert prefix_schedule([conf], CPU_SPS, max_tokens=8) == [4]


def test_padded_admission_ends_on_the_cheapest_width_in_reach():
    """Random profiles with dips and random confidences (zeros included): the incremental admission verifies
    Algorithm 1's padded schedule, padded to `verify_width`; no wider width in reach is cheaper; and on a
    non-decreasing cost curve padding changes nothing."""
    import random

    rng = random.Random(0)
    for _ in range(300):
        gamma = rng.randint(1, 8)
        sps = {b: rng.uniform(1.0, 10.0) / (1 + b / rng.uniform(2, 20)) for b in range(1, gamma + 2)}
        conf = [rng.choice([rng.random(), rng.uniform(0.7, 1.0), 0.0]) for _ in range(gamma)]
        width = VerifyPolicy("scheduler", sps=SPSCurve(sps)).lengths([conf], [gamma])[0] + 1
        assert width == verify_width(sps, prefix_schedule([conf], sps, max_tokens=gamma + 1)[0] + 1, gamma + 1)
        assert all(sps[width] >= sps[b] for b in range(width, gamma + 2))
        monotone = dict(zip(sps, sorted(sps.values(), reverse=True)))
        assert prefix_schedule([conf], monotone, max_tokens=gamma + 1) == prefix_schedule([conf], monotone)


def test_padded_admission_pads_after_a_zero_survival():
    policy = VerifyPolicy("scheduler", sps=SPSCurve(CPU_SPS))
    assert policy.lengths([[0.9] + [0.0] * 6], [7]) == [4]  # B = 2 at the padded rate: filled up to 5 tokens


def test_appendix_a_counterexample_global_search_skews_the_distribution():
    """DSpark App. A: γ = 2, SPS = (1.0, 0.5, 0.45), a_1 = 0.8, p_t = (0.7, 0.3), p_d = (0.5, 0.5).

    c_2 is high after draft A and low after draft B. A retrospective global search over ℓ verifies both drafts
    after A and none after B, so the first token comes out A with probability 0.85; the early-stop schedule never
    looks at c_2 and keeps the target's 0.7.
    """
    p_t, p_d, sps = {"A": 0.7, "B": 0.3}, {"A": 0.5, "B": 0.5}, {1: 1.0, 2: 0.5, 3: 0.45}
    c2 = {"A": 0.95, "B": 0.05}

    def global_search(conf):
        a1, a2 = conf[0], conf[0] * conf[1]
        thetas = {0: 1.0 * sps[1], 1: (1 + a1) * sps[2], 2: (1 + a1 + a2) * sps[3]}
        return max(thetas, key=thetas.get)

    def first_token_distribution(schedule) -> float:
        prob_a = 0.0
        for x1 in ("A", "B"):
            length = schedule([0.8, c2[x1]])
            if length == 0:  # nothing verified: the target samples the first token itself
                prob_a += p_d[x1] * p_t["A"]
            elif x1 == "A":  # accepted with probability min(1, p_t/p_d) = 1
                prob_a += p_d[x1] * min(1.0, p_t["A"] / p_d["A"])
            else:  # B accepted w.p. 0.3/0.5, else the residual max(0, p_t - p_d) puts all mass on A
                accept_b = min(1.0, p_t["B"] / p_d["B"])
                prob_a += p_d[x1] * (1 - accept_b)
        return prob_a

    assert first_token_distribution(global_search) == pytest.approx(0.85)
    assert first_token_distribution(lambda conf: prefix_schedule([conf], sps)[0]) == pytest.approx(0.7)


def test_verify_policies_resolved_from_the_drafter(target):
    from conftest import make_drafter

    threshold = VerifyPolicy.for_drafter(
        make_drafter(target, verify_policy="threshold", confidence_threshold=0.5), target
    )
    # a = 0.9, 0.54, 0.49 | 0.4: ℓ = 2, 0; the verify is 3 wide anyway, so row 1 fills it with its own drafts
    assert threshold.lengths([[0.9, 0.6, 0.9], [0.4, 1.0, 1.0]], [3, 3]) == [2, 2]
    assert threshold.lengths([[0.9, 0.9], [1.0, 1.0]], [2, 1]) == [2, 1]  # shorter rows fill the width, within cap
    assert VerifyPolicy.for_drafter(make_drafter(target, verify_policy="fixed"), target).lengths([[], []], [4, 2]) == [
        4,
        2,
    ]
    no_head = make_drafter(target, verify_policy="threshold", confidence_head=False)
    assert VerifyPolicy.for_drafter(no_head, target).name == "fixed"  # no survivals: the whole block
    scheduler = VerifyPolicy.for_drafter(make_drafter(target), target, "scheduler", sps={1: 1.0, 2: 1.0})
    assert scheduler.name == "scheduler" and scheduler.gate is not None  # the config's draft gate
    with pytest.raises(ValueError, match="steps-per-second profile"):
        VerifyPolicy("scheduler")
    with pytest.raises(ValueError, match="verify_policy"):
        VerifyPolicy.for_drafter(make_drafter(target), target, "sometimes")


@pytest.mark.parametrize("profile", ["flat", "loaded", "steep"])
def test_a_settled_partial_schedule_is_the_whole_blocks_schedule(profile):
    """Seeing positions 1..K of every row (rows with shorter caps end earlier), `settled_prefix_schedule` either
    defers (None) or returns exactly `prefix_schedule` of the whole block; with everything seen it never defers."""
    import math
    import random

    sps = {
        "flat": {b: 100.0 for b in range(1, 200)},
        "loaded": {b: 100.0 / (1 + b / 12) for b in range(1, 200)},
        "steep": {b: 100.0 / b for b in range(1, 200)},
    }[profile]
    rng = random.Random(0)
    settled_early = 0
    for _ in range(200):
        caps = [rng.randint(1, 7) for _ in range(rng.randint(1, 6))]
        full = [[rng.choice([rng.random(), rng.uniform(0.8, 1.0), 0.0]) for _ in range(cap)] for cap in caps]
        expected = prefix_schedule(full, sps)
        for seen in range(1, max(caps) + 1):
            partial = [c[:seen] for c in full]
            bound = max((math.prod(c) for c, cap in zip(partial, caps) if cap > seen), default=0.0)
            got = settled_prefix_schedule(partial, sps, bound)
            assert got is None or got == expected, (full, seen)
            if got is not None:
                settled_early += seen < max(caps)
                break
        assert got == expected  # with every position seen (bound 0) it always settles
    if profile != "flat":  # where verification costs, most blocks are decided before their end
        assert settled_early > 0


def test_draft_gate_prices_the_draft_pass():
    """One request, 100 ms per verify at 1 or 2 tokens, a draft expected to survive with 0.5: a round that drafts
    commits 1.5 tokens in d + 0.1 s, a plain step 1 token in 0.1 s, so drafting pays exactly while d < 0.05 s."""
    sps = {1: 10.0, 2: 10.0}
    assert drafting_pays([[0.5]], sps, draft_seconds=0.04)
    assert not drafting_pays([[0.5]], sps, draft_seconds=0.06)
    assert drafting_pays([[0.5]], sps, draft_seconds=0.0)  # free drafts always pay when anything may survive
    assert not drafting_pays([[0.0]], sps, draft_seconds=0.0)  # ... but not when nothing can
    assert not drafting_pays([[], []], sps | {3: 10.0}, draft_seconds=0.0)  # rows with no room to draft


def test_draft_gate_prices_a_plain_step_unpadded():
    """Where a 2-token verify is cheaper than a 1-token step (this CPU with the few-rows products), a plain step
    still costs its own width: it has no drafts to pad with. Drafting one token that may fail then pays."""
    sps = {1: 10.0, 2: 16.0, 3: 12.0}
    assert drafting_pays([[0.0, 0.0]], sps, draft_seconds=0.02, max_tokens=3)  # 1/16 + 0.02 s < 1/10 s
    assert not drafting_pays([[0.0, 0.0]], sps, draft_seconds=0.05, max_tokens=3)


def test_draft_gate_follows_the_load():
    """The same confident drafts pay at batch 1 and stop paying when every extra verified token costs as much as a
    row's step (a compute-bound batch), with the draft pass costing a fifth of a step."""
    light = {b: 10.0 for b in range(1, 40)}
    heavy = {b: 10.0 * 8 / max(b, 8) for b in range(1, 40)}  # flat up to 8 tokens, then time grows with B
    confident = [0.9, 0.8, 0.7]
    assert drafting_pays([confident], light, draft_seconds=0.02)
    assert not drafting_pays([confident] * 8, heavy, draft_seconds=0.02)
    with pytest.raises(ValueError, match="draft_seconds"):
        drafting_pays([confident], light, draft_seconds=-1.0)


def test_draft_gate_measures_then_predicts_and_probes():
    """Unknown cost: draft (to measure). Measured dear: plain steps, except a probe after `probe_interval` of them;
    a request without a hint is predicted from the last drafted round's mean; a cheaper measurement reopens it."""
    sps = {b: 10.0 for b in range(1, 10)}  # 100 ms per verify, any size
    gate = DraftGate(sps, probe_interval=3)
    assert gate.should_draft([None, None], [4, 4])  # nothing measured yet
    gate.record(9.0, [[0.9, 0.5], [0.7]])  # the first pass at two rows is a warm-up: not priced
    assert gate.cost(2) is None and gate.should_draft([None, None], [4, 4])
    gate.record(0.5, [[0.9, 0.5], [0.7]])  # 500 ms for two rows
    assert gate.prior == pytest.approx([0.8, 0.5]) and gate.cost(2) == 0.5 and gate.cost(3) is None
    decisions = [gate.should_draft([[0.9, 0.5], None], [4, 4]) for _ in range(4)]
    assert decisions == [False, False, False, True]  # three plain rounds, then a probe
    gate.record(0.0, [[0.9, 0.5], [0.7]])  # a cheaper pass weighs 0.5: the cost falls to 0.25 s, still dear
    assert gate.cost(2) == pytest.approx(0.25) and not gate.should_draft([[0.9, 0.5], None], [4, 4])
    for bad in ({"draft_seconds": -0.1}, {"probe_interval": 0}, {"max_probe_interval": 2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DraftGate(sps, **bad)
    cheap = DraftGate(sps, draft_seconds=lambda rows: 0.001 * rows)
    cheap.record(9.0, [[0.9]])  # a fixed cost model ignores the measurement
    assert cheap.cost(2) == pytest.approx(0.002) and cheap.should_draft([[0.9, 0.5], None], [4, 4])


def test_draft_gate_backs_off_while_probes_fail_and_resets_when_drafting_pays():
    """Each probe that still predicts no gain doubles the plain rounds before the next (3, 6, 12, then the cap of
    12); a round predicted to pay brings the interval back to 3."""
    sps = {b: 10.0 for b in range(1, 10)}
    gate = DraftGate(sps, draft_seconds=0.5, probe_interval=3, max_probe_interval=12)
    gate.record(0.5, [[0.1]])
    hopeless, sure = [[0.1]], [[0.99, 0.99, 0.99]]
    drafted = []
    for _ in range(40):
        if gate.should_draft(hopeless, [4]):
            drafted.append(gate.plain_in_a_row)
            gate.record(0.5, hopeless)
    assert drafted == [3, 6, 12, 12]
    free = DraftGate(sps, draft_seconds=lambda rows: free_cost[0], probe_interval=3, max_probe_interval=12)
    free_cost = [0.5]
    free.record(0.5, hopeless)
    for _ in range(3 + 1 + 5):  # a failed probe after 3 plain rounds, then 5 of the 6 of the doubled wait
        if free.should_draft(hopeless, [4]):
            free.record(0.5, hopeless)
    assert free.wait == 6
    free_cost[0] = 0.0  # drafting became free: the next round drafts and the interval resets
    assert free.should_draft(sure, [4]) and free.wait == 3


def test_a_call_starts_shut_where_the_last_one_ended_shut_and_probes_after_its_backed_off_wait():
    """The gate's state carries over between calls through its `GateMemory`: a call after one that ended with the
    gate shut (probes backed off to 12 plain rounds) keeps its rounds plain until the probe after 12, even where the
    prediction alone would draft; a fresh memory drafts at once; a probe that measures cheaper reopens the gate."""
    sps = {b: 10.0 for b in range(1, 10)}
    clock = [0.0]
    memory = GateMemory()
    first = DraftGate(sps, draft_seconds=0.5, probe_interval=3, max_probe_interval=12, memory=memory)
    first.record(0.5, [[0.1]])
    for _ in range(40):  # hopeless drafts: probes at 3, 6, 12 plain rounds, then the wait stays at 12
        if first.should_draft([[0.1]], [4]):
            first.record(0.5, [[0.1]])
    assert memory.shut and memory.wait == 12
    sure = [[0.99, 0.99, 0.99]]
    second = DraftGate(sps, draft_seconds=0.001, probe_interval=3, max_probe_interval=12, memory=memory)
    decisions = [second.should_draft(sure, [4]) for _ in range(13)]
    assert decisions == [False] * 12 + [True]  # plain until the probe, though drafting is now predicted to pay
    fresh = DraftGate(sps, draft_seconds=0.001, probe_interval=3, max_probe_interval=12, memory=GateMemory())
    fresh.record(0.001, sure)
    assert fresh.should_draft(sure, [4])
    # measured costs: a shut start whose probe measures cheaper per token than plain rounds opens the gate
    memory = GateMemory()
    memory.shut, memory.wait, memory.prior, memory.draft_seconds[1] = True, 4, [0.9] * 3, 0.01
    gate = DraftGate(sps, probe_interval=4, memory=memory, clock=lambda: clock[0])
    drafted = []
    for _ in range(12):
        decision = gate.should_draft(sure, [4])
        drafted.append(decision)
        if decision:
            gate.record(0.01, sure)
        clock[0] += 0.1
        gate.end_round(tokens=4 if decision else 1)  # a drafted round: 4 tokens in the time of a plain one
    assert drafted[:4] == [False] * 4 and all(drafted[4:])
    assert not memory.shut and memory.wait == 4


def test_conditional_confidences_undo_the_cumulative_product():
    assert conditional_confidences([0.8, 0.4, 0.1, 0.0, 0.0]) == pytest.approx([0.8, 0.5, 0.25, 0.0, 0.0])
    assert conditional_confidences([]) == []


def _gate_run(gate, now, rounds, drafted_seconds, plain_seconds, drafted_tokens=(3,), lengths=None):
    """`rounds` rounds of one request on a fake clock: the i-th drafted round commits `drafted_tokens[i % len]` in
    `drafted_seconds`, a plain one 1 token in `plain_seconds`; the draft pass is priced cheap, so the prediction
    alone would always draft. `lengths` ([3]): the round verifies its 3 drafts, so the confidences (0.9 each)
    expect 1 + 0.9 + 0.81 + 0.729 = 3.44 tokens of it. Returns the decisions."""
    confident = [[0.9, 0.9, 0.9]]
    decisions = []
    for _ in range(rounds):
        drafted = gate.should_draft(confident, [3])
        if drafted:
            gate.record(0.001, confident, lengths)
        now[0] += drafted_seconds if drafted else plain_seconds
        gate.end_round(drafted_tokens[sum(decisions) % len(drafted_tokens)] if drafted else 1)
        decisions.append(drafted)
    return decisions


def test_draft_gate_keeps_drafting_through_runs_of_rejected_drafts():
    """Acceptance is bursty: here three drafted rounds in four commit only their anchor's token and the fourth five,
    2 tokens a round on average, 30 ms a token against 35 for a plain round. A run of rejections must not price
    drafting above plain (with tokens weighted as fast as seconds it did, and the gate then stayed plain)."""
    now = [0.0]
    gate = DraftGate({b: 10.0 for b in range(1, 10)}, clock=lambda: now[0])
    decisions = _gate_run(gate, now, 200, 0.06, 0.035, drafted_tokens=(1, 1, 1, 5))
    assert sum(decisions[40:]) >= 0.9 * 160, sum(decisions[40:])
    assert gate.rounds[True].per_token(1) < gate.rounds[False].per_token(1)
    fast = RoundCosts(0.3, token_weight=0.3)  # the negative control: tokens as fast as seconds
    for tokens in (1, 1, 5, 1, 1, 1):
        fast.add(1, 0.06, tokens)
    assert fast.per_token(1) > 0.035  # three rejections in a row: dearer than plain, although 2 a round on average


def test_draft_gate_weighs_a_few_unlucky_rounds_against_the_confidences():
    """Drafted rounds cost 60 ms, plain ones 35. The first drafted rounds commit 1 token each, later ones 1, 3 and 5
    in turn (3 on average, 20 ms a token, as the confidences expect). Counted alone, the unlucky start prices
    drafting at 60 ms a token and the gate shuts (the negative control, `prior_rounds=0`); with the confidences
    worth 8 rounds it keeps drafting and finds the rounds that pay."""
    tokens = (1,) * 6 + (1, 3, 5) * 60
    runs = {}
    for prior in (8.0, 0.0):
        now = [0.0]
        gate = DraftGate({b: 10.0 for b in range(1, 10)}, prior_rounds=prior, clock=lambda now=now: now[0])
        runs[prior] = _gate_run(gate, now, 60, 0.06, 0.035, drafted_tokens=tokens, lengths=[3])
    assert sum(runs[8.0][:30]) >= 20, runs[8.0]
    assert sum(runs[0.0][:30]) <= 12, runs[0.0]
    assert sum(runs[8.0][30:]) >= 20  # drafting, with a plain round now and then to keep its cost current
    assert RoundCosts(0.3, prior_rounds=0).prior_rounds == 0
    with pytest.raises(ValueError, match="prior_rounds"):
        RoundCosts(0.3, prior_rounds=-1)


def test_draft_gate_finds_out_confidences_that_promise_too_much():
    """The confidences expect 3.44 tokens a round, every drafted round commits 1 (70 ms against 35 for a plain
    one): as measured rounds outweigh the 8 rounds the confidences count for, drafting is priced dearer than plain
    and only probes draft. Rounds recorded without lengths count as measured, as before."""
    now = [0.0]
    gate = DraftGate({b: 10.0 for b in range(1, 10)}, clock=lambda: now[0])
    decisions = _gate_run(gate, now, 200, 0.07, 0.035, drafted_tokens=(1,), lengths=[3])
    assert sum(decisions[:20]) >= 10  # the confidences are believed at first
    assert sum(decisions[100:]) <= 10, decisions  # then the measurement wins
    assert gate.rounds[True].expected[1] == pytest.approx(3.439)
    assert gate.rounds[True].per_token(1) > gate.rounds[False].per_token(1)
    gate.record(0.001, [[0.9, 0.9, 0.9]])  # no lengths: no expectation for the round
    assert gate.expected is None


def test_draft_gate_follows_measured_round_times_and_recovers_when_the_load_changes():
    """Quiet: drafted rounds cost 20 ms a token, plain 40: it drafts, with a plain round every 5 to keep the plain
    cost current. A load makes drafted rounds 100 ms a token against 60 plain: within a few rounds only probes draft.
    The load gone, the probes find drafting cheaper again and it drafts."""
    now = [0.0]
    gate = DraftGate(
        {b: 10.0 for b in range(1, 10)}, probe_interval=2, max_probe_interval=8, plain_probe_interval=5,
        clock=lambda: now[0],
    )  # fmt: skip
    quiet = _gate_run(gate, now, 30, 0.06, 0.04)
    assert quiet[:5] == [True, True, False, False, True]  # warm-ups of both kinds left out, then measured
    assert sum(quiet[5:]) >= 20 and not all(quiet[5:])  # drafting, with plain probes
    assert gate.rounds[True].per_token(1) == pytest.approx(0.02)
    loaded = _gate_run(gate, now, 60, 0.3, 0.06)
    assert sum(loaded[20:]) <= 10  # only probes draft
    assert gate.measured_gated > 0 and gate.rounds[True].per_token(1) > gate.rounds[False].per_token(1)
    recovered = _gate_run(gate, now, 80, 0.06, 0.04)
    assert sum(recovered[-30:]) >= 20  # drafting again
    assert gate.rounds[True].per_token(1) < gate.rounds[False].per_token(1)


def test_a_gate_shut_by_measured_round_times_says_so_once(caplog):
    """Drafted rounds measured dearer per token than plain ones (a load): one info line names both costs, once per
    drafter and target, not again in a later call nor on a quiet machine, where no round is gated that way."""
    import logging

    from transformers.utils import logging as hf_logging

    def messages():
        return [r.getMessage() for r in caplog.records if "measured" in r.getMessage()]

    now, memory = [0.0], GateMemory()

    def run(drafted_seconds, plain_seconds):
        gate = DraftGate({b: 10.0 for b in range(1, 10)}, probe_interval=2, clock=lambda: now[0], memory=memory)
        _gate_run(gate, now, 60, drafted_seconds, plain_seconds)
        return gate

    hf_logging.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO):
            run(0.06, 0.04)
            assert not messages()  # quiet: drafting pays (a plain round now and then re-measures the plain cost)
            loaded = run(0.3, 0.06)
            assert loaded.measured_gated >= 8 and len(messages()) == 1
            assert "100.0 ms per committed token against 60.0 ms" in messages()[0]
            assert run(0.3, 0.06).measured_gated >= 8 and len(messages()) == 1  # said once
    finally:
        hf_logging.set_verbosity_warning()


def test_a_fixed_draft_price_ignores_round_times():
    now = [0.0]
    gate = DraftGate({b: 10.0 for b in range(1, 10)}, draft_seconds=0.001, clock=lambda: now[0])
    assert all(_gate_run(gate, now, 20, 10.0, 0.01))  # dear drafted rounds, yet the model's price decides
    with pytest.raises(ValueError, match="weight"):
        DraftGate({1: 1.0}, weight=0.0)
    with pytest.raises(ValueError, match="plain_probe_interval"):
        DraftGate({1: 1.0}, plain_probe_interval=0)


def test_the_gates_measurements_outlive_a_generate_call():
    """A second call's gate starts from the draft cost and confidences the first measured (no cold first pass to
    price again); round times are measured per call; another target, or a fixed draft price, starts afresh."""
    from conftest import make_drafter, make_target

    target = make_target()
    drafter = make_drafter(target, verify_policy="scheduler")
    sps = {b: 10.0 for b in range(1, 20)}
    first = VerifyPolicy.for_drafter(drafter, target, sps=sps).gate
    now = [0.0]
    first.clock = lambda: now[0]
    _gate_run(first, now, 40, 0.06, 0.04)
    second = VerifyPolicy.for_drafter(drafter, target, sps=sps).gate
    assert second is not first and second.memory is first.memory and second.cost(1) == first.cost(1) is not None
    assert second.prior == first.prior and second.rounds[True].per_token(1) is None  # round times: per call
    assert VerifyPolicy.for_drafter(drafter, make_target(), sps=sps).gate.memory is not first.memory
    assert VerifyPolicy.for_drafter(drafter, target, sps=sps, draft_seconds=0.01).gate.memory is not first.memory
    assert not any("gate" in name or "memory" in name for name in vars(drafter))  # kept beside, never on it


def test_a_round_whose_verify_tried_another_kernel_is_not_measured():
    now = [0.0]
    gate = DraftGate({b: 10.0 for b in range(1, 10)}, clock=lambda: now[0])
    _gate_run(gate, now, 12, 0.06, 0.04)
    before = (gate.rounds[True].per_token(1), gate.rounds[False].per_token(1))
    for _ in range(4):
        drafted = gate.should_draft([[0.9, 0.9, 0.9]], [3])
        now[0] += 5.0  # a slow way on trial
        gate.end_round(3 if drafted else 1, measured=False)
    assert (gate.rounds[True].per_token(1), gate.rounds[False].per_token(1)) == before


def test_draft_pass_cost_falls_fast_when_a_load_leaves_and_rises_slowly():
    """Another process only ever adds time to a draft pass: after a loaded stretch (50 ms passes) three quiet ones
    (8 ms) bring the priced cost under 15 ms, where weighting them as the dearer ones (0.2) left it above 20 ms;
    one dear pass in a quiet stretch moves it by a fifth of the difference only."""
    gate = DraftGate({b: 10.0 for b in range(1, 10)})
    for seconds in [0.05] * 8 + [0.008] * 3:
        gate.record(seconds, [[0.9, 0.8]])
    assert gate.cost(1) < 0.015
    slow = 0.05
    for _ in range(3):
        slow = 0.8 * slow + 0.2 * 0.008
    assert slow > 0.02  # the symmetric average of before, the negative control
    for seconds in [0.008] * 8 + [0.05]:
        gate.record(seconds, [[0.9, 0.8]])
    assert 0.015 < gate.cost(1) < 0.02


@pytest.mark.parametrize("budget", [0, 6])
def test_the_decoder_gives_the_gate_what_each_round_verifies(monkeypatch, budget):
    """A round tells the gate how many drafts each row verifies, so that it can expect the round's tokens: a chain's
    first positions, or a tree's first nodes in join order. Their conditionals multiply up to the positions'
    survivals or the nodes' path estimates, and the round's expected tokens are the bonus plus their sum."""
    import torch

    from conftest import make_drafter, make_target

    seen = []
    record = DraftGate.record

    def spy(self, seconds, confidences, lengths=None):
        record(self, seconds, confidences, lengths)
        seen.append((None if lengths is None else list(lengths), [list(c) for c in confidences], self.expected))

    monkeypatch.setattr(DraftGate, "record", spy)
    target = make_target()
    drafter = make_drafter(target, verify_policy="scheduler")
    drafter.config.tree_budget = budget
    drafter.sps_profile = {b: 100.0 for b in range(1, 40)}  # width is free: drafting always pays
    ids = torch.randint(0, 99, (1, 9))
    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                    assistant_model=drafter)  # fmt: skip
    assert seen
    for lengths, confidences, expected in seen:
        assert len(lengths) == 1 and 0 <= lengths[0] <= (budget or 4)
        estimates = [math.prod(confidences[0][: i + 1]) for i in range(lengths[0])]  # survivals / path estimates
        assert expected == pytest.approx(1 + sum(estimates))
    assert max(lengths[0] for lengths, _, _ in seen) > 1  # rounds that verified several drafts or nodes


@pytest.mark.parametrize("plain_seconds, drafts", [(0.2, True), (0.1, False), (0.05, False)])
def test_draft_gate_prices_a_measured_draft_pass_in_the_profiles_time(plain_seconds, drafts):
    """The profile says 100 ms a step; a draft pass measures 60 ms and survives with 0.5. Priced against the profile's
    step as it is, drafting never pays (1.5 tokens in 160 ms against 1 in 100). Where plain rounds measure 200 ms
    (a slower or busier machine than the profile's), the draft pass is 30 ms of the profile's time and drafting pays,
    as it does on that machine (1.5 tokens in 260 ms against 1 in 200); at the profile's speed or faster it does
    not."""
    now = [0.0]
    gate = DraftGate({1: 10.0, 2: 10.0}, clock=lambda: now[0])
    gate.record(9.0, [[0.5]])  # a warm-up, not priced
    gate.record(0.06, [[0.5]])
    for _ in range(2):  # plain rounds, the first one a warm-up
        assert not gate.should_draft([[0.5]], [1])
        now[0] += plain_seconds
        gate.end_round(1)
    assert gate.should_draft([[0.5]], [1]) == drafts


def test_draft_gate_never_drafts_where_a_verified_token_costs_a_step(caplog):
    """A profile where each verified token costs a whole step (a dynamic int8 target verifying token by token): not
    even free drafts that are always accepted pay, so no round drafts, not the first (whose cost is unknown) nor any
    probe, and one info line says why. Against a flat profile the same gate drafts at once."""
    import logging

    from transformers.utils import logging as hf_logging

    linear = {b: 10.0 / b for b in range(1, 17)}
    now = [0.0]
    gate = DraftGate(linear, probe_interval=2, clock=lambda: now[0])
    hf_logging.set_verbosity_info()
    try:
        with caplog.at_level(logging.INFO):
            decisions = _gate_run(gate, now, 100, 0.01, 0.1)
    finally:
        hf_logging.set_verbosity_warning()
    assert not any(decisions)
    assert sum("not even drafts that are always accepted" in r.getMessage() for r in caplog.records) == 1
    flat = DraftGate({b: 10.0 for b in range(1, 17)}, probe_interval=2, clock=lambda: now[0])
    assert _gate_run(flat, now, 3, 0.01, 0.1)[0]
