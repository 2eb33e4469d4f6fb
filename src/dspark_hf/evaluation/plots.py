"""PNG plots of an evaluation result (`evaluation.harness.run_evaluation`), the paper's Figs. 2 and 4 for our drafters.

acceptance_by_position.png   conditional acceptance per block position, one panel per dataset
tau_vs_draft_length.png      τ had verification stopped after L drafts (from those rates), one panel per dataset
latency_vs_block_length.png  median drafting and whole-round time per round against the draft length
long_context.png             τ, speed against plain and a round's ms against the prompt length (`--long-context`)
Colours are drafters; solid lines T = 0, dashed T > 0.
"""

import math
from pathlib import Path

from .statistics import bootstrap_interval, paired_ratio_interval, ratio_of_sums


PLOT_FILES = ("acceptance_by_position.png", "tau_vs_draft_length.png", "latency_vs_block_length.png")


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("Plots need matplotlib: pip install 'dspark-hf[bench]' or pip install matplotlib.") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_ticks(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _per_dataset(plt, result, key, ylabel, path):
    """One panel per dataset; a line per drafter × temperature of run[key] against positions 1..n."""
    names = list(result["datasets"])
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, sharey=True)
    colours = {label: f"C{i}" for i, label in enumerate(result["drafters"])}
    for ax, name in zip(axes.flat, names):
        for run in (r for r in result["runs"] if r["dataset"] == name):
            points = [(k, y) for k, y in enumerate(run[key], start=1) if y is not None]
            if not points:
                continue
            xs, ys = zip(*points)
            style = "-" if run["temperature"] == 0 else "--"
            ax.plot(
                xs,
                ys,
                style,
                marker="o",
                ms=3,
                color=colours[run["drafter"]],
                label=f"{run['drafter']} T={run['temperature']:g}",
            )
        ax.set_title(name)
        _integer_ticks(ax)
        ax.set_xlabel("block position k" if key == "per_position_acceptance" else "draft length L")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _latency(plt, result, path):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for i, (label, lat) in enumerate(result.get("latency", {}).items()):
        for key, style, what in (("draft_ms", "-", "drafting"), ("round_ms", ":", "whole round")):
            points = [(n, y) for n, y in zip(lat["lengths"], lat[key]) if y is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, marker="o", ms=3, color=f"C{i}", label=f"{label} {what}")
    _integer_ticks(ax)
    ax.set_xlabel("draft length L (drafts proposed per round)")
    ax.set_ylabel("ms per round (median)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no latency sweep in this result", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def context_rows(result: dict) -> list[dict]:
    """One row per long-context set × drafter of a greedy `run_evaluation` result, in length order: the numbers
    `long_context.format_long_context` and `plot_long_context` show (`prompt_tokens` is the mean real length)."""
    rows = []
    for run in result["runs"]:
        if run["temperature"] != 0 or not run["dataset"].startswith("ctx-"):
            continue
        round_ms = run.get("round_ms") or {}
        plain_step = run.get("plain_step_ms")
        drafted = (run.get("position_reached") or [0])[0]  # rounds with at least one draft
        rows.append(
            {
                "dataset": run["dataset"],
                "drafter": run["drafter"],
                "prompt_tokens": sum(p["prompt_tokens"] for p in run["per_prompt"]) / len(run["per_prompt"]),
                "identical": run["all_identical"],
                "tau": run["acceptance_length"],
                # tokens per round over the rounds that drafted: the drafts' acceptance without the gate's choice
                # of plain rounds (which a long context's dearer verify makes more often)
                "tau_drafted": 1 + sum(run["position_accepted"]) / drafted if drafted else None,
                "acceptance_1": run["per_position_acceptance"][0],
                "plain_tps": run["tokens_per_second_plain"],
                "speedup": run["speedup"],
                "decode_speedup": run.get("decode_speedup"),
                "draft_ms": round_ms.get("draft"),
                "verify_ms": round_ms.get("verify"),
                "bookkeeping_ms": round_ms.get("bookkeeping"),
                "round_ms": round_ms.get("round"),
                "drafted_rounds": f"{round_ms.get('drafted', 0)}/{round_ms.get('rounds', 0)}",
                "plain_step_ms": plain_step,
                "verify_vs_plain": round_ms["verify"] / plain_step if plain_step and round_ms else None,
            }
        )
    rows.sort(key=lambda r: (r["drafter"], r["prompt_tokens"]))
    _add_intervals(rows, {(run["dataset"], run["drafter"]): run["per_prompt"] for run in result["runs"]})
    return rows


def _add_intervals(rows: list[dict], prompts: dict) -> None:
    """95 % bootstrap intervals over the prompts (`statistics`): `tau_ci`, `speedup_ci`, and τ relative to the
    shortest set of the same drafter, `tau_rel` with `tau_rel_ci`, resampling prompt i of both sets together."""

    def tau(ps):
        return ratio_of_sums([p["new_tokens"] for p in ps], [p["num_target_forwards"] for p in ps])

    shortest = {}
    for row in rows:  # sorted by length within a drafter
        shortest.setdefault(row["drafter"], row)
    for row in rows:
        mine = prompts[row["dataset"], row["drafter"]]
        speed = ratio_of_sums([p["seconds_plain"] for p in mine], [p["seconds"] for p in mine])
        row["tau_ci"] = bootstrap_interval(tau(mine), len(mine))
        row["speedup_ci"] = bootstrap_interval(speed, len(mine))
        base = shortest[row["drafter"]]
        theirs = prompts[base["dataset"], base["drafter"]]
        row["tau_rel"] = row["tau"] / base["tau"] if base["tau"] else None
        row["tau_rel_ci"] = paired_ratio_interval(tau(mine), tau(theirs), min(len(mine), len(theirs)))


def _with_intervals(ax, xs, rows, key, colour, label) -> None:
    """A solid line of rows[key], with error bars from rows[key + "_ci"] where every row has one."""
    ys = [r[key] for r in rows]
    intervals = [r.get(f"{key}_ci") for r in rows]
    if all(ci is not None for ci in intervals):
        # a percentile interval may miss its own point estimate on skewed data: no bar below zero length
        errors = [
            [max(y - ci[0], 0.0) for y, ci in zip(ys, intervals)],
            [max(ci[1] - y, 0.0) for y, ci in zip(ys, intervals)],
        ]
        ax.errorbar(xs, ys, yerr=errors, fmt="-o", ms=3, capsize=3, color=colour, label=label)
    else:
        ax.plot(xs, ys, "-o", ms=3, color=colour, label=label)


def plot_long_context(result: dict, path) -> Path:
    """`long_context.png`: τ, speed against plain and a round's ms (draft, verify, the rest; one plain step dotted)
    against the prompt's length, one colour per drafter (`long_context.context_rows`); bars on τ and on the speed of
    the whole call are 95 % bootstrap intervals over the prompts."""
    plt = _pyplot()
    rows = context_rows(result)
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.8))
    for i, label in enumerate(dict.fromkeys(r["drafter"] for r in rows)):
        mine = [r for r in rows if r["drafter"] == label]
        xs = [r["prompt_tokens"] for r in mine]
        colour = f"C{i}"
        _with_intervals(axes[0], xs, mine, "tau", colour, f"{label} τ")
        if all(r["tau_drafted"] is not None for r in mine):
            axes[0].plot(
                xs, [r["tau_drafted"] for r in mine], "--o", ms=3, color=colour, label=f"{label} τ, drafted rounds"
            )
        axes[0].plot(xs, [r["acceptance_1"] for r in mine], ":o", ms=3, color=colour, label=f"{label} acc@1")
        _with_intervals(axes[1], xs, mine, "speedup", colour, f"{label} generate()")
        if all(r["decode_speedup"] is not None for r in mine):
            axes[1].plot(xs, [r["decode_speedup"] for r in mine], "--o", ms=3, color=colour, label=f"{label} decoding")
        for key, style in (("round_ms", "-"), ("verify_ms", "--"), ("draft_ms", "-.")):
            if all(r[key] is not None for r in mine):
                axes[2].plot(xs, [r[key] for r in mine], style, marker="o", ms=3, color=colour,
                             label=f"{label} {key[:-3]}")  # fmt: skip
    plain = sorted({(r["prompt_tokens"], r["plain_step_ms"]) for r in rows if r["plain_step_ms"] is not None})
    if plain:
        axes[2].plot(*zip(*plain), ":s", ms=3, color="k", label="plain step")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    titles = ("acceptance", "speed against plain", "ms per round")
    ylabels = ("τ / acceptance at position 1", "speedup (x)", "ms (mean)")
    for ax, title, ylabel in zip(axes, titles, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    axes[2].set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_evaluation(result: dict, out_dir) -> list[Path]:
    """Write the three PNGs into `out_dir` (created if needed); returns their paths."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in PLOT_FILES]
    _per_dataset(plt, result, "per_position_acceptance", "conditional acceptance", paths[0])
    _per_dataset(plt, result, "acceptance_length_by_draft_length", "τ (tokens per target forward)", paths[1])
    _latency(plt, result, paths[2])
    if any(run["dataset"].startswith("ctx-") for run in result["runs"]):
        paths.append(plot_long_context(result, out_dir / "long_context.png"))
    return paths


__all__ = ["PLOT_FILES", "context_rows", "plot_evaluation", "plot_long_context"]
