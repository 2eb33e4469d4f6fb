"""Clocks and waits for tests that must not depend on the wall clock or an idle machine (issue 53).

`FakeClock` stands in for `time.perf_counter` wherever code takes a `clock=` argument: it moves only when the test
says so (`advance`, `sleep`) or by a fixed `tick` per reading, so what the code measures is what the test decided,
however loaded the machine is. `HANG_S` bounds waits on real threads and processes: a guard against a hang, never
the quantity a test measures, so it is generous enough for a loaded 2-core machine.
"""

import threading
import time


HANG_S = 60.0  # the longest a test waits for an event that should come at once (a guard, not a measurement)


class FakeClock:
    """A monotonic clock in simulated seconds: `clock()` reads it (then moves it on by `tick`), `advance(s)` and
    `sleep(s)` move it on. Thread-safe."""

    def __init__(self, start: float = 0.0, tick: float = 0.0):
        self.now, self.tick, self.reads = float(start), float(tick), 0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            now, self.now, self.reads = self.now, self.now + self.tick, self.reads + 1
            return now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock only moves forward, not by {seconds}")
        with self._lock:
            self.now += seconds

    sleep = advance  # a drop-in for `time.sleep` that costs no real time


def wait_for(predicate, timeout: float = HANG_S, what: str = "the condition") -> None:
    """Wait until `predicate()` is true, polling every 10 ms; AssertionError naming `what` after `timeout` seconds (a
    hang guard only: the test's assertions are about what happened, not how long it took)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s (hang guard)")
        time.sleep(0.01)
