"""How many drafts to verify: fixed, confidence threshold, and DSpark's Algorithm 1 (hardware-aware prefix schedule).

All policies decide position k from survival probabilities of positions <= k only, never from later drafts;
Algorithm 1's early stop is what guarantees that (DSpark paper §3.2.2 and App. A).
"""

from collections.abc import Callable, Mapping, Sequence


SPS = Mapping[int, float] | Callable[[int], float]


class SPSCurve:
    """A target's verify speed SPS(B), steps per second of a verify of B tokens (anchors included), from a profile
    table or a function, and the same curve for verifies that further drafts can pad.

    A table answers an unprofiled B with the next profiled size (conservative) and rejects B beyond its largest.
    `lookup(max_tokens)` prices a verify of B tokens at the best rate of any width in [B, max_tokens] (the most
    tokens this verify can hold: every draft sampled, plus the anchors), and `width` names that cheapest width: a
    verify can be padded with the block's further drafts. On hardware where some widths are slower than wider ones
    (on some CPUs 2 and 3 tokens cost more than 4 or 5), Algorithm 1 then sees what a verify really costs, and its
    greedy, which cannot stop inside a stretch of equal rates while survivals are positive, ends on the cheapest
    width by itself. Each reach's padded table is built once and kept: the Engine asks every sampling step.
    """

    def __init__(self, sps: SPS):
        if callable(sps):
            self._rate = sps
        else:
            table = {int(b): float(rate) for b, rate in dict(sps).items()}
            if not table:
                raise ValueError("The SPS profile is empty: it needs {verify_tokens: steps_per_second} entries.")
            largest = max(table)

            def rate(b: int) -> float:
                if b in table:
                    return table[b]
                if b > largest:
                    raise ValueError(
                        f"The SPS profile covers verify batches up to {largest} tokens; {b} was requested."
                    )
                return table[min(k for k in table if k >= b)]

            self._rate = rate
        self._envelopes: dict[int, dict[int, tuple[float, int]]] = {}

    @classmethod
    def of(cls, sps: "SPS | SPSCurve") -> "SPSCurve":
        return sps if isinstance(sps, cls) else cls(sps)

    def __call__(self, b: int) -> float:
        return float(self._rate(b))

    def _envelope(self, max_tokens: int) -> dict[int, tuple[float, int]]:
        """Width B -> (best rate, narrowest width with it) over [B, max_tokens]; widths beyond the profile are
        skipped."""
        envelope = self._envelopes.get(max_tokens)
        if envelope is None:
            envelope, best = {}, (0.0, 0)
            for b in range(max_tokens, 0, -1):  # suffix maximum; `>=` keeps the narrowest among equal rates
                try:
                    rate = self(b)
                except ValueError:  # wider than the table covers: not a width to pad to
                    continue
                if rate >= best[0]:
                    best = (rate, b)
                envelope[b] = best
            self._envelopes[max_tokens] = envelope
        return envelope

    def lookup(self, max_tokens: int | None = None) -> Callable[[int], float]:
        """SPS(B) as a function; with `max_tokens`, the rate of a verify padded to its cheapest width in reach."""
        if max_tokens is None:
            return self
        envelope = self._envelope(max_tokens)
        return lambda b: envelope[b][0] if b in envelope else self(b)

    def width(self, tokens: int, max_tokens: int) -> int:
        """The cheapest verify width in [tokens, max_tokens]; the narrowest among equals (`verify_width`)."""
        if tokens > max_tokens:
            return tokens
        return self._envelope(max_tokens).get(tokens, (0.0, tokens))[1]


def verify_width(sps: SPS, tokens: int, max_tokens: int) -> int:
    """The cheapest verify width (tokens, anchors included) in [tokens, max_tokens]; the narrowest among equals.

    What a verify of `tokens` tokens should run as when further drafts can fill it (`SPSCurve.lookup` with
    `max_tokens` prices it so). Padding only adds drafts after the scheduled ones; whether a draft is verified
    still depends only on the drafts before it, so verification stays lossless.
    """
    return SPSCurve.of(sps).width(tokens, max_tokens)


def prefix_schedule(confidences: Sequence[Sequence[float]], sps: SPS, max_tokens: int | None = None) -> list[int]:
    """Algorithm 1: per-request verify lengths maximising Θ = τ · SPS(B), greedy with early stop.

    confidences[r][k]: calibrated conditional acceptance probability of request r at draft position k+1.
    sps: verify-batch token count B (anchors included) -> target steps per second.
    max_tokens: the widest verify the drafts can fill; when set, SPS(B) is the best rate at any width in
        [B, max_tokens] (`SPSCurve.lookup`), for a verify that is padded to its cheapest width (`verify_width`).
    Returns ℓ_r for every request.
    """
    return settled_prefix_schedule(confidences, sps, unseen_bound=0.0, max_tokens=max_tokens)


def settled_prefix_schedule(
    confidences: Sequence[Sequence[float]], sps: SPS, unseen_bound: float, max_tokens: int | None = None
) -> list[int] | None:
    """Algorithm 1 on the positions seen so far, or None while positions not yet seen could still change it.

    Lets a drafter stop sampling a block early: `confidences[r]` holds the positions of request r sampled so far,
    and `unseen_bound` is the largest cumulative survival a position not yet sampled can have (the largest last
    seen survival of the requests that have positions left; 0 when none have). The greedy admits candidates in
    order of survival, so once it stops at, or finishes on, a candidate above the bound, no unseen one can come
    first, and the result is exactly `prefix_schedule` of the whole block (with the same `max_tokens`).
    """
    lookup = SPSCurve.of(sps).lookup(max_tokens)
    candidates = []
    for r, conf in enumerate(confidences):
        survival = 1.0
        for j, c in enumerate(conf, start=1):
            if not 0.0 <= c <= 1.0:
                raise ValueError(f"confidences[{r}][{j - 1}] = {c} is not a probability.")
            survival *= c
            if survival > 0:
                candidates.append((survival, r, j))
    # Survival is non-increasing in j, so a stable sort keeps each request's positions in prefix order.
    candidates.sort(key=lambda t: -t[0])
    n_requests = len(confidences)
    lengths, best = [0] * n_requests, [0] * n_requests
    batch, expected = n_requests, float(n_requests)  # every request verifies its anchor and gains a bonus token
    best_theta = expected * lookup(batch)
    for survival, r, j in candidates:
        theta = (expected + survival) * lookup(batch + 1)
        improves = theta > best_theta
        # An unseen candidate has survival <= unseen_bound. One above this candidate could come first; one equal
        # to it could come first and be admitted in its place, but would stop the greedy just as this one does.
        if survival < unseen_bound or (survival == unseen_bound and improves):
            return None
        if not improves:
            return best  # early stop: required for losslessness
        lengths[r], batch, expected = j, batch + 1, expected + survival
        best_theta, best = theta, list(lengths)
    return best if unseen_bound <= 0 else None


def conditional_confidences(survival: Sequence[float]) -> list[float]:
    """Cumulative survivals a_1..a_m -> conditional acceptances c_k = a_k / a_{k-1} (0 once a survival is 0)."""
    previous, out = 1.0, []
    for a in survival:
        out.append(a / previous if previous > 0 else 0.0)
        previous = a
    return out


__all__ = [
    "SPSCurve",
    "conditional_confidences",
    "prefix_schedule",
    "settled_prefix_schedule",
    "verify_width",
]
