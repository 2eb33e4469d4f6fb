"""Bootstrap intervals over a benchmark's prompts (`evaluation/statistics.py`) and where the reports show them."""

import random
import statistics as stats

import pytest

from dspark_hf.evaluation.long_context import format_long_context
from dspark_hf.evaluation.plots import context_rows
from dspark_hf.evaluation.statistics import bootstrap_interval, paired_ratio_interval, ratio_of_sums


def _mean(values):
    return lambda indices: stats.fmean(values[i] for i in indices)


def test_the_interval_covers_the_truth_about_as_often_as_it_says():
    """Samples of 20 from a skewed distribution with mean 2: the 95 % interval of the mean covers 2 in most of 200
    trials; a 50 % interval (the negative control) in far fewer."""
    rng = random.Random(1)
    covered = {0.95: 0, 0.5: 0}
    for trial in range(200):
        values = [rng.expovariate(0.5) for _ in range(20)]
        for level in covered:
            low, high = bootstrap_interval(_mean(values), len(values), samples=400, level=level, seed=trial)
            covered[level] += low <= 2.0 <= high
    assert covered[0.95] >= 0.85 * 200, covered
    assert covered[0.5] <= 0.65 * 200, covered


def test_more_prompts_narrow_it_and_a_seed_repeats_it():
    rng = random.Random(2)
    values = [rng.gauss(2.0, 0.6) for _ in range(128)]
    few, many = bootstrap_interval(_mean(values[:8]), 8), bootstrap_interval(_mean(values), 128)
    assert few[0] <= stats.fmean(values[:8]) <= few[1] and many[0] <= stats.fmean(values) <= many[1]
    assert (many[1] - many[0]) < 0.5 * (few[1] - few[0])  # about 1 / sqrt(16)
    assert bootstrap_interval(_mean(values), 128, seed=5) == bootstrap_interval(_mean(values), 128, seed=5)
    assert bootstrap_interval(_mean(values), 1) is None  # one prompt: nothing to resample
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval(_mean(values), 8, level=1.0)


def test_pairing_prompts_removes_what_they_share():
    """Prompt i is easy or hard at both lengths (τ from 1.2 to 4), the longer length 10 % below: resampling the
    pairs together pins the ratio near 0.9; resampling the two sets apart (the control) cannot tell it from 1."""
    rng = random.Random(3)
    short = [rng.uniform(1.2, 4.0) for _ in range(8)]
    long = [0.9 * t * rng.uniform(0.97, 1.03) for t in short]
    ones = [1.0] * 8
    paired = paired_ratio_interval(ratio_of_sums(long, ones), ratio_of_sums(short, ones), 8)
    assert 0.85 < paired[0] < paired[1] < 0.95
    apart = random.Random(4)

    def unpaired(indices):
        other = [apart.randrange(8) for _ in indices]
        return ratio_of_sums(long, ones)(indices) / ratio_of_sums(short, ones)(other)

    low, high = bootstrap_interval(unpaired, 8)
    assert low < 0.8 and high > 1.0
    assert ratio_of_sums([1.0], [0.0])([0]) != ratio_of_sums([1.0], [0.0])([0])  # nan for an empty denominator


def _run(dataset, taus, speedups, tokens=100):
    prompts = [
        {"prompt_tokens": int(dataset[4:]), "new_tokens": tokens, "num_target_forwards": tokens / tau,
         "seconds": 1.0, "seconds_plain": speed}
        for tau, speed in zip(taus, speedups)
    ]  # fmt: skip
    forwards = sum(p["num_target_forwards"] for p in prompts)
    return {
        "dataset": dataset, "drafter": "d", "temperature": 0, "per_prompt": prompts, "all_identical": True,
        "acceptance_length": tokens * len(prompts) / forwards, "position_reached": [4], "position_accepted": [2],
        "per_position_acceptance": [0.5], "tokens_per_second_plain": 10.0,
        "speedup": sum(speedups) / len(speedups),
    }  # fmt: skip


def test_long_context_rows_and_table_carry_the_intervals():
    taus = [1.2, 2.0, 4.0, 2.5]
    result = {"runs": [_run("ctx-256", taus, [2.0] * 4), _run("ctx-1024", [0.8 * t for t in taus], [1.0, 2.0] * 2)]}
    short, long = context_rows(result)
    assert short["tau_rel"] == 1.0 and short["tau_rel_ci"] == pytest.approx((1.0, 1.0))
    assert long["tau_rel"] == pytest.approx(0.8) and long["tau_rel_ci"] == pytest.approx((0.8, 0.8))  # paired
    assert long["tau_ci"][0] < long["tau"] < long["tau_ci"][1]
    assert short["speedup_ci"] == pytest.approx((2.0, 2.0)) and long["speedup_ci"][0] < 1.5 < long["speedup_ci"][1]
    table = format_long_context(result)
    assert "τ / shortest" in table and "0.80 [0.80–0.80]" in table and "2.00x [2.00–2.00]" in table
