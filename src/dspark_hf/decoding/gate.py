"""The draft gate, our addition to Algorithm 1: skip a round's draft pass where a plain decoding step is expected to
be faster.

Algorithm 1 (`scheduler.py`) prices only the verify step and takes the draft as given. On a CPU, or with a large
batch, a draft pass costs a sizeable part of a verify, and a round that then verifies few drafts is slower than a
plain step. `drafting_pays` is the pure decision against a cost profile; `DraftGate` decides round by round from the
round times it measures (`RoundCosts`) and what it remembers across calls (`GateMemory`). Skipping a draft never
changes the output: the round is a plain step.
"""

import itertools
import statistics
import time
from collections.abc import Callable, Sequence

from transformers.utils import logging

from .lookup import expected_depth
from .scheduler import SPS, SPSCurve, prefix_schedule


logger = logging.get_logger(__name__)

MEASURED_GATED_TOLD = 8  # rounds made plain by measured round times in one call before the gate says so (once)


def drafting_pays(
    predicted: Sequence[Sequence[float]], sps: SPS, draft_seconds: float, max_tokens: int | None = None
) -> bool:
    """Whether a draft pass is expected to pay for itself this round: the draft gate (our addition to Algorithm 1).

    Algorithm 1 takes the draft as given and prices only the verify step. Where a draft pass costs a sizeable part
    of a verify step (a CPU, a large batch), a round that then verifies few drafts is slower than a plain decoding
    step. So before drafting compare a plain step, Θ_plain = R · SPS(R), with Algorithm 1's best Θ on a round that
    also pays `draft_seconds` for the draft, SPS'(B) = 1 / (draft_seconds + 1 / SPS(B)), using `predicted[r][k]`
    (request r's expected conditional acceptance at draft position k+1, e.g. its last round's confidences).
    The decision uses nothing of this round's drafts, so skipping a draft (a plain step) stays lossless.
    `max_tokens` prices verifies padded to their cheapest width, as in `prefix_schedule`; the plain step itself is
    priced at its own width R, since it has no drafts to pad with.
    """
    if draft_seconds < 0:
        raise ValueError(f"`draft_seconds` must be >= 0, got {draft_seconds}.")
    curve = SPSCurve.of(sps)
    lookup = curve.lookup(max_tokens)
    n_requests = len(predicted)

    def with_draft(b: int) -> float:
        return 1.0 / (draft_seconds + 1.0 / lookup(b))

    lengths = prefix_schedule(predicted, with_draft)  # `lookup` is padded already
    expected = n_requests + sum(expected_depth(c, n) for c, n in zip(predicted, lengths))
    # a plain step has no drafts to pad its verify with: it runs at its own width
    return expected * with_draft(n_requests + sum(lengths)) > n_requests * curve(n_requests)


