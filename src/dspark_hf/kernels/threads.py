"""How many intra-op threads a decoding round runs on, chosen by timing the rounds as they run.

Every parallel region of torch's CPU kernels ends at a barrier. On cores that another process shares, the OS
deschedules one of the region's threads, and the others wait for it at every barrier: a target forward is hundreds of
regions, so the waits add up to more than the work. One thread has no barrier to wait at. Measured with
`dspark-hf`'s default (AMD EPYC, 2 cores, `generate()` of 48 tokens, ms a token):

| | plain, 2 threads | plain, 1 | drafted, 2 | drafted, 1 |
|---|---|---|---|---|
| quiet | 56-58 | 58 | 36-41 | 49-56 |
| beside a 2-thread matmul process | 181-244 | 83-91 | 170-256 | 77-90 |

So which count is fastest depends on the load, which changes while a reply is decoded. `RoundThreads` times each
kind of round (drafted or plain, per row count) at each candidate count (rounds in a row exponentially weighted), and
runs a round at the count that measured fastest lately, another count than the caller's only where it measured at
least `margin` (25 %) faster. It tries the others early and then every `retry` rounds, a wait that doubles (up to
`max_retry`) while the tries keep losing. A count measured dearer than a stale measurement of another is left at
once, so a load that arrives is followed within a round or two; one that leaves is found by the next try. One
`RoundThreads` per target (`round_threads`) carries this across `generate()` calls.

The thread count is the process's (`torch.set_num_threads`): a round that runs at another count sets it and puts the
caller's back when it ends, exception or not. The count never changes a token: the kernels split the rows and
columns of their products between threads, not the sums.
"""

import contextlib
import time
from collections.abc import Callable, Hashable

import torch

from .options import OPTIONS
from .runtime import runtime_for


class RoundThreads:
    """The intra-op thread count per kind of round, measured as rounds run (see the module docstring)."""

    def __init__(
        self,
        retry: int = 16,
        max_retry: int = 64,
        weight: float = 0.3,
        margin: float = 0.25,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not 1 <= retry <= max_retry:
            raise ValueError(f"need 1 <= retry <= max_retry, got retry={retry}, max_retry={max_retry}.")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"`margin` must lie in [0, 1), got {margin!r}.")
        self.retry, self.max_retry, self.weight, self.margin, self.clock = retry, max_retry, weight, margin, clock
        self.seconds: dict[tuple[Hashable, int], float] = {}  # (kind, threads) -> smoothed seconds of a round
        self.seen: set[Hashable] = set()  # kinds that ran their warm-up round
        self.wait: dict[Hashable, int] = {}  # kind -> rounds until the next try of another count
        self.since: dict[Hashable, int] = {}  # kind -> rounds since the last try
        self.tries: dict[Hashable, int] = {}  # kind -> tries of measured counts
        self.last: dict[Hashable, int] = {}  # kind -> the count its last measured round ran at
        self.trial = False  # the last round ran a count on trial: not typical of the round's kind
        self.warm_up = False  # the last round was its kind's first (first kernels, packing): not measured

    @staticmethod
    def candidates(full: int) -> list[int]:
        """The caller's count first, then half of it and one thread."""
        return list(dict.fromkeys((full, max(1, full // 2), 1)))

    def pick(self, kind: Hashable, full: int) -> int:
        """The count this round of `kind` runs at: the one measured fastest lately (the caller's `full` until
        measured), or on a try another one (each in turn)."""
        options = self.candidates(full)
        self.warm_up, self.trial = kind not in self.seen, False
        self.seen.add(kind)
        measured = self._measured(kind, options, full)
        if len(options) == 1 or full not in measured:  # the caller's count first (its first round a warm-up)
            return full
        best = min(measured, key=measured.get)
        self.since[kind] = self.since.get(kind, 0) + 1
        unmeasured = [t for t in options if t not in measured]
        if unmeasured or self.since[kind] >= self.wait.get(kind, self.retry):
            self.since[kind], self.trial = 0, True
            if unmeasured:
                return unmeasured[0]
            others = [t for t in options if t != best]
            self.tries[kind] = self.tries.get(kind, 0) + 1
            return others[self.tries[kind] % len(others)]
        return best

    def record(self, kind: Hashable, threads: int, seconds: float, full: int) -> None:
        """One round's seconds at `threads`; a try that left the best count as it was doubles the wait."""
        if self.warm_up:
            return  # the kind's first round
        options = self.candidates(full)
        before = self._best(kind, options, full)
        key = (kind, threads)
        old = self.seconds.get(key)
        # rounds in a row at one count average; a count run after another replaces its last measurement, taken
        # before the load (or the context's length) may have changed
        in_a_row = old is not None and self.last.get(kind) == threads
        self.seconds[key] = (1 - self.weight) * old + self.weight * seconds if in_a_row else seconds
        self.last[kind] = threads
        if self.trial and all((kind, t) in self.seconds for t in options):
            won = self._best(kind, options, full) != before
            self.wait[kind] = self.retry if won else min(2 * self.wait.get(kind, self.retry), self.max_retry)

    def _measured(self, kind: Hashable, options: list[int], full: int) -> dict[int, float]:
        """Measured seconds per count, the caller's count's times `1 - margin`: rounds of one kind still differ in
        work (verifies of 1 to 8 tokens), so one cheap round at another count must not move a quiet machine off the
        caller's count, while the waits of a busy one (2-3x) clear the margin."""
        return {
            t: self.seconds[(kind, t)] * (1 - self.margin if t == full else 1.0)
            for t in options
            if (kind, t) in self.seconds
        }

    def _best(self, kind: Hashable, options: list[int], full: int) -> int | None:
        measured = self._measured(kind, options, full)
        return min(measured, key=measured.get) if measured else None

    @contextlib.contextmanager
    def round(self, kind: Hashable, measured: Callable[[], bool] = lambda: True):
        """Run one round of `kind` at the picked count; timed unless `measured()` says afterwards that the round was
        not typical (e.g. a verify kernel on trial)."""
        full = torch.get_num_threads()
        threads = self.pick(kind, full)
        start = self.clock()
        if threads != full:
            torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            if threads != full:
                torch.set_num_threads(full)
        if measured():
            self.record(kind, threads, self.clock() - start, full)


def round_threads(model: torch.nn.Module) -> RoundThreads | None:
    """The `RoundThreads` of a target (in its `TargetRuntime`, never on it), so that `generate()` calls go on from
    what earlier ones measured instead of trying every count again; None while `OPTIONS.round_threads` is off
    (every round at the caller's count)."""
    if not OPTIONS.round_threads:
        return None
    runtime = runtime_for(model)
    if runtime.threads is None:
        runtime.threads = RoundThreads()
    return runtime.threads


__all__ = ["RoundThreads", "round_threads"]
