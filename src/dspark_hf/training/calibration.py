"""Sequential Temperature Scaling (STS) of the confidence head, and calibration metrics (DSpark paper §3.2.1).

The scheduler needs *absolute* survival probabilities `a_k = Π_{i<=k} σ(logit_i / T_i)`. STS fits T_1..T_γ left to
right: T_k by a 1-D grid search minimising the ECE of `a_k` against the empirical prefix-acceptance label, with
T_1..T_{k-1} fixed. Temperature scaling keeps the ranking, so AUROC is unchanged.

Labels come from held-out data under teacher forcing: a block's prefix of length k "survives" when its first k
drafts are what the target would emit (greedy) — then the teacher-forced inputs equal the drafted ones, so the
confidence logits are exactly those seen at inference on every surviving prefix.

`write_calibrated_copy` writes what `dspark-hf calibrate` gives: a copy of the drafter with the fitted temperatures.
"""

import os
import shutil
from pathlib import Path

import torch

from ..utils.files import atomic_write_json, check_folder_free, write_folder


REPORT_FILE = "calibration.json"  # the report, beside the calibrated copy's config.json


DEFAULT_GRID = torch.exp(torch.linspace(-2.5, 2.5, 101))  # T from ~0.08 to ~12, log-spaced
MIN_BLOCKS = 2  # the cross-fitted report fits on one fold and scores the other


def count_full_blocks(dataset, block_size: int, seq_len: int) -> int:
    """How many distinct fully supervised blocks (an anchor and its `block_size` labels, all inside the loss mask)
    `dataset`'s sequences can give in windows of `seq_len` tokens: what `collect_confidence` can collect at most."""
    lengths = dataset.offsets[1:] - dataset.offsets[:-1]
    supervised = (lengths - dataset.loss_start).clip(min=0).clip(max=seq_len)
    return int((supervised - block_size).clip(min=0).sum())


def expected_calibration_error(pred: torch.Tensor, label: torch.Tensor, bins: int = 20) -> float:
    """Σ_b (n_b / N) |mean pred_b - mean label_b| over `bins` equal-width bins (DeepSpec's ECE)."""
    pred, label = pred.flatten().float(), label.flatten().float()
    idx = (pred * bins).long().clamp(0, bins - 1)
    gap = torch.zeros(bins).index_add_(0, idx, pred) - torch.zeros(bins).index_add_(0, idx, label)
    return float(gap.abs().sum() / max(pred.numel(), 1))