class RoundCosts:
    """Exponentially weighted seconds and tokens of recent rounds of one kind (drafted or plain), per row count:
    `per_token(rows)` is their ratio, the measured cost of a committed token (None until a round is recorded).

    The two move at different speeds. A round's time follows the machine's load and is weighted by `weight`; the
    tokens it commits follow the text, one round accepting none and the next several, so they are averaged over
    about `1 / token_weight` rounds. Weighting tokens as fast as seconds let a short run of rejected drafts price
    drafting above plain decoding on a quiet machine and close the gate for rounds that would have paid. Both start
    as plain means (weight 1/n for the n-th round) until their weight is reached.

    Even averaged, a few rounds say little: a drafted round commits anywhere from 1 to 8 tokens. Where each round
    also comes with the tokens the calibrated confidences expected of it (`add(..., expected=)`), the measured
    tokens are shrunk towards those: the prediction counts as `prior_rounds` rounds of evidence against the n rounds
    measured (n up to the averaging window, 1 / token_weight), so a short unlucky run cannot by itself price
    drafting above plain decoding, and a drafter whose confidences promise more than it delivers is still found out
    as the rounds accumulate."""

    def __init__(self, weight: float, token_weight: float | None = None, prior_rounds: float = 0.0):
        if prior_rounds < 0:
            raise ValueError(f"`prior_rounds` must be >= 0, got {prior_rounds!r}.")
        self.weight = weight
        self.token_weight = weight / 6 if token_weight is None else token_weight
        self.prior_rounds = prior_rounds
        self.seconds: dict[int, float] = {}
        self.tokens: dict[int, float] = {}
        self.expected: dict[int, float] = {}  # the same average of what the confidences expected of each round
        self.count: dict[int, int] = {}

    def add(self, rows: int, seconds: float, tokens: int, expected: float | None = None) -> None:
        """One round (`expected`: the tokens its confidences predicted, None if unknown); the first of each row count
        is left out (a warm-up: first kernels, measuring, allocating)."""
        n = self.count[rows] = self.count.get(rows, 0) + 1
        if n == 1:
            return
        mean = 1.0 / (n - 1)  # the n-1-th round measured
        w, wt = max(self.weight, mean), max(self.token_weight, mean)
        self.seconds[rows] = (1 - w) * self.seconds.get(rows, 0.0) + w * seconds
        self.tokens[rows] = (1 - wt) * self.tokens.get(rows, 0.0) + wt * tokens
        expected = tokens if expected is None else expected  # no prediction: the round speaks for itself
        self.expected[rows] = (1 - wt) * self.expected.get(rows, 0.0) + wt * expected

    def per_token(self, rows: int) -> float | None:
        tokens = self.tokens.get(rows)
        if not tokens:
            return None
        if self.prior_rounds:
            measured = min(self.count[rows] - 1, 1.0 / self.token_weight)
            tokens = (measured * tokens + self.prior_rounds * self.expected[rows]) / (measured + self.prior_rounds)
        return self.seconds[rows] / tokens


class GateMemory:
    """What a `DraftGate` measures that outlives one `generate()` call: the draft pass's seconds per row count and the
    last confidences, so that a call does not price a cold first draft pass again; `VerifyPolicy.for_drafter` keeps
    one per drafter and target. Round times are measured per call: carried over, those of a cold first call (first
    kernels at each width) kept the gate shut through short replies.

    Whether the gate was shut when the last call ended, and the wait its probes had backed off to, carry over too: on
    text the drafter cannot follow, each call re-learning that drafting loses (drafting its first rounds, then probing
    after 8, 16, 32 plain rounds) cost short replies 5-10 % against plain decoding (`make demo`). A call that starts
    shut drafts first after `wait` plain rounds, a probe like any other: one that measures cheaper than plain reopens
    the gate and resets the wait, so a cold first call keeps the next one plain for a few rounds at most."""

    def __init__(self):
        self.draft_seconds: dict[int, float] = {}  # rows -> smoothed seconds of a draft pass
        self.draft_passes: dict[int, int] = {}
        self.prior: list[float] | None = None
        self.shut = False  # the last decided rounds were plain ones, two or more in a row
        self.wait: int | None = None  # plain rounds before the next probe, as the last call left it
        self.told: set[str] = set()  # the info lines already logged for this drafter and target (once each)


