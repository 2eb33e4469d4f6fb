"""What the harness reports: one entry per run (dataset × temperature × drafter) and per plain baseline, built
from the decoded outputs, their acceptance statistics and logged rounds (`harness._decode`); the text table of a
result, and the runs a model card quotes."""

import functools
import statistics

import torch
from transformers.utils import logging

from ..decoding.stats import DSparkGenerationStats
from .rounds import RoundLog, round_breakdown


logger = logging.get_logger(__name__)

# The extra plain baselines, by the name their fields carry (`tokens_per_second_padded`, `own_identical`, ...): the
# kernel-neutral one (plain steps through the measured verify kernels), transformers' compiled static-cache decoding,
# this package's own decode round with no drafter (`harness.run_evaluation` runs them)
BASELINES = ("padded", "compiled", "own")


def _pool(stats) -> DSparkGenerationStats:
    start = DSparkGenerationStats(block_size=max(s.block_size for s in stats))
    return functools.reduce(DSparkGenerationStats.merge, stats, start)


def _mismatch(index: int, plain: torch.Tensor, other: torch.Tensor) -> dict:
    n = min(plain.numel(), other.numel())
    differ = (plain[:n] != other[:n]).nonzero()
    first = int(differ[0]) if differ.numel() else n
    return {"index": index, "first_difference": first, "plain_new_tokens": plain.numel(), "new_tokens": other.numel()}


def _totals(decoded) -> tuple[int, float]:
    """(new tokens, seconds) summed over a list of `_decode` results."""
    return sum(d[0].numel() for d in decoded), sum(d[1] for d in decoded)


def _rate(tokens: int, seconds: float) -> float:
    """Tokens per second (0 when nothing was timed)."""
    return tokens / seconds if seconds else 0.0


def _decode_phase(decoded, prefills) -> tuple[int, float]:
    """(tokens after the first, seconds after the prefill) summed over prompts: the decoding phase alone."""
    tokens = sum(max(d[0].numel() - 1, 0) for d in decoded)
    return tokens, sum(max(d[1] - p, 0.0) for d, p in zip(decoded, prefills))


def _run_entry(dataset, temperature, label, prompts, decoded, plain, baselines=None) -> dict:
    """Everything measured for one dataset × temperature × drafter; `baselines`: the decodes of the extra plain
    baselines that ran, by name (`BASELINES`)."""
    stats = [s for _, _, s, _ in decoded]
    pooled = _pool(stats)
    tokens, seconds = _totals(decoded)
    draft_ms = [1e3 * r.seconds for d in decoded for r in d[3] if not r.first]
    per_prompt, mismatches = [], []
    for i, ((out, secs, s, rounds), ref, ids) in enumerate(zip(decoded, plain, prompts)):
        identical = None
        if temperature == 0:
            identical = torch.equal(out, ref[0])
            if not identical:
                mismatches.append(_mismatch(i, ref[0], out))
                logger.warning(
                    f"{dataset} prompt {i}: {label} output differs from plain greedy at new token "
                    f"{mismatches[-1]['first_difference']}. Please report this as a bug."
                )
        per_prompt.append(
            {
                "index": i,
                "prompt_tokens": ids.shape[1],
                "new_tokens": out.numel(),
                "seconds": secs,
                "seconds_plain": ref[1],
                "draft_seconds": sum(r.seconds for r in rounds),
                "acceptance_length": s.acceptance_length,
                "num_target_forwards": s.num_target_forwards,
                "lookup_rounds": s.lookup_rounds,
                "gated_rounds": s.gated_rounds,
                "fewer_threads_rounds": s.fewer_threads_rounds,
                "identical": identical,
            }
        )
    reached, accepted = pooled.position_counts()
    tps, plain_tps = _rate(tokens, seconds), _rate(*_totals(plain))
    padded_tps, compiled_tps, own_tps = _baseline_rates(baselines)
    return {
        "dataset": dataset,
        "temperature": temperature,
        "drafter": label,
        "num_prompts": len(decoded),
        "all_identical": None if temperature else not mismatches,
        "mismatches": mismatches,
        "acceptance_length": pooled.acceptance_length,
        "mean_prompt_acceptance_length": statistics.fmean(s.acceptance_length for s in stats),
        "per_position_acceptance": pooled.per_position_acceptance,
        "position_reached": reached,
        "position_accepted": accepted,
        "acceptance_length_by_draft_length": pooled.acceptance_length_by_draft_length,
        "mean_verify_length": pooled.mean_verify_length,
        "mean_accepted_depth": pooled.mean_accepted_depth,
        "num_target_forwards": pooled.num_target_forwards,
        "lookup_rounds": pooled.lookup_rounds,  # rounds that verified a lookup chain (`context_lookup`)
        "gated_rounds": pooled.gated_rounds,  # rounds the draft gate made plain
        "fewer_threads_rounds": pooled.fewer_threads_rounds,  # rounds at fewer threads (`kernels/threads.py`)
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tps,
        "tokens_per_second_plain": plain_tps,
        "speedup": tps / plain_tps if plain_tps else 0.0,
        "tokens_per_second_padded": padded_tps,
        # the kernel-neutral baseline: the faster of plain and plain with the measured kernels (`measured_steps`)
        "speedup_vs_padded": tps / max(padded_tps, plain_tps) if padded_tps else None,
        "tokens_per_second_compiled": compiled_tps,
        "speedup_vs_compiled": tps / compiled_tps if compiled_tps else None,
        "tokens_per_second_own": own_tps,
        # what speculation buys over plain decoding through the same round (forward, cache and kernels)
        "speedup_vs_own": tps / own_tps if own_tps else None,
        "draft_ms_per_round": statistics.fmean(draft_ms) if draft_ms else None,
        "draft_ms_per_round_median": statistics.median(draft_ms) if draft_ms else None,
        "draft_fraction": sum(draft_ms) / 1e3 / seconds if seconds else 0.0,
        "round_ms": round_breakdown(d[3] for d in decoded),
        **_decode_phase_entry(decoded, plain),
        "per_prompt": per_prompt,
    }


