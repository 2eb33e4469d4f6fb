"""`VerifyPolicy`: how many of its drafts each row verifies, resolved once per decoder.

"fixed" verifies the whole (capped) block; "threshold" stops at the first position whose calibrated cumulative
survival a_k falls below `confidence_threshold`; "scheduler" runs DSpark's Algorithm 1 over all rows against the
target's steps-per-second profile (`scheduler.prefix_schedule`). Under "scheduler" the draft gate
(`gate.DraftGate`) may also skip a round's draft when a plain step is expected to be faster. A drafter without
a confidence head has no survivals to go by and verifies its whole block whatever the policy.

Every rule decides position k from survivals of positions <= k (and other rows' survivals), never from the draft
x_k itself, so cutting a block stays lossless.

Draft trees (`decoding/trees.py`) go through the same rules: their nodes, in join order, have non-increasing path
estimates a_i, which play the survivals' part. The expected accepted depth of verifying a tree's first n nodes is
Σ_{i<=n} a_i, as a chain's expected accepted length is the sum of its survivals, so Algorithm 1 weighs nodes across
the batch against the verify cost by total width exactly as it weighs chain positions; where width is expensive it
keeps a few best nodes (the top chain's first positions, mostly).
"""

import itertools
import math
import operator
from collections.abc import Callable, Sequence

from transformers.utils import logging

from ..kernels.runtime import runtime_for
from ..models.configuration_dspark import VERIFY_POLICIES
from ..models.settings import AUTO_TREE_WIDTH_COST, largest_tree
from .gate import DraftGate, GateMemory
from .scheduler import SPS, SPSCurve, prefix_schedule, settled_prefix_schedule


logger = logging.get_logger(__name__)