class DraftGate:
    """`drafting_pays` between rounds, checked against measured round times: what a decoding loop asks before each
    draft pass.

    The prediction: each request's confidences from the last round it drafted (a request that has not drafted yet:
    the mean of the last drafted round), the draft pass priced at `draft_seconds` (a float or a callable from the
    number of rows; None measures it per number of rows, smoothed) and the verify at the SPS profile. It drafts
    anyway while that cost is unknown and after `probe_interval` plain rounds in a row, which refreshes the
    predictions and the measurement, so a load that drops or a stretch of easy text reopens it. A probe whose round
    still predicts that drafting does not pay doubles the wait before the next one (up to `max_probe_interval`),
    since on text the drafter cannot follow each probe is a draft pass for nothing; a round that pays resets it to
    `probe_interval`. Verifies are priced padded to their cheapest width within the caps (`drafting_pays` with
    `max_tokens`).

    The measurement (with a measured draft cost, `draft_seconds=None`, and a driver that reports each round's end,
    `end_round`): the wall time per committed token of drafted rounds and of plain rounds, exponentially weighted
    (`RoundCosts`, on `clock`). A profile taken on a quiet machine says nothing about a machine that another process
    now shares, so where drafted rounds measured dearer per token than plain ones, the round is plain whatever the
    prediction; the probes above re-measure drafting (a drafted round after several plain ones also feeds the drafter
    their positions, so the round after it is the one measured), and one that measures cheaper than plain keeps the
    wait at `probe_interval`. While drafting, every `plain_probe_interval`-th round is plain, so that the plain cost
    it is held against stays current. A drafted round's tokens are measured against what its calibrated confidences
    expected, worth `prior_rounds` rounds (`RoundCosts`): timing says what the load costs, the confidences what a
    round commits, until enough rounds have been counted. Which rounds draft never changes the tokens (a plain round
    is lossless), so the gate may use timing freely.
    """

    def __init__(
        self,
        sps: SPS,
        draft_seconds: float | Callable[[int], float] | None = None,
        probe_interval: int = 8,
        max_probe_interval: int = 64,
        plain_probe_interval: int = 32,
        weight: float = 0.3,
        clock: Callable[[], float] = time.perf_counter,
        memory: GateMemory | None = None,
        prior_rounds: float = 8.0,
    ):
        if draft_seconds is not None and not callable(draft_seconds):
            if isinstance(draft_seconds, bool) or not isinstance(draft_seconds, (int, float)) or draft_seconds < 0:
                raise ValueError(f"`draft_seconds` must be None, seconds >= 0 or a callable, got {draft_seconds!r}.")
        for name, value in (
            ("probe_interval", probe_interval),
            ("max_probe_interval", max_probe_interval),
            ("plain_probe_interval", plain_probe_interval),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if max_probe_interval < probe_interval:
            raise ValueError(
                f"`max_probe_interval` ({max_probe_interval}) must be at least `probe_interval` ({probe_interval})."
            )
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"`weight` must lie in (0, 1], got {weight!r}.")
        self.sps, self.draft_seconds = SPSCurve.of(sps), draft_seconds
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.plain_probe_interval, self.clock = plain_probe_interval, clock
        self.memory = GateMemory() if memory is None else memory
        self.measured = self.memory.draft_seconds  # rows -> smoothed seconds of a draft pass
        self.plain_in_a_row = 0
        self.drafted_in_a_row = 0
        # plain rounds before the next probe (backs off while probes fail); a call that starts where the last one
        # left the gate shut keeps its rounds plain until then (`GateMemory`)
        self.wait = min(max(self.memory.wait or probe_interval, probe_interval), max_probe_interval)
        self.started_shut = self.memory.shut  # until its first probe
        self.probing = False  # the last drafted round was a probe
        # drafted / plain round costs start afresh each call: a cold first call must not keep later ones plain
        self.rounds = {True: RoundCosts(weight, prior_rounds=prior_rounds), False: RoundCosts(weight)}
        self.expected: float | None = None  # tokens the open drafted round's confidences expect (`record`)
        self.round: tuple | None = None  # (start, drafted, rows, probe, measured) of the open round
        self.confirm = False  # the last round drafted after plain ones, unmeasured: draft this one to measure it
        self.measured_gated = 0  # rounds made plain because drafted rounds measured dearer per token
        self.never_pays: dict[tuple[int, ...], bool] = {}  # caps -> `_never_pays`' verdict (the profile is fixed)

    @property
    def prior(self) -> list[float] | None:
        return self.memory.prior

    @prior.setter
    def prior(self, value: list[float] | None) -> None:
        self.memory.prior = value

    def should_draft(self, hints: Sequence[Sequence[float] | None], caps: Sequence[int]) -> bool:
        """hints[r]: request r's conditional confidences of its last drafted round (None if it has none);
        caps[r]: drafts it may verify this round. False means: make this round a plain step."""
        start = self.clock()
        probe = self.plain_in_a_row >= self.wait
        after_plain = self.plain_in_a_row  # plain rounds since the last drafted one (the drafter catches up on them)
        confirm, self.confirm = self.confirm, False
        decision = self._decide(hints, caps, confirm)
        # a drafted round after several plain ones also feeds their positions to the drafter: not a typical round's
        # cost, so it is not measured, and the next round drafts too (when predicted to pay) to be measured instead
        measured = not (decision and after_plain > 1)
        self.confirm = decision and not measured
        self.round = (start, decision, len(hints), decision and (probe or confirm), measured)
        if decision:
            self.drafted_in_a_row += 1
        else:
            self.drafted_in_a_row = 0
        return decision

    def _decide(self, hints, caps, confirm: bool = False) -> bool:
        decision = self._decision(hints, caps, confirm)
        if decision and not self.probing:
            self.memory.shut = False
        elif not decision and self.plain_in_a_row >= 2:
            self.memory.shut = True
        self.memory.wait = self.wait
        return decision

    def _decision(self, hints, caps, confirm: bool) -> bool:
        rows = len(hints)
        if self._never_pays(caps):  # not even a free draft that is always accepted: no draft pass, no probe
            return False
        seconds = self.cost(rows)
        if seconds is None or self.prior is None:
            return True
        if self.plain_in_a_row >= self.wait:
            self.probing, self.started_shut = True, False
            return True
        if self.started_shut:  # shut when the last call ended: plain until the first probe
            return self._plain()
        predicted = [(self.prior if hint is None else hint)[:cap] for hint, cap in zip(hints, caps)]
        if drafting_pays(predicted, self.sps, self._in_profile_time(seconds, rows), max_tokens=len(caps) + sum(caps)):
            if confirm:  # measure the round after a probe; the probe's outcome is decided after it
                return True
            if not self._measured_dearer(rows):
                self.wait, self.probing = self.probe_interval, False
                return True
            self.measured_gated += 1
            self._say_measured_dearer(rows)
        return self._plain()

    def _in_profile_time(self, seconds: float, rows: int) -> float:
        """A measured draft pass's `seconds` in the SPS profile's time: scaled by the profile's plain step over the
        plain round measured in this call. The profile gives the shape of the verify cost (a width's cost against one
        token's) but was taken on another machine, or this one under another load, and a round does more than its
        forward: priced against the profile's step as it is, a draft pass measured here was weighed against a step
        up to a third faster than this machine's (the shipped profile against a busy 2-core VM), which kept the gate
        shut where drafting paid (`make demo`). Only the measured price is scaled (a given `draft_seconds` is in the
        profile's time already), within 4x either way; unscaled until a plain round of this row count is measured."""
        plain = self.rounds[False].seconds.get(rows) if self.draft_seconds is None else None
        if not plain:
            return seconds
        return seconds * min(max((1.0 / self.sps(rows)) / plain, 0.25), 4.0)

    def _never_pays(self, caps: Sequence[int]) -> bool:
        """Whether the profile says no draft can pay at these caps: drafts that cost nothing and are always accepted,
        verified at any length up to their caps, commit fewer tokens per second than plain steps. So it is where a
        verified token costs a whole step or more (PyTorch's dynamic int8 target, whose verifies compute token by
        token, `weights.per_token_activations`): a draft pass and its probes would only cost time. Logged once per
        drafter and target."""
        key = tuple(caps)
        verdict = self.never_pays.get(key)
        if verdict is None:
            certain = [[1.0] * cap for cap in caps]
            try:
                verdict = max(caps, default=0) > 0 and not drafting_pays(
                    certain, self.sps, 0.0, max_tokens=len(caps) + sum(caps)
                )
            except ValueError:  # wider than the profile covers: the prediction decides, as for any round
                verdict = False
            self.never_pays[key] = verdict
        if verdict and "never pays" not in self.memory.told:
            self.memory.told.add("never pays")
            logger.info(
                "The draft gate keeps every round a plain decoding step: on this target's cost profile a verified "
                "token costs as much as a decoding step, so not even drafts that are always accepted would pay."
            )
        return verdict

    def _say_measured_dearer(self, rows: int) -> None:
        """One info line, once per drafter and target, when measured round times have made `MEASURED_GATED_TOLD`
        rounds of a call plain: what was measured, and what would reopen the gate."""
        if self.measured_gated < MEASURED_GATED_TOLD or "measured dearer" in self.memory.told:
            return
        drafted, plain = self.rounds[True].per_token(rows), self.rounds[False].per_token(rows)
        if drafted is None or plain is None or drafted <= plain:
            return  # plain rounds taken only to re-measure the plain cost
        self.memory.told.add("measured dearer")
        logger.info(
            f"The draft gate is making rounds plain decoding steps: drafted rounds measured {1e3 * drafted:.1f} ms "
            f"per committed token against {1e3 * plain:.1f} ms for plain ones (another process on these cores, or "
            "text the drafter does not follow). Output unchanged; it drafts again once a probe measures cheaper."
        )

    def _plain(self) -> bool:
        if self.probing:  # the probe found nothing worth drafting: wait longer for the next one
            self.wait, self.probing = min(2 * self.wait, self.max_probe_interval), False
        self.plain_in_a_row += 1
        return False

    def _measured_dearer(self, rows: int) -> bool:
        """Whether measured round times say this round should be plain: drafted rounds dearer per token than plain
        ones, or a plain round due to keep the plain cost current (only with the measured draft cost)."""
        if self.draft_seconds is not None:
            return False
        drafted, plain = self.rounds[True].per_token(rows), self.rounds[False].per_token(rows)
        if drafted is None:
            return False
        if plain is None or self.drafted_in_a_row >= self.plain_probe_interval:
            return True  # a plain round to measure (or re-measure) what drafting is held against
        return drafted > plain

    def end_round(self, tokens: int, measured: bool = True) -> None:
        """After the round that `should_draft` opened: how many tokens it committed over all rows; `measured=False`
        for a round that is not typical of its kind (the verify tried another kernel), left out of the costs."""
        if self.round is None:
            return
        start, drafted, rows, probe, typical = self.round
        self.round = None
        seconds = self.clock() - start
        expected, self.expected = self.expected, None
        if not (typical and measured):
            return
        self.rounds[drafted].add(rows, seconds, tokens, expected if drafted else None)
        plain = self.rounds[False].per_token(rows)
        if probe and plain is not None and seconds / max(tokens, 1) <= plain:
            # the probe measured cheaper: open, and look again soon
            self.wait, self.probing = self.probe_interval, False
            self.memory.shut, self.memory.wait = False, self.wait

    def cost(self, n_rows: int) -> float | None:
        if self.draft_seconds is None:
            return self.measured.get(n_rows)
        return float(self.draft_seconds(n_rows) if callable(self.draft_seconds) else self.draft_seconds)

    def record(
        self, seconds: float, confidences: Sequence[Sequence[float]], lengths: Sequence[int] | None = None
    ) -> None:
        """After a drafted round's draft pass: its wall time and every row's conditional confidences (the new
        hints); `lengths`: the drafts each row verifies (the round's expected tokens then weigh in its measurement):
        a chain's first positions, or a tree's first nodes in join order, whose conditionals multiply up to the
        nodes' path estimates, so that the same sum is the tree's expected accepted depth. The first pass at a row
        count is a warm-up (first kernels, packed weights) and is not priced; later ones are averaged, a pass cheaper
        than the average weighted 0.5, a dearer one 0.2."""
        rows = len(confidences)
        self.expected = None
        if lengths is not None:  # each row commits its bonus token plus the expected accepted prefix
            self.expected = sum(1.0 + expected_depth(c, n) for c, n in zip(confidences, lengths))
        passes = self.memory.draft_passes[rows] = self.memory.draft_passes.get(rows, 0) + 1
        if passes > 1:
            previous = self.measured.get(rows)
            # another process on the cores only ever adds time: a pass cheaper than the average moves it faster, so a
            # load that leaves reopens the gate within a few probes
            weight = 0.2 if previous is None or seconds >= previous else 0.5
            self.measured[rows] = seconds if previous is None else (1 - weight) * previous + weight * seconds
        columns = itertools.zip_longest(*confidences)
        mean = [statistics.fmean(c for c in column if c is not None) for column in columns]
        self.prior = mean + (self.prior or [])[len(mean) :]
        self.plain_in_a_row = 0


__all__ = ["DraftGate", "GateMemory", "RoundCosts", "drafting_pays"]
