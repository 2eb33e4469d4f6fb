"""Acceptance statistics of one `generate()` call (kept on `drafter.generation_stats`), and per-round timings."""

import contextlib
from dataclasses import dataclass, field


@dataclass
class DSparkGenerationStats:
    """Per-call counters of speculative decoding.

    A *step* is one target verify pass (the prefill is not a step). At step i the target verified
    `verify_lengths[i]` draft tokens (0..γ) and `accepted_lengths[i]` of them were committed, plus one bonus
    token from the target. `stopped[i]` marks a step cut short by EOS or the length limit, whose unaccepted
    drafts say nothing about the drafter and are left out of the per-position rates. `gated_rounds` counts the
    steps the draft gate made plain (no draft pass; verify length 0 unless the row verified a lookup draft),
    `lookup_rounds` those that verified a chain from the context lookup rather than the drafter's
    (`decoding/lookup.py`), `fewer_threads_rounds` those run at fewer intra-op threads than the caller's because
    that measured faster (tries left out) (a machine another process shares, `kernels/threads.py`).

    With draft trees (`tree_budget`) `verify_lengths[i]` counts the tree nodes verified, `accepted_lengths[i]` the
    accepted depth and `verify_depths[i]` the deepest node verified (for a chain it equals `verify_lengths[i]`); the
    per-position rates then go by depth.
    """

    block_size: int
    num_prompt_tokens: int = 0
    num_new_tokens: int = 0
    verify_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)
    survivals: list[list[float]] = field(default_factory=list)
    gated_rounds: int = 0
    lookup_rounds: int = 0
    fewer_threads_rounds: int = 0
    verify_depths: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # per step: "drafter" or "lookup", where its drafts came from
    committed: list[int] = field(default_factory=list)  # per step: tokens committed (accepted + bonus, clipped)

    def record_step(
        self,
        verified: int,
        accepted: int,
        stopped: bool = False,
        survival=None,
        depth=None,
        source: str = "drafter",
        committed: int | None = None,
    ) -> None:
        """One verify pass; `survival` is the calibrated cumulative survival of the positions the drafter examined
        (kept for calibration checks and the what-if simulator); `depth`: a tree's deepest verified node; `source`:
        "drafter" or "lookup" (a context lookup's chain, `lookup.py`); `committed`: the tokens the step committed
        (default: the accepted drafts and the bonus; fewer where the row stopped)."""
        depth = verified if depth is None else depth
        if not 0 <= accepted <= min(verified, depth):
            raise ValueError(f"accepted ({accepted}) must lie in 0..verified ({verified}) and 0..depth ({depth}).")
        if source not in ("drafter", "lookup"):
            raise ValueError(f"source must be 'drafter' or 'lookup', got {source!r}.")
        self.sources.append(source)
        self.committed.append(accepted + 1 if committed is None else committed)
        self.verify_depths.append(depth)
        self.verify_lengths.append(verified)
        self.accepted_lengths.append(accepted)
        self.stopped.append(stopped)
        self.survivals.append(list(survival or []))

    def token_origins(self) -> list[tuple[str, int]]:
        """How each new token of a one-row call was committed, in order: ("target", 0) for the target's own token
        (the prefill's first and each step's bonus), ("drafter", k) or ("lookup", k) for a draft accepted at depth k
        (1-based). For a batch the rows' steps are pooled, so this is meaningful for batch 1 only."""
        origins = [("target", 0)] if self.num_new_tokens else []
        sources = self.sources if len(self.sources) == len(self.accepted_lengths) else ["drafter"] * len(self.sources)
        for accepted, committed, source in zip(self.accepted_lengths, self.committed, sources):
            origins += [(source, k) for k in range(1, min(accepted, committed) + 1)]
            origins += [("target", 0)] * (committed > accepted)
        return origins[: self.num_new_tokens]

    @property
    def num_target_forwards(self) -> int:
        """Verify passes of the target (prefill excluded)."""
        return len(self.verify_lengths)

    @property
    def acceptance_length(self) -> float:
        """τ: tokens committed per verify pass, the bonus token included (the paper's convention)."""
        steps = self.num_target_forwards
        return (sum(self.accepted_lengths) + steps) / steps if steps else 0.0

    def position_counts(self) -> tuple[list[int], list[int]]:
        """(reached, accepted) per block position k = 1..γ: drafts verified at k with 1..k-1 accepted."""
        reached, accepted = [0] * self.block_size, [0] * self.block_size
        for ver, acc, stop in zip(self.depths, self.accepted_lengths, self.stopped):
            last = ver if not stop else acc  # a stopped step's rejection is not the drafter's
            for k in range(min(last, acc + 1)):
                reached[k] += 1
                accepted[k] += k < acc
        return reached, accepted

    @property
    def per_position_acceptance(self) -> list[float | None]:
        """Conditional acceptance rate per block position (None where no draft reached it)."""
        reached, accepted = self.position_counts()
        return [a / r if r else None for r, a in zip(reached, accepted)]

    @property
    def acceptance_length_by_draft_length(self) -> list[float | None]:
        """τ(L) for L = 1..γ, had every round verified at most L drafts: 1 + Σ_{k≤L} Π_{j≤k} a_k from the
        conditional rates a_k (None from the first position no draft reached).

        Under the fixed full-block policy the product telescopes to 1 + mean(min(accepted, L)) per round, so τ(γ) is
        the measured τ (rounds cut by EOS or the length limit aside). Under a confidence policy the rates are
        conditional on being verified, which makes τ(L) past the usual cut optimistic.
        """
        curve, tau, survive = [], 1.0, 1.0
        for rate in self.per_position_acceptance:
            if rate is None:
                break
            survive *= rate
            tau += survive
            curve.append(tau)
        return curve + [None] * (self.block_size - len(curve))

    @property
    def depths(self) -> list[int]:
        """Deepest draft position verified per step (`verify_lengths` for stats recorded without depths)."""
        return self.verify_depths if len(self.verify_depths) == len(self.verify_lengths) else self.verify_lengths

    @property
    def mean_accepted_depth(self) -> float:
        steps = self.num_target_forwards
        return sum(self.accepted_lengths) / steps if steps else 0.0

    @property
    def mean_verify_length(self) -> float:
        steps = self.num_target_forwards
        return sum(self.verify_lengths) / steps if steps else 0.0

    def to_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_new_tokens": self.num_new_tokens,
            "num_target_forwards": self.num_target_forwards,
            "acceptance_length": self.acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "mean_verify_length": self.mean_verify_length,
            "mean_accepted_depth": self.mean_accepted_depth,
            "verify_lengths": list(self.verify_lengths),
            "verify_depths": list(self.depths),
            "accepted_lengths": list(self.accepted_lengths),
            "stopped": list(self.stopped),
            "survivals": [list(x) for x in self.survivals],
            "gated_rounds": self.gated_rounds,
            "lookup_rounds": self.lookup_rounds,
            "fewer_threads_rounds": self.fewer_threads_rounds,
        }

    def merge(self, other: "DSparkGenerationStats") -> "DSparkGenerationStats":
        """Pool two calls' steps (for dataset-level τ and per-position rates)."""
        merged = DSparkGenerationStats(
            self.block_size,
            self.num_prompt_tokens + other.num_prompt_tokens,
            self.num_new_tokens + other.num_new_tokens,
        )
        for s in (self, other):
            merged.verify_depths += s.depths
            merged.verify_lengths += s.verify_lengths
            merged.accepted_lengths += s.accepted_lengths
            merged.stopped += s.stopped
            merged.sources += s.sources
            merged.committed += s.committed
            merged.survivals += s.survivals
            merged.gated_rounds += s.gated_rounds
            merged.lookup_rounds += s.lookup_rounds
            merged.fewer_threads_rounds += s.fewer_threads_rounds
        return merged


@dataclass
class DraftRound:
    """One drafting round, for the evaluation harness.

    start: `time.perf_counter()` when drafting began; seconds: wall time of the drafting (the verify follows it);
    proposed: drafts the round verified (summed over the batch); accepted: those the target accepted (None until
    known); first: a round before the target's first forward (transformers' own assistants draft from the prompt);
    verify_seconds: wall time of the target's verify pass, and end: `time.perf_counter()` when the round was
    committed (both None where the decoder does not log them, e.g. transformers' own assistants), so a round's time
    splits into drafting, verifying and the rest (acceptance, commit, cache bookkeeping).
    """

    start: float
    seconds: float
    proposed: int
    first: bool = False
    accepted: int | None = None
    verify_seconds: float | None = None
    end: float | None = None


RECORDERS: list[list[DraftRound]] = []


@contextlib.contextmanager
def record_draft_rounds():
    """Within the block, every speculative round (of any decoder in this process) appends a `DraftRound` to the
    yielded list."""
    rounds: list[DraftRound] = []
    RECORDERS.append(rounds)
    try:
        yield rounds
    finally:
        RECORDERS.remove(rounds)
