"""`dspark-hf calibrate`: STS temperatures and the tree node estimates (`tree_calibration`) fitted on held-out data,
and a calibrated copy of the drafter written to `--out` (`training/calibration.py`); the drafter it reads is never
changed."""

from pathlib import Path

from ..training.calibration import TREE_BUDGET, TREE_RANKS
from .checks import at_least, check_dataset, check_model_path, check_out_folder, require
from .loading import add_model_args, load_models


PACKAGE = Path(__file__).resolve().parents[1]  # the installed dspark_hf, which holds the shipped drafter


def add_parser(subparsers):
    cal = subparsers.add_parser(
        "calibrate",
        help="fit STS temperatures and tree node estimates on held-out data; write a calibrated copy of the drafter "
        "to --out",
    )
    cal.add_argument("--data", required=True, help="held-out token dataset (.npz)")
    cal.add_argument(
        "--out", required=True, help="folder for the calibrated copy of the drafter (the drafter itself is unchanged)"
    )
    cal.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    cal.add_argument("--seq-len", type=int, default=512)
    cal.add_argument("--batches", type=int, default=8)
    cal.add_argument("--anchors", type=int, default=64)
    cal.add_argument("--png", default=None, help="write a reliability diagram here")
    cal.add_argument(
        "--tree-ranks",
        type=int,
        default=None,
        help=f"child ranks per depth whose tree estimates are fitted one by one (default {TREE_RANKS})",
    )
    cal.add_argument(
        "--tree-budget",
        type=int,
        default=None,
        help=f"nodes of the trees whose predicted and measured accepted depth are reported (default {TREE_BUDGET})",
    )
    add_model_args(cal)
    return cal


def run(args) -> int:
    from ..training.calibration import (
        MIN_BLOCKS,
        calibration_report,
        collect_held_out_blocks,
        fit_sts,
        fit_tree_calibration,
        reliability_diagram,
        tree_calibration_report,
        tree_depth_check,
        tree_fit_data,
        write_calibrated_copy,
    )

    drafter_path = args.drafter or str(PACKAGE / "default_drafter")  # the shipped drafter is read, never written
    out, dataset = _check_args(args, drafter_path)
    args.drafter = drafter_path
    target, _, drafter = load_models(args)
    # the same batches and anchors for the confidence head's fit and the tree's; a quantized target's own greedy
    # tokens decide acceptance
    blocks = dict(
        seq_len=args.seq_len,
        num_batches=args.batches,
        num_anchors=args.anchors,
        against_target=args.quantize is not None,
    )
    held_out = collect_held_out_blocks(drafter, target, dataset, **blocks)  # one target forward per batch
    logits, labels = held_out.confidence_logits, held_out.labels
    block = drafter.config.block_size
    require(len(labels) >= MIN_BLOCKS, _too_short(args.data, block, f"gave {len(labels)} in --batches"))
    temps = fit_sts(logits, labels)
    report = calibration_report(logits, labels, temps)
    report["shipped"] = calibration_report(logits, labels, drafter.sts_temperatures, folds=0)["after"]  # its own T
    report["quantize"] = args.quantize
    ranks = args.tree_ranks or TREE_RANKS
    budget = args.tree_budget or TREE_BUDGET
    hidden, anchors, tokens = held_out.hidden, held_out.anchors, held_out.tokens
    lm_head = target.get_output_embeddings()
    probs, hits, reach = tree_fit_data(drafter, lm_head, hidden, anchors, tokens, ranks)
    fit = fit_tree_calibration(probs, hits, reach)
    report["tree"] = tree_calibration_report(probs, hits, reach, fit)
    report["tree"]["depth"] = tree_depth_check(
        drafter, lm_head, hidden, anchors, tokens, fit, budget, data=(probs, hits, reach)
    )
    write_calibrated_copy(drafter_path, out, temps, report, overwrite=args.overwrite, tree_calibration=fit)
    shipped_ece, fitted_ece = (sum(report[k]["ece"]) / len(temps) for k in ("shipped", "cross_fitted"))
    print(f"mean ECE with the checkpoint's temperatures {shipped_ece:.4f} -> refitted (cross-fitted) {fitted_ece:.4f}")
    if args.png:
        reliability_diagram(logits, labels, temps, args.png)
    _print_report(report, temps, out)
    return 0


