"""The rounds one `generate()` call logged, for the harness: this package's decoders log `DraftRound`s themselves
(`decoding.stats.record_draft_rounds`); one of transformers' own assistants is timed from outside
(`observe_assistant`); a plain run's prefill ends at its first new token (`FirstTokenClock`)."""

import contextlib
import statistics
import time

import torch
from transformers.generation.streamers import BaseStreamer

from ..decoding.drafting import is_drafter
from ..decoding.stats import DraftRound, DSparkGenerationStats


def stats_from_rounds(rounds) -> DSparkGenerationStats:
    """Acceptance statistics of one generate() from its logged `DraftRound`s (assistants without generation_stats).

    A first round without drafts is the plain prefill, not a step; the last round is the one that stopped.
    """
    steps = [r for r in rounds if r.proposed or not r.first]
    stats = DSparkGenerationStats(block_size=max([r.proposed for r in steps], default=1))
    for i, r in enumerate(steps):
        stats.record_step(r.proposed, r.accepted or 0, stopped=i == len(steps) - 1)
    return stats


class RoundLog(list):
    """The `DraftRound`s of one generate(), and `prefill_seconds`: from the call to the first round's start (the
    prompt's prefill and setup), where this package's decoder logged verify timings, or to the first new token of a
    plain run (`FirstTokenClock`); else None."""

    prefill_seconds: float | None = None


class FirstTokenClock(BaseStreamer):
    """A streamer that notes when generate() hands over its first new token (`first`, `time.perf_counter()`): the
    end of a plain run's prefill. generate() puts the prompt first, then each new token."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class _AssistantRounds(list):
    """`DraftRound`s, and the input length of each round's `generate()` call."""

    def __init__(self):
        super().__init__()
        self.input_lengths: list[int] = []


@contextlib.contextmanager
def observe_assistant(assistant):
    """Time the drafting rounds of one of transformers' own assistants (not this package's drafters): each round is
    one call of its public `generate()`, wrapped on the instance for the block and restored after. A round's
    acceptance is read from the next round's input length (the target commits the accepted drafts and one token)."""
    rounds = _AssistantRounds()
    if assistant is None or is_drafter(assistant) or not hasattr(assistant, "generate"):
        yield rounds
        return
    inner = assistant.generate

    def timed(*args, **kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        length = ids.shape[1]
        if rounds:
            rounds[-1].accepted = max(0, min(rounds[-1].proposed, length - rounds.input_lengths[-1] - 1))
        _sync(ids)
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        sequences = getattr(out, "sequences", out)
        _sync(sequences)
        rounds.append(DraftRound(start, time.perf_counter() - start, sequences.shape[1] - length, first=not rounds))
        rounds.input_lengths.append(length)
        return out

    assistant.generate = timed
    try:
        yield rounds
    finally:
        del assistant.generate


def _sync(tensor) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def round_breakdown(round_lists) -> dict | None:
    """Where a round's time goes, mean ms per round over the logged rounds of this package's decoders: `draft` (the
    gate and the draft pass with its sampling), `verify` (the target's forward), `bookkeeping` (acceptance, commit,
    cache trimming) and `round` (all three), plus `rounds` counted and `drafted` (rounds that drafted). None when the
    rounds carry no verify timings (transformers' own assistants)."""
    rounds = [r for rs in round_lists for r in rs if r.verify_seconds is not None and r.end is not None]
    if not rounds:
        return None
    draft = statistics.fmean(1e3 * r.seconds for r in rounds)
    verify = statistics.fmean(1e3 * r.verify_seconds for r in rounds)
    whole = statistics.fmean(1e3 * (r.end - r.start) for r in rounds)
    return {
        "draft": draft,
        "verify": verify,
        "bookkeeping": whole - draft - verify,
        "round": whole,
        "rounds": len(rounds),
        "drafted": sum(1 for r in rounds if r.proposed),
    }


__all__ = ["FirstTokenClock", "RoundLog", "observe_assistant", "round_breakdown", "stats_from_rounds"]
