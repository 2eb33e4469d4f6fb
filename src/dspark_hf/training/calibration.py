"""Sequential Temperature Scaling (STS) of the confidence head, and calibration metrics (DSpark paper §3.2.1).

The scheduler needs *absolute* survival probabilities `a_k = Π_{i<=k} σ(logit_i / T_i)`. STS fits T_1..T_γ left to
right: T_k by a 1-D grid search minimising the ECE of `a_k` against the empirical prefix-acceptance label, with
T_1..T_{k-1} fixed. Temperature scaling keeps the ranking, so AUROC is unchanged.

Labels come from held-out data under teacher forcing: a block's prefix of length k "survives" when its first k
drafts are what the target would emit (greedy) — then the teacher-forced inputs equal the drafted ones, so the
confidence logits are exactly those seen at inference on every surviving prefix.

Draft trees need more than the top draft's survival: P(target's greedy token = the rank-j child | parent accepted),
per depth k and rank j. `fit_tree_calibration` fits, per (k, j), a logistic map of the child's draft probability,
sigmoid(a · logit(p) + b) with a > 0 (monotone), on the same held-out blocks under teacher forcing: on the target's
own path, the drafter's children at depth k are exactly the top candidates of the teacher-forced draft logits there,
so every block whose first k - 1 target tokens are each among the top `ranks` children is one sample per rank at
depth k. `tree_depth_check` grows every held-out block's tree as decoding does and compares the summed path
estimates (the expected accepted depth of verifying them all) with the depth the target's tokens accept.

`write_calibrated_copy` writes what `dspark-hf calibrate` gives: a copy of the drafter with the fitted temperatures
(and `tree_calibration`).
"""

import os
import shutil
from pathlib import Path
from typing import NamedTuple

import torch

from ..utils.files import atomic_write_json, check_folder_free, write_folder


REPORT_FILE = "calibration.json"  # the report, beside the calibrated copy's config.json


DEFAULT_GRID = torch.exp(torch.linspace(-2.5, 2.5, 101))  # T from ~0.08 to ~12, log-spaced
MIN_BLOCKS = 2  # the cross-fitted report fits on one fold and scores the other
TREE_RANKS = 4  # children per node whose estimates are fitted one by one; later ranks take the last rank's map
TREE_BUDGET = 16  # nodes of the trees `tree_depth_check` grows (every one verified)
TREE_RIDGE = 1.0  # pull of each (depth, rank) map towards the identity (a = 1, b = 0): few samples stay near raw


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


class HeldOutBlocks(NamedTuple):
    """What `collect_held_out_blocks` gathers from fully supervised held-out blocks (N of them, γ positions each):
    the confidence head's raw logits and greedy prefix-acceptance labels (STS), and the blocks as decoding drafts
    them, for the tree estimates. Either part is None where it was not asked for."""

    confidence_logits: torch.Tensor | None  # (N, γ)
    labels: torch.Tensor | None  # (N, γ), 1.0 while every draft so far is the target's token
    hidden: torch.Tensor | None  # (N, γ, d), the drafter's block hidden states
    anchors: torch.Tensor | None  # (N,), the token each block starts from
    tokens: torch.Tensor | None  # (N, γ), the tokens the target emits after the anchor