def _decode_phase_entry(decoded, plain) -> dict:
    """The decoding phase without the prompt's prefill, which costs the same with and without a drafter (long prompts
    spend most of a short generate() there): the plain step's mean ms and the speedup over plain decoding. Each run
    is charged its own prefill (`RoundLog.prefill_seconds`: to the drafted run's first round, to the plain run's first
    new token), so that the prefill's run-to-run spread (seconds at 8k tokens) stays out of the ratio; a plain run
    without one is charged the drafted run's. Empty where the drafted run's was not logged."""
    prefills = [d[3].prefill_seconds if isinstance(d[3], RoundLog) else None for d in decoded]
    if not prefills or None in prefills:
        return {}
    plain_prefills = [
        p[3].prefill_seconds if isinstance(p[3], RoundLog) and p[3].prefill_seconds is not None else own
        for p, own in zip(plain, prefills)
    ]
    plain_tokens, plain_seconds = _decode_phase(plain, plain_prefills)
    tokens, seconds = _decode_phase(decoded, prefills)
    plain_tps, tps = _rate(plain_tokens, plain_seconds), _rate(tokens, seconds)
    return {
        "prefill_seconds": statistics.fmean(prefills),
        "plain_prefill_seconds": statistics.fmean(plain_prefills),
        "plain_step_ms": 1e3 * plain_seconds / plain_tokens if plain_tokens else None,
        "decode_speedup": tps / plain_tps if plain_tps else None,
    }


def _baseline_rates(baselines) -> list[float | None]:
    """Tokens per second of each of `BASELINES` in its order (None where it did not run)."""
    baselines = baselines or {}
    return [_rate(*_totals(baselines[name])) if baselines.get(name) else None for name in BASELINES]


def _baseline_entry(dataset, temperature, prompts, plain, baselines=None) -> dict:
    """Plain decoding on one dataset × temperature, and the extra plain baselines where they ran (`baselines`: their
    decodes by name, `BASELINES`).

    `padded_identical` (T = 0): whether 2-row steps gave plain greedy's tokens; the products agree to float rounding,
    so a difference is possible in principle but makes only the timing less comparable, never a drafter's output.
    `compiled_identical` the same for transformers' compiled decoding (its fused kernels round differently), and
    `own_identical` for this package's plain decoding (its round's forward, cache and kernels).
    """
    per_prompt = [
        {"index": i, "prompt_tokens": ids.shape[1], "new_tokens": out.numel(), "seconds": secs}
        for i, ((out, secs, _, _), ids) in enumerate(zip(plain, prompts))
    ]
    tokens, seconds = _totals(plain)
    entry = {
        "dataset": dataset,
        "temperature": temperature,
        "num_prompts": len(plain),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": _rate(tokens, seconds),
    }
    for name, rate in zip(BASELINES, _baseline_rates(baselines)):
        decoded, identical = (baselines or {}).get(name), None  # the baseline's decodes, or None where it did not run
        if decoded:
            for row, (_, secs, _, _) in zip(per_prompt, decoded):
                row[f"seconds_{name}"] = secs
            if temperature == 0:
                identical = all(torch.equal(p[0], q[0]) for p, q in zip(plain, decoded))
        entry[f"tokens_per_second_{name}"] = rate
        entry[f"{name}_identical"] = identical
    return {
        **entry,
        "per_prompt": per_prompt,
    }


