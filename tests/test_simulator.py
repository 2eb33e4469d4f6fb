"""The what-if simulator replays logged rounds exactly on hand-made logs, and reads real generate() logs."""

import pytest
import torch

from conftest import make_drafter
from dspark_hf.evaluation.simulator import LoggedStep, simulate, steps_from_stats


STEPS = [LoggedStep([0.9, 0.8, 0.3, 0.1], verified=4, accepted=2)]


def test_fixed_policy_replays_the_log():
    out = simulate(STEPS, {b: 10.0 for b in range(1, 20)}, policy="fixed", rounds=5)
    assert out["acceptance_length"] == 3.0  # 2 accepted + bonus
    assert out["aggregate_tokens_per_second"] == pytest.approx(30.0)  # 3 tokens per 0.1 s step
    assert out["mean_verify_length"] == 4.0


def test_threshold_policy_cuts_the_low_survival_tail():
    out = simulate(STEPS, {b: 10.0 for b in range(1, 20)}, policy=0.5, rounds=3)
    assert out["mean_verify_length"] == 2.0 and out["acceptance_length"] == 3.0


def test_scheduler_follows_the_cost_curve():
    flat = simulate(STEPS, {b: 10.0 for b in range(1, 20)}, policy="scheduler", rounds=2)
    steep = simulate(STEPS, lambda b: 10.0 / b, policy="scheduler", rounds=2)
    assert flat["mean_verify_length"] == 4.0
    assert steep["mean_verify_length"] == 0.0 and steep["acceptance_length"] == 1.0


def test_concurrency_shares_one_target_step():
    out = simulate(STEPS, {b: 10.0 for b in range(1, 40)}, policy="fixed", concurrency=4, rounds=2)
    assert out["aggregate_tokens_per_second"] == pytest.approx(4 * 30.0)
    assert out["per_user_tokens_per_second"] == pytest.approx(30.0)
    with pytest.raises(ValueError, match="Unknown policy"):
        simulate(STEPS, {1: 1.0}, policy="greedy")


def test_replays_a_real_generate_log(target):
    drafter = make_drafter(target, verify_policy="fixed")
    target.generate(torch.randint(0, 99, (1, 5)), max_new_tokens=20, do_sample=False, assistant_model=drafter)
    steps = steps_from_stats(drafter.generation_stats)
    assert steps and all(len(s.survival) == s.verified for s in steps)
    out = simulate(steps, {b: 10.0 for b in range(1, 10)}, policy="fixed", rounds=len(steps))
    assert 1.0 <= out["acceptance_length"] <= 5.0