@torch.no_grad()
def collect_held_out_blocks(
    drafter,
    target,
    dataset,
    seq_len=512,
    batch_size=4,
    num_anchors=64,
    num_batches=8,
    seed=0,
    against_target=False,
    confidence=True,
    trees=True,
) -> HeldOutBlocks:
    """Fully supervised held-out blocks, with one target forward per batch for both parts (`HeldOutBlocks`).

    A draft counts as accepted, and a tree's path follows, the data's next token, or with `against_target` the
    target's own greedy token there (for a target other than the one that generated the data, e.g. a quantized
    one)."""
    from .data import make_blocks
    from .step import block_predictions, block_target_logits, target_features

    config = drafter.config
    embed = target.get_input_embeddings()
    parts = {name: [] for name in HeldOutBlocks._fields}
    for ids, mask, gen in dataset.seeded_batches(num_batches, batch_size, seq_len, first_seed=seed * 7919):
        features = target_features(target, ids, config.target_layer_ids)
        if confidence:  # the drafter's training pass: its drafts and confidences on the blocks it samples
            p = block_predictions(drafter, target, ids, mask, num_anchors, gen, features=features)
            blocks = p.blocks
        else:  # the same blocks (`block_predictions` samples them first, from the same generator), no drafter pass
            blocks = make_blocks(
                ids, mask, config.block_size, num_anchors, gen, getattr(config, "context_window", None)
            )
        full = blocks.valid.all(-1)  # (B, N)
        wanted = blocks.labels  # (B, N, γ)
        if against_target:  # the training pass has the target's logits there already
            head = target.get_output_embeddings()
            logits = p.target_logits if confidence else block_target_logits(drafter, features[1], blocks, head)
            wanted = logits.argmax(-1)
        if confidence:
            if p.confidence_logits is None:
                raise ValueError("This drafter has no confidence head; there is nothing to calibrate.")
            parts["confidence_logits"].append(p.confidence_logits[full])
            parts["labels"].append((p.draft_logits.argmax(-1) == wanted).cumprod(-1)[full].float())
        if trees:
            h = drafter.block_hidden(features[0], ids, blocks, embed)  # (B, N, γ, d)
            parts["hidden"].append(h[full].float())
            parts["anchors"].append(torch.gather(ids, 1, blocks.anchors)[full])
            parts["tokens"].append(wanted[full])
    return HeldOutBlocks(**{name: torch.cat(found) if found else None for name, found in parts.items()})