SUMMARY_COLUMNS = (
    "dataset",
    "drafter",
    "T",
    "prompts",
    "identical",
    "τ",
    "verify",
    "draft ms",
    "tok/s",
    "plain",
    "speedup",
    "vs padded",
)


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_evaluation(result: dict) -> str:
    """A text table per dataset × drafter × temperature, latency rows per drafter, and any mismatch."""
    rows = [SUMMARY_COLUMNS]
    for r in result["runs"]:
        n = r["num_prompts"]
        identical = "-" if r["all_identical"] is None else f"{n - len(r['mismatches'])}/{n}"
        rows.append(
            (
                r["dataset"],
                r["drafter"],
                f"{r['temperature']:g}",
                str(r["num_prompts"]),
                identical,
                _fmt(r["acceptance_length"]),
                _fmt(r["mean_verify_length"]),
                _fmt(r["draft_ms_per_round"], ".1f"),
                _fmt(r["tokens_per_second"], ".1f"),
                _fmt(r["tokens_per_second_plain"], ".1f"),
                f"{r['speedup']:.2f}x",
                "-" if r.get("speedup_vs_padded") is None else f"{r['speedup_vs_padded']:.2f}x",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for r in result["runs"]:
        rates = " ".join(_fmt(x) for x in r["per_position_acceptance"])
        lines.append(f"acceptance by position  {r['dataset']} / {r['drafter']} / T={r['temperature']:g}: {rates}")
    baselines = (
        ("padded", "padded plain (verify kernels, no drafts)"),
        ("compiled", "compiled plain (transformers)"),
        ("own", "own plain (this package's round, no drafter)"),
    )
    for b in result.get("baselines", []):
        for name, title in baselines:
            rate, identical = b.get(f"tokens_per_second_{name}"), b.get(f"{name}_identical")
            if rate is not None:
                same = "" if identical is None else f", same tokens as plain: {identical}"
                lines.append(
                    f"{title}  {b['dataset']} / T={b['temperature']:g}: {rate:.1f} tok/s "
                    f"= {rate / b['tokens_per_second']:.2f}x of plain{same}"
                )
    for r in result["runs"]:
        for name in ("compiled", "own"):
            if r.get(f"speedup_vs_{name}") is not None:
                lines.append(
                    f"against {name} plain  {r['dataset']} / {r['drafter']} / T={r['temperature']:g}: "
                    f"{r[f'speedup_vs_{name}']:.2f}x"
                )
    for label, lat in result.get("latency", {}).items():
        cells = ", ".join(
            f"L={n}: {_fmt(d, '.1f')} ({_fmt(w, '.1f')})"
            for n, d, w in zip(lat["lengths"], lat["draft_ms"], lat["round_ms"])
        )
        lines.append(f"draft ms per round (whole round) by draft length, {label} [{lat['method']}]: {cells}")
    for r in result["runs"]:
        for m in r["mismatches"]:
            lines.append(
                f"MISMATCH {r['dataset']} / {r['drafter']} prompt {m['index']}: differs from plain greedy at new "
                f"token {m['first_difference']} ({m['new_tokens']} vs {m['plain_new_tokens']} tokens)"
            )
    return "\n".join(lines)


def model_card_results(result: dict, drafter: str | None = None, temperature: float = 0.0) -> dict:
    """{dataset: run} of one drafter at one temperature: the `results` argument of `hub.model_card`."""
    labels = list(result["drafters"])
    if drafter is None:
        if len(labels) != 1:
            raise ValueError(f"The result holds several drafters {labels}; pass drafter= one of them.")
        drafter = labels[0]
    runs = {r["dataset"]: r for r in result["runs"] if r["drafter"] == drafter and r["temperature"] == temperature}
    if not runs:
        raise ValueError(f"No run of drafter {drafter!r} at T={temperature:g}; drafters {labels}.")
    return runs


__all__ = ["format_evaluation", "model_card_results"]