def _check_args(args, drafter_path: str):
    """(--out as a Path, the held-out dataset): numbers, --out outside the package and the drafter, the models, and
    enough full blocks in --data for the drafter's block size, before any model loads."""
    from ..models.settings import MAX_TREE_BUDGET
    from ..training.calibration import MIN_BLOCKS, count_full_blocks

    at_least(args, 1, "seq_len", "batches", "anchors", "tree_ranks", "tree_budget")
    require(
        args.tree_budget is None or args.tree_budget <= MAX_TREE_BUDGET,
        f"--tree-budget must be <= {MAX_TREE_BUDGET} (the most nodes a tree may have), got {args.tree_budget}.",
    )
    keep_out = [(PACKAGE, "the installed dspark_hf package")]
    if Path(drafter_path).expanduser().is_dir():
        keep_out.append((drafter_path, "the drafter being calibrated, which is never changed in place"))
    out = check_out_folder(args.out, "--out", args.overwrite, keep_out)
    check_model_path(args.target, "--target")
    config = check_model_path(drafter_path, "--drafter", drafter=True)
    dataset = check_dataset(args.data, "--data")
    block = None if config is None else config.block_size
    if block is not None:
        blocks = count_full_blocks(dataset, block, args.seq_len)
        require(blocks >= MIN_BLOCKS, _too_short(args.data, block, f"holds {blocks}"))
    return out, dataset


def _print_report(report: dict, temps, out: Path) -> None:
    """Per position: T, ECE before -> after (and cross-fitted), AUROC; and a note when STS does not help here."""
    crossed = report["cross_fitted"]["ece"]
    for k, (b, a) in enumerate(zip(report["before"]["ece"], report["after"]["ece"]), start=1):
        auc = report["after"]["auroc"][k - 1]
        auc = "-" if auc is None else f"{auc:.3f}"
        print(
            f"position {k}: T = {temps[k - 1]:.3f}  ECE {b:.4f} -> {a:.4f} (cross-fitted {crossed[k - 1]:.4f})  "
            f"AUROC {auc}"
        )
    _print_tree_report(report["tree"])
    print(f"{report['num_blocks']} held-out blocks; the calibrated drafter (config.json, calibration.json): {out}")
    before, after = (sum(report[key]["ece"]) / len(crossed) for key in ("before", "cross_fitted"))
    if after >= before:
        print(
            f"note: fitted on other blocks, STS does not lower the mean ECE here ({before:.4f} -> {after:.4f}); "
            "the head is about as calibrated as these blocks can tell; more of them (--batches) would say more."
        )


def _print_tree_report(tree: dict) -> None:
    """Tree node estimates: per depth, the ECE of each rank's estimate before -> after (cross-fitted), and the
    predicted against measured accepted depth of the held-out blocks' trees, raw and calibrated."""

    def ece(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    print("tree node estimates, P(target token = rank-j child | parent accepted), ECE raw -> fitted (cross-fitted):")
    for k, n in enumerate(tree["samples"]):
        if not n:
            print(f"  depth {k + 1}: no block reaches it (its maps stay the identity)")
            continue
        cells = [
            f"r{j + 1} {ece(b)}->{ece(a)} ({ece(c)})"
            for j, (b, a, c) in enumerate(
                zip(tree["ece_before"][k], tree["ece_after"][k], tree["ece_cross_fitted"][k])
            )
        ]
        print(f"  depth {k + 1} ({n} blocks): " + "  ".join(cells))
    depth = tree["depth"]
    for name in ("raw", "calibrated"):
        d = depth[name]
        err = "" if d["measured_stderr"] is None else f" ± {d['measured_stderr']:.3f}"
        print(
            f"tree {depth['budget']} ({name} estimates{', cross-fitted' if name == 'calibrated' else ''}): "
            f"expected accepted depth predicted {d['predicted']:.3f}, measured {d['measured']:.3f}{err} "
            f"({depth['blocks']} blocks, every node verified)"
        )


def _too_short(data, block_size: int, found: str) -> str:
    from ..training.calibration import MIN_BLOCKS

    return (
        f"--data {data} is too short to calibrate: a held-out block of this block-{block_size} drafter needs "
        f"{block_size + 1} supervised tokens in a row, and the data {found} such blocks; calibration needs at least "
        f"{MIN_BLOCKS}. Give more (or longer) held-out sequences."
    )
