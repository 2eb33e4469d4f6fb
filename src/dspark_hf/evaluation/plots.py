"""PNG plots of an evaluation result (`evaluation.harness.run_evaluation`), the paper's Figs. 2 and 4 for our drafters.

acceptance_by_position.png   conditional acceptance per block position, one panel per dataset
tau_vs_draft_length.png      τ had verification stopped after L drafts (from those rates), one panel per dataset
latency_vs_block_length.png  median drafting and whole-round time per round against the draft length
Colours are drafters; solid lines T = 0, dashed T > 0.
"""

import math
from pathlib import Path


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


def plot_evaluation(result: dict, out_dir) -> list[Path]:
    """Write the three PNGs into `out_dir` (created if needed); returns their paths."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in PLOT_FILES]
    _per_dataset(plt, result, "per_position_acceptance", "conditional acceptance", paths[0])
    _per_dataset(plt, result, "acceptance_length_by_draft_length", "τ (tokens per target forward)", paths[1])
    _latency(plt, result, paths[2])
    return paths


__all__ = ["PLOT_FILES", "plot_evaluation"]