def collect_confidence(drafter, target, dataset, **blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw confidence logits and greedy prefix-acceptance labels of fully supervised held-out blocks: (N, γ) each
    (`collect_held_out_blocks`' keyword arguments)."""
    held_out = collect_held_out_blocks(drafter, target, dataset, **blocks, trees=False)
    return held_out.confidence_logits, held_out.labels


def collect_tree_blocks(drafter, target, dataset, **blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fully supervised held-out blocks as decoding drafts them: block hidden states (N, γ, d), anchor tokens (N,)
    and the tokens the target emits after the anchor (N, γ); the same batches and blocks as `collect_confidence`."""
    held_out = collect_held_out_blocks(drafter, target, dataset, **blocks, confidence=False)
    return held_out.hidden, held_out.anchors, held_out.tokens


@torch.no_grad()
def tree_fit_data(drafter, lm_head, hidden, anchors, tokens, ranks: int = TREE_RANKS, chunk: int = 64):
    """Teacher-forced children of the target's path: probs (N, γ, R), the draft probabilities of the top R
    candidates at each depth (a node's children, best first); hits (N, γ, R), whether the target's token is that
    child; reach (N, γ), whether every earlier target token is among its depth's top R (the path so far could be
    in a tree that branches R ways, and accepted)."""
    probs, hits = [], []
    for i in range(0, hidden.shape[0], chunk):
        h, want = hidden[i : i + chunk], tokens[i : i + chunk]
        prev = torch.cat([anchors[i : i + chunk, None], want[:, :-1]], dim=1)  # (n, γ): teacher forcing
        logits = drafter.draft_base_logits(h, lm_head)
        bias, _ = drafter.draft_sequential_bias(prev, h)
        if bias is not None:
            logits = logits + bias
        top = torch.softmax(logits.float(), dim=-1).topk(ranks, dim=-1)
        probs.append(top.values)
        hits.append(top.indices == want[..., None])
    probs, hits = torch.cat(probs), torch.cat(hits)
    return probs, hits, tree_reach(hits)


def tree_reach(hits: torch.Tensor) -> torch.Tensor:
    """(N, γ, R) hits -> (N, γ): every earlier depth's target token is one of its top R children."""
    inside = hits.any(-1).long()
    return torch.cat([torch.ones_like(inside[:, :1]), inside[:, :-1].cumprod(-1)], dim=1).bool()


def prob_logits(probs: torch.Tensor) -> torch.Tensor:
    """logit(p) with p clipped as `trees.calibrated` clips it."""
    from ..decoding.trees import PROB_FLOOR

    p = probs.double().clamp(PROB_FLOOR, 1.0 - PROB_FLOOR)
    return torch.log(p / (1.0 - p))


def fit_logistic(x: torch.Tensor, y: torch.Tensor, ridge: float = TREE_RIDGE, steps: int = 50) -> list[float]:
    """[a, b] minimising Σ BCE(σ(a·x + b), y) + ridge·((a - 1)² + b²) by damped Newton; a kept >= 0.01 (an
    increasing map: the children's order by draft probability stays theirs)."""
    x, y = x.double(), y.double()
    theta = torch.tensor([1.0, 0.0], dtype=torch.double)
    prior = torch.tensor([1.0, 0.0], dtype=torch.double)
    design = torch.stack([x, torch.ones_like(x)], dim=1)  # (n, 2)

    def loss(t):
        z = design @ t
        return float(torch.nn.functional.softplus(z).sum() - (y * z).sum() + ridge * ((t - prior) ** 2).sum())

    for _ in range(steps):
        p = torch.sigmoid(design @ theta)
        grad = design.T @ (p - y) + 2 * ridge * (theta - prior)
        hess = design.T @ (design * (p * (1 - p))[:, None]) + 2 * ridge * torch.eye(2, dtype=torch.double)
        step = torch.linalg.solve(hess, grad)
        current, scale = loss(theta), 1.0
        while scale > 1e-4 and loss(theta - scale * step) > current:
            scale /= 2
        theta = theta - scale * step
        theta[0] = theta[0].clamp(min=0.01)
        if float(step.abs().max()) * scale < 1e-9:
            break
    return [float(theta[0]), float(theta[1])]


def fit_tree_calibration(probs, hits, reach, ridge: float = TREE_RIDGE) -> list[list[list[float]]]:
    """`config.tree_calibration` from `tree_fit_data`'s tensors: per depth, an [a, b] pair per rank, fitted on the
    blocks that reach that depth."""
    fit = []
    for k in range(probs.shape[1]):
        sel = reach[:, k]
        fit.append(
            [fit_logistic(prob_logits(probs[sel, k, j]), hits[sel, k, j], ridge) for j in range(probs.shape[2])]
        )
    return fit


def apply_tree_calibration(probs: torch.Tensor, fit) -> torch.Tensor:
    """(N, γ, R) draft probabilities -> their calibrated estimates under `fit` (`trees.calibrated`, vectorised)."""
    if fit is None:
        return probs.double()
    gamma, ranks = probs.shape[1], probs.shape[2]
    pairs = torch.tensor(
        [
            [fit[min(k, len(fit) - 1)][min(j, len(fit[min(k, len(fit) - 1)]) - 1)] for j in range(ranks)]
            for k in range(gamma)
        ],
        dtype=torch.double,
    )  # (γ, R, 2)
    return torch.sigmoid(pairs[..., 0] * prob_logits(probs) + pairs[..., 1])


def _ece_by_depth_and_rank(estimates, hits, reach, bins: int) -> list[list[float | None]]:
    """ECE per depth and rank of estimates (N, γ, R) against hits, over the blocks reaching each depth."""
    out = []
    for k in range(estimates.shape[1]):
        sel = reach[:, k]
        out.append(
            [
                expected_calibration_error(estimates[sel, k, j], hits[sel, k, j], bins) if sel.any() else None
                for j in range(estimates.shape[2])
            ]
        )
    return out


def _halves(n: int, seed: int = 0) -> list[torch.Tensor]:
    return list(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).chunk(2))


def tree_calibration_report(probs, hits, reach, fit, bins: int = 20) -> dict:
    """ECE per depth and rank: `before` (raw draft probabilities), `after` (under `fit`, fitted on these blocks) and
    `cross_fitted` (each half of the blocks under a fit on the other half); with the samples per depth and rank
    and the share of them that hit."""
    cross = torch.empty(probs.shape, dtype=torch.double)
    if probs.shape[0] >= MIN_BLOCKS:
        for part, rest in zip(_halves(probs.shape[0]), reversed(_halves(probs.shape[0]))):
            cross[part] = apply_tree_calibration(
                probs[part], fit_tree_calibration(probs[rest], hits[rest], reach[rest])
            )
    counts = reach.sum(0).tolist()
    return {
        "ranks": int(probs.shape[2]),
        "samples": counts,
        "hit_rate": [
            [float(hits[reach[:, k], k, j].float().mean()) if counts[k] else None for j in range(probs.shape[2])]
            for k in range(probs.shape[1])
        ],
        "ece_before": _ece_by_depth_and_rank(apply_tree_calibration(probs, None), hits, reach, bins),
        "ece_after": _ece_by_depth_and_rank(apply_tree_calibration(probs, fit), hits, reach, bins),
        "ece_cross_fitted": _ece_by_depth_and_rank(cross, hits, reach, bins),
        "fit": fit,
    }


def accepted_depth(tree, tokens: list[int]) -> int:
    """How deep the target's tokens `tokens` (after the anchor) walk into `tree` from the anchor."""
    node, depth = -1, 0
    for token in tokens:
        node = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == node and t == token), None)
        if node is None:
            break
        depth += 1
    return depth