class VerifyPolicy:
    """One decoder's verify policy.

    Args:
        name: "fixed" | "threshold" | "scheduler".
        threshold: the survival threshold of "threshold".
        sps: Algorithm 1's profile (an `SPSCurve`) for "scheduler".
        gate: a `DraftGate` (only under "scheduler"), or None.
    """

    def __init__(
        self, name: str, *, threshold: float = 0.0, sps: SPSCurve | None = None, gate: DraftGate | None = None
    ):
        if name not in VERIFY_POLICIES:
            raise ValueError(f"Unknown verify_policy={name!r}; choose one of {list(VERIFY_POLICIES)}.")
        if name == "scheduler" and sps is None:
            raise ValueError('verify_policy="scheduler" needs a steps-per-second profile of the target (`sps`).')
        self.name, self.threshold, self.sps, self.gate = name, threshold, sps, gate

    @classmethod
    def for_drafter(
        cls,
        drafter,
        target,
        verify_policy: str | None = None,
        *,
        sps: SPS | None = None,
        max_rows: int = 1,
        gate_drafts: bool | None = None,
        draft_seconds: float | Callable[[int], float] | None = None,
    ) -> "VerifyPolicy":
        """The policy `drafter` runs with on `target`: `verify_policy` (None: the drafter's config), the SPS profile
        (None: `profiling.sps_for`, the checkpoint's profile or a quick one) covering `max_rows` full blocks, and
        the gate (None: `config.draft_gate` under "scheduler")."""
        config = drafter.config
        name = verify_policy if verify_policy is not None else getattr(config, "verify_policy", "fixed")
        if name not in VERIFY_POLICIES:
            raise ValueError(f"Unknown verify_policy={name!r}; choose one of {list(VERIFY_POLICIES)}.")
        if gate_drafts is not None and not isinstance(gate_drafts, bool):
            raise TypeError(f"`gate_drafts` must be a bool or None, got {gate_drafts!r}.")
        if not getattr(config, "confidence_head", False):
            name = "fixed"  # no survival estimates: verify the whole block
        if gate_drafts and name != "scheduler":
            raise ValueError(
                f"gate_drafts=True needs verify_policy='scheduler' (it weighs a draft against the SPS profile); "
                f"the policy here is {name!r}."
            )
        if name != "scheduler":
            if draft_seconds is not None:
                raise ValueError("`draft_seconds` prices the draft gate, which is off here; pass gate_drafts=True.")
            return cls(name, threshold=getattr(config, "confidence_threshold", 0.0))
        if sps is None:
            from .profiling import sps_for

            sps = sps_for(drafter, target)
        width = max(config.block_size, largest_tree(getattr(config, "tree_budget", 0)))  # a tree: up to its budget
        curve = SPSCurve(covering_sps(sps, max_rows * (width + 1)))
        if gate_drafts is None:
            gate_drafts = bool(getattr(config, "draft_gate", True))
        if draft_seconds is not None and not gate_drafts:
            raise ValueError("`draft_seconds` prices the draft gate, which is off here; pass gate_drafts=True.")
        if not gate_drafts:
            return cls(name, sps=curve)
        memory = gate_memory(drafter, target) if draft_seconds is None else None
        return cls(name, sps=curve, gate=DraftGate(curve, draft_seconds, memory=memory))

    # -- what a round asks of its policy: whether to draft, how many drafts to verify, and what the round cost --

    def should_draft(self, hints: Sequence[Sequence[float] | None], caps: Sequence[int]) -> bool:
        """Whether this round drafts: always, unless the draft gate expects a plain step to be faster (`hints`: each
        row's last confidences; `caps`: the drafts each row may take)."""
        return self.gate is None or self.gate.should_draft(hints, caps)

    def record_draft(self, seconds: float, conditional: Sequence[Sequence[float]], lengths: Sequence[int]) -> bool:
        """A draft pass took `seconds` and the policy chose `lengths`: the gate learns from it. Returns whether a gate
        listened (the round then keeps the confidences as the rows' hints for the next decision)."""
        if self.gate is None:
            return False
        self.gate.record(seconds, conditional, lengths)
        return True

    def end_round(self, tokens: int, measured: bool = True) -> None:
        """The round committed `tokens` (every row's, bonus included); `measured`: its time is typical (no kernel or
        thread count on trial), so the gate may price rounds by it."""
        if self.gate is not None:
            self.gate.end_round(tokens, measured=measured)

    def width_cost(self, tokens: int) -> float:
        """What a verify of `tokens` tokens costs in one-token steps, on this policy's profile ("scheduler" only)."""
        return self.sps(1) / self.sps(tokens)

    def prices_trees(self, nodes: int) -> bool:
        """Whether `tree_budget="auto"` may draft trees of `nodes` nodes under this policy: Algorithm 1 prices every
        node against the profile, and the profile makes a verify of `nodes` + 1 tokens cost at most
        `AUTO_TREE_WIDTH_COST` one-token steps (width cheap enough that some nodes can pay for themselves)."""
        return self.name == "scheduler" and self.width_cost(nodes + 1) <= AUTO_TREE_WIDTH_COST

    @property
    def stops_early(self) -> bool:
        """Whether sampling a block can stop once the positions seen settle every row's verify length."""
        return self.name != "fixed"

    def settled(self, conditional: Sequence[Sequence[float]], caps: Sequence[int]) -> bool:
        """Whether the positions sampled so far already decide every row's verify length.

        conditional[r][k]: c_{r,k+1} of the positions row r has sampled. The survivals a_{r,K} of rows with positions
        left bound every later survival; "threshold" is settled when they all fall below the threshold, Algorithm 1
        when its greedy stops above them (`settled_prefix_schedule`). "fixed" is never settled early.
        """
        seen = max((len(c) for c in conditional), default=0)
        rows = [list(c[:cap]) for c, cap in zip(conditional, caps)]
        bound = max((math.prod(c) for c, cap in zip(rows, caps) if cap > seen), default=0.0)
        if self.name == "threshold":
            return bound < self.threshold
        if self.name == "scheduler":
            return settled_prefix_schedule(rows, self.sps, bound, max_tokens=len(caps) + sum(caps)) is not None
        return False

    def settled_width(self, conditional: Sequence[Sequence[float]], caps: Sequence[int]) -> int | None:
        """The most drafts any row will verify, once the positions seen settle every row's length; else None."""
        if not self.settled(conditional, caps):
            return None
        return max(self.lengths(conditional, caps), default=0)

    def lengths(self, conditional: Sequence[Sequence[float]], caps: Sequence[int]) -> list[int]:
        """Drafts each row verifies, ℓ_r <= min(cap_r, positions sampled).

        The verify runs on W = max ℓ_r + 1 tokens per row whatever the shorter rows chose, so each row then fills its
        slots up to W with its own further drafts (those it sampled, within its cap): more drafts checked at no extra
        cost. Whether row r's draft k is verified still depends only on its drafts before k, so this stays lossless.
        """
        sampled = [min(len(c), cap) for c, cap in zip(conditional, caps)]
        if self.name == "fixed":
            return list(caps)
        if self.name == "threshold":
            survivals = [itertools.accumulate(c[:n], operator.mul) for c, n in zip(conditional, sampled)]
            chosen = [sum(1 for _ in itertools.takewhile(lambda a: a >= self.threshold, s)) for s in survivals]
        else:  # Algorithm 1 over the batch; `reach`: the widest verify the sampled drafts can fill
            reach = len(caps) + sum(sampled)
            chosen = prefix_schedule([c[:n] for c, n in zip(conditional, sampled)], self.sps, max_tokens=reach)
            if len(chosen) == 1:  # pad a lone row's verify to its cheapest width (acts after a zero survival)
                chosen = [self.sps.width(chosen[0] + 1, reach) - 1]
        width = max(chosen, default=0)
        return [min(width, n) for n in sampled]


def covering_sps(sps: SPS, max_tokens: int) -> SPS:
    """An SPS lookup defined up to `max_tokens` (the largest possible verify batch). A table that stops short is
    extended by assuming verify time grows linearly beyond its largest entry (conservative), with a warning."""
    if callable(sps):
        return sps
    table = {int(b): float(s) for b, s in dict(sps).items()}
    largest = max(table)
    if largest >= max_tokens:
        return table
    logger.warning_once(
        f"The SPS profile covers verify batches up to {largest} tokens, the decoder may verify {max_tokens}: "
        "assuming time grows linearly beyond. Profile larger batches (`dspark-hf profile`) for a precise schedule."
    )
    lookup = SPSCurve(table)
    return lambda b: lookup(b) if b <= largest else table[largest] * largest / b


def gate_memory(drafter, target) -> GateMemory:
    """The draft gate's measurements for `drafter` on `target`, in the target's `TargetRuntime`: kept across
    `generate()` calls while both live (a new target starts afresh), never on either model."""
    gates = runtime_for(target).gates
    memory = gates.get(drafter)
    if memory is None:
        memory = gates[drafter] = GateMemory()
    return memory


__all__ = ["VerifyPolicy", "covering_sps", "gate_memory"]