def auroc(pred: torch.Tensor, label: torch.Tensor) -> float | None:
    """Area under the ROC curve by the rank statistic (ties averaged); None if only one class is present."""
    pred, label = pred.flatten().double(), label.flatten().bool()
    n_pos, n_neg = int(label.sum()), int((~label).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = pred.argsort()
    ranks = torch.empty_like(pred)
    ranks[order] = torch.arange(1, pred.numel() + 1, dtype=torch.double)
    for value in pred.unique():  # average ranks of ties
        tie = pred == value
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return float((ranks[label].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier(pred: torch.Tensor, label: torch.Tensor) -> float:
    return float(((pred.float() - label.float()) ** 2).mean())


def survival(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """(N, γ) raw logits -> (N, γ) cumulative survival under per-position temperatures."""
    return torch.cumprod(torch.sigmoid(logits.float() / temperatures), dim=-1)


def fit_sts(logits: torch.Tensor, prefix_labels: torch.Tensor, grid: torch.Tensor = DEFAULT_GRID, bins: int = 20):
    """Per-position temperatures, fitted left to right. logits, prefix_labels (N, γ) -> temperatures (γ,)."""
    gamma = logits.shape[-1]
    temps = torch.ones(gamma)
    prefix = torch.ones(logits.shape[0])
    for k in range(gamma):
        best_t, best_ece = 1.0, float("inf")
        for t in grid.tolist():
            a_k = prefix * torch.sigmoid(logits[:, k].float() / t)
            ece = expected_calibration_error(a_k, prefix_labels[:, k], bins)
            if ece < best_ece:
                best_t, best_ece = t, ece
        temps[k] = best_t
        prefix = prefix * torch.sigmoid(logits[:, k].float() / best_t)
    return temps


def _metrics(a: torch.Tensor, prefix_labels: torch.Tensor, bins: int) -> dict:
    """ECE, AUROC and Brier per position of survivals a (N, γ) against prefix labels (N, γ)."""
    return {
        "ece": [expected_calibration_error(a[:, k], prefix_labels[:, k], bins) for k in range(a.shape[1])],
        "auroc": [auroc(a[:, k], prefix_labels[:, k]) for k in range(a.shape[1])],
        "brier": [brier(a[:, k], prefix_labels[:, k]) for k in range(a.shape[1])],
    }


def cross_fitted_survival(logits, prefix_labels, folds: int = 2, seed: int = 0, bins: int = 20) -> torch.Tensor:
    """(N, γ) survivals, each block's under temperatures fitted on the other folds only (random, seeded folds).

    Scored like in-sample survivals (same blocks, same bins), they say whether STS helps on blocks it was not
    fitted on: with a few thousand blocks the ECE's noise floor is a few hundredths, and a grid search can fit it.
    """
    n = logits.shape[0]
    if not 2 <= folds <= n:
        raise ValueError(f"folds must be between 2 and the number of blocks ({n}); got {folds}.")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    out = torch.empty(logits.shape)
    for part in order.chunk(folds):
        rest = torch.ones(n, dtype=torch.bool)
        rest[part] = False
        out[part] = survival(logits[part], fit_sts(logits[rest], prefix_labels[rest], bins=bins))
    return out


def calibration_report(logits, prefix_labels, temperatures, bins: int = 20, folds: int = 2) -> dict:
    """ECE, AUROC and Brier per position of the cumulative survival: `before` (T = 1), `after` STS with
    `temperatures` (fitted on these blocks), and `cross_fitted` (STS fitted on the other folds; `folds` 0: not
    computed), all on the same blocks."""
    report = {
        "before": _metrics(survival(logits, torch.ones(logits.shape[-1])), prefix_labels, bins),
        "after": _metrics(survival(logits, temperatures), prefix_labels, bins),
    }
    if folds:
        report["cross_fitted"] = _metrics(
            cross_fitted_survival(logits, prefix_labels, folds, bins=bins), prefix_labels, bins
        )
        report["folds"] = folds
    report["temperatures"] = [float(t) for t in temperatures]
    report["num_blocks"] = int(logits.shape[0])
    return report


@torch.no_grad()
def collect_confidence(
    drafter, target, dataset, seq_len=512, batch_size=4, num_anchors=64, num_batches=8, seed=0, against_target=False
):
    """Raw confidence logits and greedy prefix-acceptance labels of fully supervised held-out blocks: (N, γ) each.

    A draft counts as accepted when it equals the data's next token, or with `against_target` the target's own
    greedy token there (for a target other than the one that generated the data, e.g. a quantized one)."""
    from .step import block_predictions

    logits, labels = [], []
    for ids, mask, gen in dataset.seeded_batches(num_batches, batch_size, seq_len, first_seed=seed * 7919):
        p = block_predictions(drafter, target, ids, mask, num_anchors, gen)
        if p.confidence_logits is None:
            raise ValueError("This drafter has no confidence head; there is nothing to calibrate.")
        full = p.blocks.valid.all(-1)  # (B, N)
        wanted = p.target_logits.argmax(-1) if against_target else p.blocks.labels
        hits = (p.draft_logits.argmax(-1) == wanted).cumprod(-1)
        logits.append(p.confidence_logits[full])
        labels.append(hits[full].float())
    return torch.cat(logits), torch.cat(labels)


def reliability_diagram(logits, prefix_labels, temperatures, png_path, bins: int = 10) -> None:
    """One panel per position: mean predicted survival vs observed, before and after STS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gamma = logits.shape[-1]
    fig, axes = plt.subplots(1, gamma, figsize=(2.6 * gamma, 2.8), sharey=True, squeeze=False)
    for name, temps, style in (("raw", torch.ones(gamma), "o--"), ("STS", temperatures, "s-")):
        a = survival(logits, temps)
        for k in range(gamma):
            idx = (a[:, k] * bins).long().clamp(0, bins - 1)
            xs, ys = [], []
            for b in range(bins):
                sel = idx == b
                if sel.sum() >= 5:
                    xs.append(float(a[sel, k].mean()))
                    ys.append(float(prefix_labels[sel, k].mean()))
            axes[0, k].plot(xs, ys, style, label=name, markersize=3)
    for k in range(gamma):
        axes[0, k].plot([0, 1], [0, 1], color="gray", linewidth=0.8)
        axes[0, k].set_title(f"position {k + 1}")
        axes[0, k].set_xlabel("predicted survival")
    axes[0, 0].set_ylabel("observed prefix acceptance")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def write_calibrated_copy(
    source: str | os.PathLike, out: str | os.PathLike, temperatures, report: dict, overwrite: bool = False
) -> Path:
    """Write a calibrated copy of the drafter checkpoint `source` (a local folder, or a Hub id: its snapshot in the
    cache, fetched if need be) to `out`: its files, with `sts_temperatures` = `temperatures` in config.json, and
    `report` as calibration.json. `source` is only read.

    A non-empty `out` is refused unless `overwrite`; the copy is made in a folder beside `out` and renamed into place
    once complete, so an overwritten `out` keeps its old content until then (`utils.files.write_folder`).
    """
    from ..models.configuration_dspark import DSparkConfig

    check_folder_free(out, overwrite)
    source = _local_checkpoint(source)

    def write(tmp: Path) -> None:
        for path in source.iterdir():
            if path.is_file() and not path.name.startswith("."):
                shutil.copyfile(path, tmp / path.name)
        config = DSparkConfig.from_pretrained(tmp)
        config.sts_temperatures = [float(t) for t in temperatures]
        config.to_json_file(tmp / "config.json")
        atomic_write_json(report, tmp / REPORT_FILE)

    return write_folder(out, write, overwrite=overwrite)


def _local_checkpoint(source: str | os.PathLike) -> Path:
    """The drafter checkpoint's folder: a local folder, or its Hub snapshot from the cache."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(source)))
    return folder


__all__ = [
    "expected_calibration_error",
    "auroc",
    "brier",
    "fit_sts",
    "calibration_report",
    "collect_confidence",
    "cross_fitted_survival",
    "reliability_diagram",
    "write_calibrated_copy",
]
