"""Offline what-if simulator: replay logged rounds against another SPS profile, policy and concurrency.

A log is what `generate()` leaves in `drafter.generation_stats` (or a bench JSON's per-prompt stats): for every
verify step the calibrated survival of each examined position, how many drafts were verified and how many of them
the target accepted. Replaying asks "what if this hardware (SPS profile) ran this policy at this concurrency?"
without running the target again, to choose γ and the budget before deploying.

Acceptance is only known inside what was verified: a replayed step that would verify more drafts than the logged
one is capped at the logged length (log with verify_policy="fixed" for the least biased replay).
"""

import random
from collections.abc import Callable
from dataclasses import dataclass

from ..decoding.scheduler import SPS, SPSCurve, prefix_schedule


@dataclass
class LoggedStep:
    survival: list[float]  # calibrated cumulative survival a_1..a_m of the examined positions
    verified: int  # drafts verified when logged
    accepted: int  # of which accepted


def steps_from_stats(stats) -> list[LoggedStep]:
    """LoggedSteps from a `DSparkGenerationStats` (or its `to_dict()`), leaving out steps cut by EOS/length."""
    d = stats if isinstance(stats, dict) else stats.to_dict()
    rows = zip(d["survivals"], d["verify_lengths"], d["accepted_lengths"], d.get("stopped") or [False] * 10**9)
    return [LoggedStep(list(s), v, a) for s, v, a, stop in rows if not stop]


def _policy_lengths(policy, batch: list[LoggedStep], sps) -> list[int]:
    if policy == "fixed":
        return [step.verified for step in batch]
    if isinstance(policy, float):  # a survival threshold
        return [sum(1 for a in step.survival[: step.verified] if a >= policy) for step in batch]
    if policy == "scheduler":  # Algorithm 1 across the batch, on conditional acceptances c_k = a_k / a_{k-1}
        confidences = []
        for step in batch:
            prev, conf = 1.0, []
            for a in step.survival[: step.verified]:
                conf.append(min(a / prev, 1.0) if prev > 0 else 0.0)
                prev = a
            confidences.append(conf)
        return prefix_schedule(confidences, sps)
    raise ValueError(f"Unknown policy {policy!r}: use 'fixed', 'scheduler' or a float threshold.")


def simulate(
    steps: list[LoggedStep],
    sps: SPS,
    policy: str | float = "scheduler",
    concurrency: int = 1,
    draft_seconds: float | Callable[[int], float] = 0.0,
    rounds: int | None = None,
    seed: int = 0,
) -> dict:
    """Replay `steps` in batches of `concurrency` requests. Returns per-user and aggregate tokens/s.

    Each simulated round draws `concurrency` logged steps, picks verify lengths with `policy`, costs one target
    step at B = Σ(1 + ℓ_r) tokens (1 / SPS(B) seconds) plus `draft_seconds` (per round, or a function of the batch
    size), and commits min(ℓ_r, accepted_r) + 1 tokens per request.
    """
    if not steps:
        raise ValueError("No logged steps to replay.")
    lookup = SPSCurve.of(sps)
    rng = random.Random(seed)
    rounds = rounds or max(1, len(steps) // concurrency)
    total_tokens = total_time = verified = 0.0
    for _ in range(rounds):
        batch = [rng.choice(steps) for _ in range(concurrency)]
        lengths = _policy_lengths(policy, batch, lookup)
        tokens = sum(min(length, step.accepted) + 1 for length, step in zip(lengths, batch))
        seconds = 1.0 / lookup(sum(1 + length for length in lengths))
        seconds += draft_seconds(concurrency) if callable(draft_seconds) else draft_seconds
        total_tokens, total_time, verified = total_tokens + tokens, total_time + seconds, verified + sum(lengths)
    aggregate = total_tokens / total_time
    return {
        "policy": policy,
        "concurrency": concurrency,
        "aggregate_tokens_per_second": aggregate,
        "per_user_tokens_per_second": aggregate / concurrency,
        "acceptance_length": total_tokens / (rounds * concurrency),
        "mean_verify_length": verified / (rounds * concurrency),
    }


__all__ = ["LoggedStep", "steps_from_stats", "simulate"]
