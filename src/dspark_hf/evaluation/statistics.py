"""How far a benchmark's numbers can be trusted: bootstrap intervals over its prompts.

τ and speed differ far more between prompts than between runs: on the long-context sets one prompt's τ runs from 1.2
to 4.1 at the same length. With 8 prompts a length, a ratio of two lengths' τ is known to about ±20 %, so a
difference of 5 % is not seen. `bootstrap_interval` says how wide that uncertainty is; `paired_ratio_interval`
resamples the same prompt indices in both sets, which is what comparing lengths built from the same documents
(`long_context`) calls for.
"""

import random
from collections.abc import Callable, Sequence


SAMPLES = 2000
LEVEL = 0.95


def bootstrap_interval(
    statistic: Callable[[list[int]], float],
    n: int,
    samples: int = SAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> tuple[float, float] | None:
    """The percentile interval of `statistic(indices)` over `samples` draws of `n` indices with replacement (seeded,
    so a report is reproducible); None for fewer than 2 items, where resampling says nothing."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"`level` must lie in (0, 1), got {level!r}.")
    if n < 2:
        return None
    rng = random.Random(seed)
    values = sorted(statistic([rng.randrange(n) for _ in range(n)]) for _ in range(samples))
    tail = (1.0 - level) / 2
    return values[int(tail * (samples - 1))], values[round((1.0 - tail) * (samples - 1))]


def ratio_of_sums(numerators: Sequence[float], denominators: Sequence[float]) -> Callable[[list[int]], float]:
    """statistic(indices) = Σ numerators / Σ denominators over `indices` (a pooled rate such as τ or a speedup)."""

    def statistic(indices: list[int]) -> float:
        below = sum(denominators[i] for i in indices)
        return sum(numerators[i] for i in indices) / below if below else float("nan")

    return statistic


def paired_ratio_interval(
    top: Callable[[list[int]], float], bottom: Callable[[list[int]], float], n: int, **kwargs
) -> tuple[float, float] | None:
    """The interval of top(indices) / bottom(indices) with one draw of indices used for both: two sets whose i-th
    prompts belong together (the same document at two lengths)."""
    return bootstrap_interval(lambda indices: top(indices) / bottom(indices), n, **kwargs)


__all__ = ["LEVEL", "SAMPLES", "bootstrap_interval", "paired_ratio_interval", "ratio_of_sums"]
