"""The intra-op thread count of decoding rounds (`kernels/threads.py`): measured, followed as the load changes, the
caller's count always put back, the tokens unchanged."""

import functools

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.kernels import threads
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.threads import RoundThreads, round_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def run_rounds(choice, n, cost, kind="k"):
    """n rounds of `kind` on a fake clock; `cost(threads)` is a round's seconds. Returns the counts they ran at."""
    ran = []
    for _ in range(n):
        with choice.round(kind) as count:
            assert torch.get_num_threads() == count
            ran.append(count)
            choice.now += cost(count)
        assert torch.get_num_threads() == 2  # the caller's count, back after every round
    return ran


def fake_clock_choice(**kwargs):
    choice = RoundThreads(clock=lambda: choice.now, **kwargs)
    choice.now = 0.0
    return choice


def test_rounds_run_at_the_count_measured_fastest(two_threads):
    choice = fake_clock_choice(retry=4, max_retry=16)
    ran = run_rounds(choice, 40, lambda t: 0.010 if t == 2 else 0.004)  # a loaded machine: one thread is faster
    assert ran[:3] == [2, 2, 1]  # warm-up, the caller's count measured, then one thread tried
    assert ran[3:].count(1) >= 33  # then one thread, two threads tried again now and then (a wait that doubles)
    assert choice.wait["k"] == 16  # every try of two threads lost


def test_quiet_machine_keeps_the_callers_count(two_threads):
    choice = fake_clock_choice(retry=4, max_retry=16)
    ran = run_rounds(choice, 60, lambda t: 0.004 if t == 2 else 0.006)
    tries = [i for i, t in enumerate(ran) if t == 1]
    assert tries[0] == 2 and len(tries) <= 6  # tried early, then after 4, 8, 16, 16 rounds
    assert all(b - a > 4 for a, b in zip(tries[1:], tries[2:]))  # the wait grows while the tries lose


def test_a_count_only_slightly_faster_does_not_move_the_round(two_threads):
    """One thread 10 % faster (within what rounds of one kind differ by): the caller's count stays; 2x faster moves
    the round; with no margin the 10 % moves it too (the negative control)."""
    slightly = lambda t: 0.010 if t == 2 else 0.009  # noqa: E731
    assert run_rounds(fake_clock_choice(retry=4), 30, slightly)[3:].count(1) <= 3  # only the tries
    assert run_rounds(fake_clock_choice(retry=4), 30, lambda t: 0.010 if t == 2 else 0.005)[3:].count(1) >= 24
    assert run_rounds(fake_clock_choice(retry=4, margin=0.0), 30, slightly)[3:].count(1) >= 24
    with pytest.raises(ValueError, match="margin"):
        RoundThreads(margin=1.0)


def test_a_load_that_arrives_and_leaves_is_followed(two_threads):
    choice = fake_clock_choice(retry=4, max_retry=8)
    loaded = {"on": False}

    def cost(t):
        if loaded["on"]:
            return 0.020 if t == 2 else 0.008
        return 0.004 if t == 2 else 0.006

    run_rounds(choice, 30, cost)
    loaded["on"] = True
    ran = run_rounds(choice, 10, cost)
    assert ran[3:].count(1) >= 6  # two threads measured dearer than one thread's last measurement: left within rounds
    loaded["on"] = False
    ran = run_rounds(choice, 30, cost)
    assert ran[-10:].count(2) >= 8  # the next try found two threads cheaper again


def test_kinds_are_measured_apart_and_a_single_thread_caller_is_left_alone(two_threads):
    choice = fake_clock_choice(retry=4)
    run_rounds(choice, 10, lambda t: 0.010 if t == 2 else 0.004, kind=(True, 1))
    assert run_rounds(choice, 2, lambda t: 0.001, kind=(False, 1)) == [2, 2]  # a new kind starts at the caller's
    torch.set_num_threads(1)
    with choice.round("solo") as count:
        assert count == 1
    assert RoundThreads.candidates(16) == [16, 8, 1] and RoundThreads.candidates(1) == [1]


def test_the_callers_count_is_restored_when_a_round_raises(two_threads):
    choice = fake_clock_choice(retry=1)
    run_rounds(choice, 2, lambda t: 0.01)
    with pytest.raises(RuntimeError, match="boom"):
        with choice.round("k") as count:
            assert count == 1 and torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="retry"):
        RoundThreads(retry=0)


def test_generate_follows_a_load_that_slows_two_threads(two_threads, monkeypatch):
    """A target whose forwards at two threads take 40 ms longer (a machine another process shares): the rounds move to
    one thread, the tokens are plain greedy's, the caller's count is back afterwards. Negative control: with the
    choice off every round runs at two threads.

    The rounds are timed on a fake clock that only the target's forwards move (10 ms at one thread, 50 ms at two), so
    neither the machine's load nor its speed can change what is measured."""
    monkeypatch.setattr(OPTIONS, "verify_way", "linear")  # no verify kernel on trial: every round is measured
    clock = {"now": 0.0}
    monkeypatch.setattr(threads, "RoundThreads", functools.partial(RoundThreads, clock=lambda: clock["now"]))
    target = make_target()
    drafter = make_drafter(target, verify_policy="fixed")
    ids = torch.randint(0, 99, (1, 7))
    plain = target.generate(ids, do_sample=False, max_new_tokens=30)
    counts = []

    def loaded(module, args, kwargs):
        counts.append(torch.get_num_threads())
        clock["now"] += 0.010 + (0.040 if torch.get_num_threads() > 1 else 0.0)

    handle = target.model.register_forward_pre_hook(loaded, with_kwargs=True)
    try:
        out = target.generate(ids, do_sample=False, max_new_tokens=30, assistant_model=drafter)
        assert torch.equal(out, plain)
        assert torch.get_num_threads() == 2
        assert round_threads(target).clock() == clock["now"]  # the rounds ran on the fake clock
        rounds = counts[1:]  # after the prefill (at the caller's count)
        assert len(rounds) >= 6 and rounds.count(1) >= len(rounds) - 4
        counts.clear()
        out = target.generate(ids, do_sample=False, max_new_tokens=30, assistant_model=drafter)
        assert torch.equal(out, plain) and round_threads(target) is round_threads(target)
        assert counts[1] == 1 and counts[1:].count(1) >= len(counts) - 3  # the next call goes on at one thread
        counts.clear()
        monkeypatch.setattr(OPTIONS, "round_threads", False)
        out = target.generate(ids, do_sample=False, max_new_tokens=30, assistant_model=drafter)
        assert torch.equal(out, plain) and set(counts) == {2}
    finally:
        handle.remove()