@torch.no_grad()
def grow_block_trees(drafter, lm_head, hidden, anchors, budget: int = TREE_BUDGET, fit=None, chunk: int = 64):
    """Each held-out block's greedy tree as decoding grows it (`drafting.node_children`, `trees.grow_trees`), at
    most `budget` nodes, its estimates under `fit` (None: raw)."""
    from ..decoding.drafting import node_children
    from ..decoding.trees import grow_trees

    gamma, trees = hidden.shape[1], []
    for i in range(0, hidden.shape[0], chunk):
        h = hidden[i : i + chunk]
        base = drafter.draft_base_logits(h, lm_head)  # (n, γ, V)
        heads = anchors[i : i + chunk].tolist()

        def expand(entries, h=h, base=base, heads=heads):
            return node_children(drafter, h, base, heads, entries, budget, None, fit)

        trees += grow_trees(expand, h.shape[0], [gamma] * h.shape[0], budget)
    return trees


def tree_depth_check(drafter, lm_head, hidden, anchors, tokens, fit, budget: int = TREE_BUDGET, data=None) -> dict:
    """Predicted against measured accepted depth of every held-out block's tree with all its nodes verified,
    raw and calibrated: predicted = the mean sum of the nodes' path estimates, measured = the mean depth the target's
    tokens accept (± its standard error). With `data`, `tree_fit_data`'s (probs, hits, reach) of the same blocks,
    the calibrated trees are cross-fitted (each half of the blocks under a fit on the other half); else under `fit`."""
    n = hidden.shape[0]
    parts = [(torch.arange(n), fit)]
    if data is not None and n >= MIN_BLOCKS:
        probs, hits, reach = data
        parts = [
            (part, fit_tree_calibration(probs[rest], hits[rest], reach[rest]))
            for part, rest in zip(_halves(n), reversed(_halves(n)))
        ]
    out = {"budget": budget, "blocks": n}
    for name in ("raw", "calibrated"):
        predicted, measured = [], []
        for part, part_fit in parts:
            use = None if name == "raw" else part_fit
            trees = grow_block_trees(drafter, lm_head, hidden[part], anchors[part], budget, use)
            predicted += [sum(tree.scores) for tree in trees]
            measured += [accepted_depth(tree, want) for tree, want in zip(trees, tokens[part].tolist())]
        m = torch.tensor(measured, dtype=torch.double)
        out[name] = {
            "predicted": float(sum(predicted) / max(n, 1)),
            "measured": float(m.mean()) if n else 0.0,
            "measured_stderr": float(m.std() / n**0.5) if n > 1 else None,
        }
    return out


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
    source: str | os.PathLike,
    out: str | os.PathLike,
    temperatures,
    report: dict,
    overwrite: bool = False,
    tree_calibration=None,
) -> Path:
    """Write a calibrated copy of the drafter checkpoint `source` (a local folder, or a Hub id: its snapshot in the
    cache, fetched if need be) to `out`: its files, with `sts_temperatures` = `temperatures` in config.json (and
    `tree_calibration` where given), and `report` as calibration.json. `source` is only read.

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
        if tree_calibration is not None:
            config.tree_calibration = tree_calibration
            config.check_runtime_settings()
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
    "accepted_depth",
    "apply_tree_calibration",
    "collect_held_out_blocks",
    "collect_tree_blocks",
    "HeldOutBlocks",
    "fit_logistic",
    "fit_tree_calibration",
    "grow_block_trees",
    "tree_calibration_report",
    "tree_depth_check",
    "tree_fit_data",
    "tree_reach",
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
