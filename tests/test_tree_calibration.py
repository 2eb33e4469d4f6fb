"""Calibrated tree node estimates (`config.tree_calibration`): the per-depth, per-rank fit recovers a known truth,
calibrated path estimates sum to a tree's expected accepted depth, decoding stays lossless, the field is saved,
loaded and checked, and `dspark-hf calibrate` fits and reports it."""

import json
import math

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf import DSparkConfig, DSparkDraftModel
from dspark_hf.decoding.trees import calibrated, grow_trees
from dspark_hf.training.calibration import (
    accepted_depth,
    apply_tree_calibration,
    collect_tree_blocks,
    fit_tree_calibration,
    grow_block_trees,
    tree_calibration_report,
    tree_fit_data,
    tree_reach,
)
from dspark_hf.training.dataset import TokenDataset


def sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


# The truth of a synthetic drafter: its children's draft probabilities q_j lie in these ranges (rank order), and the
# target's token is the rank-j child with probability σ(A·logit(q_j) + B), [A, B] per depth and rank (the top child
# under-confident, the others over-confident, as measured on the embedded pair). Per depth the three sum to < 1.
Q_RANGES = [(0.2, 0.45), (0.06, 0.18), (0.01, 0.05)]
TRUTH = [
    [[1.0, 1.4], [1.0, -0.3], [1.0, -0.5]],
    [[1.3, 1.6], [0.8, -0.6], [1.0, -0.7]],
    [[1.5, 1.9], [0.7, -0.8], [1.2, -0.5]],
]


def true_conditional(q: float, depth: int, rank: int) -> float:
    a, b = TRUTH[depth - 1][rank]
    return sigmoid(a * logit(q) + b)


def synthetic_blocks(n: int, seed: int = 0):
    """n held-out blocks of the synthetic drafter: probs (n, 3, 3), hits (n, 3, 3) and reach (n, 3), drawn as
    `tree_fit_data` collects them (the target's token at each depth is one child, or none of the top 3)."""
    gen = torch.Generator().manual_seed(seed)
    gamma, ranks = len(TRUTH), len(Q_RANGES)
    low = torch.tensor([lo for lo, _ in Q_RANGES], dtype=torch.double)
    high = torch.tensor([hi for _, hi in Q_RANGES], dtype=torch.double)
    probs = low + (high - low) * torch.rand(n, gamma, ranks, generator=gen, dtype=torch.double)
    a = torch.tensor([[pair[0] for pair in depth] for depth in TRUTH], dtype=torch.double)
    b = torch.tensor([[pair[1] for pair in depth] for depth in TRUTH], dtype=torch.double)
    truth = torch.sigmoid(a * torch.log(probs / (1 - probs)) + b)  # (n, γ, R)
    assert float(truth.sum(-1).max()) < 1.0
    edges = truth.cumsum(-1)  # one uniform draw picks the rank (or none) at each depth
    u = torch.rand(n, gamma, 1, generator=gen, dtype=torch.double)
    rank = (u > edges).sum(-1)  # 0..R-1: that child; R: none of them
    hits = rank[..., None] == torch.arange(ranks)
    return probs, hits, tree_reach(hits)


def fit_error_bound(samples: int) -> float:
    """A bound on a fitted conditional's error at the draft probabilities in use: a two-parameter fit from n samples
    is about as precise as a proportion from n / 2 (standard deviation at most 0.5·√(2 / n)); four of those."""
    return 4 * 0.5 * math.sqrt(2 / samples)


def test_fitted_estimates_recover_a_known_ground_truth():
    probs, hits, reach = synthetic_blocks(40_000)
    fit = fit_tree_calibration(probs, hits, reach)
    assert len(fit) == 3 and all(len(depth) == 3 for depth in fit)
    worst_raw = 0.0
    for depth in (1, 2, 3):
        bound = fit_error_bound(int(reach[:, depth - 1].sum()))
        for rank, (low, high) in enumerate(Q_RANGES):
            for q in torch.linspace(low, high, 7).tolist():
                truth = true_conditional(q, depth, rank)
                children = [q if j == rank else 0.5 for j in range(rank + 1)]
                assert calibrated(children, depth, fit)[rank] == pytest.approx(truth, abs=bound)
                worst_raw = max(worst_raw, abs(q - truth))
    assert worst_raw > 0.2  # the raw probabilities are far off: the fit, not the data, matches the truth
    report = tree_calibration_report(probs, hits, reach, fit)
    for k in range(3):
        for j in range(3):  # ECE per depth and rank, cross-fitted included, falls to the noise floor
            assert report["ece_cross_fitted"][k][j] < max(0.02, report["ece_before"][k][j] / 4)
    assert report["samples"][0] == 40_000 and report["samples"][2] < report["samples"][1] < 40_000


def synthetic_tree(fit, budget: int = 10):
    """The synthetic drafter's best-first tree (depth 3, three children a node, their draft probabilities fixed by
    the node's path), its estimates under `fit`; returns it with the true conditional of each node."""
    truth_of = {}

    def children_of(path):
        gen = torch.Generator().manual_seed(hash(tuple(path)) % 2**31)
        return [lo + (hi - lo) * float(torch.rand(1, generator=gen)) for lo, hi in Q_RANGES]

    def expand(entries):
        out = []
        for _, tree, node in entries:
            path = tree.path(node)
            depth = len(path) + 1
            qs = children_of(path)
            tokens = [10 * len(path) + j + 1 for j in range(len(qs))]  # distinct among siblings
            for j, (token, q) in enumerate(zip(tokens, qs)):
                truth_of[(*path, token)] = true_conditional(q, depth, j)
            out.append((tokens, calibrated(qs, depth, fit), None))
        return out

    (tree,) = grow_trees(expand, 1, caps=[3], budget=budget)
    truths = [truth_of[tuple(tree.path(i))] for i in range(len(tree.tokens))]
    return tree, truths


def expected_depth(tree, truths) -> float:
    """Exactly: Σ over nodes of P(its whole path accepted) = Σ Π of the true conditionals along the path."""
    total = 0.0
    for i in range(len(tree.tokens)):
        p, node = 1.0, i
        while node >= 0:
            p *= truths[node]
            node = tree.parents[node]
        total += p
    return total


def test_calibrated_path_estimates_sum_to_the_expected_depth():
    probs, hits, reach = synthetic_blocks(200_000, seed=1)
    fit = fit_tree_calibration(probs, hits, reach)
    tree, truths = synthetic_tree(fit)
    exact = expected_depth(tree, truths)
    # |Π a_i - Π b_i| <= Σ |a_i - b_i| for numbers in [0, 1]: each node's path estimate is off by at most its depth
    # times the bound on one fitted conditional (the deepest depth has the fewest samples)
    bound = fit_error_bound(int(reach[:, -1].sum()))
    tolerance = bound * sum(tree.depths)
    assert abs(sum(tree.scores) - exact) <= tolerance
    assert tolerance < 0.15 * exact  # a test that can fail: the tolerance is a small part of the depth
    raw, raw_truths = synthetic_tree(None)  # without the fit: the raw draft probabilities, far off
    assert abs(sum(raw.scores) - expected_depth(raw, raw_truths)) > 3 * tolerance
    assert tree.scores == sorted(tree.scores, reverse=True)  # still best-first: estimates fall along every path


def test_greedy_with_a_calibrated_tree_is_plain_greedy():
    target = make_target()
    drafter = make_drafter(target, verify_policy="fixed")
    drafter.config.tree_budget = 8
    ids = torch.randint(0, 99, (2, 6))
    ref = target.generate(ids, do_sample=False, max_new_tokens=18)
    runs = {}
    for name, fit in (("raw", None), ("calibrated", [[[0.5, 2.0], [3.0, 1.0], [0.3, 4.0]]] * 4)):
        drafter.config.tree_calibration = fit
        out = target.generate(ids, do_sample=False, max_new_tokens=18, assistant_model=drafter)
        assert torch.equal(ref, out)
        runs[name] = drafter.generation_stats.survivals
    assert runs["raw"] != runs["calibrated"]  # the fit changed the trees' estimates, and nothing of the output
    assert max(s[0] for s in runs["calibrated"] if s) > max(s[0] for s in runs["raw"] if s)


def test_tree_calibration_is_saved_loaded_and_checked(tmp_path):
    target = make_target()
    drafter = make_drafter(target, block_size=3)
    assert drafter.config.tree_calibration is None  # the default: raw draft probabilities
    fit = [[[1.2, 0.3], [0.9, -0.4]], [[1.1, 0.2]], [[2.0, -1.5], [0.7, 0.0], [1.0, 0.1]]]
    drafter.config.tree_calibration = fit
    drafter.save_pretrained(tmp_path / "d")
    assert DSparkDraftModel.from_pretrained(tmp_path / "d").config.tree_calibration == fit

    fields = dict(num_hidden_layers=2, block_size=3, target_layer_ids=[0, 2])
    bad = {
        "two depths for a block of 3": fit[:2],
        "a zero scale": [[[0.0, 1.0]], [[1.0, 0.0]], [[1.0, 0.0]]],
        "a NaN shift": [[[1.0, float("nan")]], [[1.0, 0.0]], [[1.0, 0.0]]],
        "no ranks at a depth": [[[1.0, 0.0]], [], [[1.0, 0.0]]],
        "a list of numbers": [1.0, 2.0, 3.0],
    }
    for value in bad.values():
        with pytest.raises(ValueError, match="`tree_calibration` must be None or, for each of the 3 draft depths"):
            DSparkConfig.for_target(target.config, tree_calibration=value, **fields)
    config = json.loads((tmp_path / "d/config.json").read_text())
    config["tree_calibration"] = bad["a zero scale"]
    (tmp_path / "d/config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="refit it with `dspark-hf calibrate`"):
        DSparkDraftModel.from_pretrained(tmp_path / "d")
    drafter.config.tree_calibration = bad["two depths for a block of 3"]  # set on a live drafter: refused at generate
    drafter.config.tree_budget = 4
    with pytest.raises(ValueError, match="tree_calibration"):
        target.generate(torch.randint(0, 99, (1, 4)), max_new_tokens=4, assistant_model=drafter)


def test_held_out_trees_are_the_trees_decoding_grows():
    """`collect_tree_blocks` / `tree_fit_data` / `grow_block_trees` on a tiny pair: the fit data's rank-1 child at
    depth 1 is each tree's first node, and the calibrated trees' estimates are the fit's map of it."""
    target = make_target()
    drafter = make_drafter(target, block_size=3)
    seqs = [torch.randint(0, 99, (30,)).tolist() for _ in range(6)]
    data = TokenDataset.from_sequences(seqs, [2] * 6)
    hidden, anchors, tokens = collect_tree_blocks(
        drafter, target, data, seq_len=32, batch_size=2, num_anchors=8, num_batches=2
    )
    lm_head = target.get_output_embeddings()
    probs, hits, reach = tree_fit_data(drafter, lm_head, hidden, anchors, tokens, ranks=2)
    assert probs.shape == hits.shape == (hidden.shape[0], 3, 2) and reach[:, 0].all()
    trees = grow_block_trees(drafter, lm_head, hidden, anchors, budget=5)
    assert [t.scores[0] for t in trees] == pytest.approx(probs[:, 0, 0].tolist(), rel=1e-4)
    for tree, want, hit in zip(trees, tokens.tolist(), hits):
        if hit[0].any():  # the target's first token is one of the anchor's top two children: in the tree
            assert accepted_depth(tree, want) >= 1
        roots = [t for t, parent in zip(tree.tokens, tree.parents) if parent < 0]
        assert (accepted_depth(tree, want) >= 1) == (want[0] in roots)
    fit = [[[1.0, 2.0], [1.0, -1.0]]] * 3  # the rank-1 child stays the best
    calibrated_trees = grow_block_trees(drafter, lm_head, hidden, anchors, budget=5, fit=fit)
    first = apply_tree_calibration(probs[:, :1, :1], fit)[:, 0, 0]
    assert [t.scores[0] for t in calibrated_trees] == pytest.approx(first.tolist(), rel=1e-4)
    # a fit that prices every rank-2 child far above its rank-1 sibling: the first node is the anchor's rank-2
    # child, and with room for one more node its best child by estimate (its rank-2 one) joins, not its first by rank
    second = [[[1.0, -5.0], [1.0, 5.0]]] * 3
    (two,) = grow_block_trees(drafter, lm_head, hidden[:1], anchors[:1], budget=2, fit=second)
    assert two.scores[0] == pytest.approx(calibrated([float(probs[0, 0, 0]), float(probs[0, 0, 1])], 1, second)[1])
    assert two.depths == [1, 2] and two.scores[1] > 0.5 * two.scores[0]


def test_held_out_blocks_take_one_target_forward_per_batch_for_both_fits():
    """`dspark-hf calibrate` collects the confidence head's labels and the tree fit's blocks in one target forward per
    batch. The two parts are of the same blocks: a block's prefix survives to depth k exactly when the target's
    token was the rank-1 child at every depth up to k in the tree fit's data. The single-part collectors give the
    same as the combined one; `against_target` follows the target's own greedy tokens instead of the data's."""
    from dspark_hf.training.calibration import collect_confidence, collect_held_out_blocks

    target = make_target()
    drafter = make_drafter(target, block_size=3)
    data = TokenDataset.from_sequences([torch.randint(0, 99, (30,)).tolist() for _ in range(6)], [2] * 6)
    blocks = dict(seq_len=32, batch_size=2, num_anchors=8, num_batches=2)
    calls = []
    hook = target.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        held = collect_held_out_blocks(drafter, target, data, **blocks)
        assert len(calls) == 2  # one per batch
        own = collect_held_out_blocks(drafter, target, data, **blocks, against_target=True)
    finally:
        hook.remove()
    n = held.tokens.shape[0]
    assert n > 0 and held.labels.shape == held.confidence_logits.shape == held.tokens.shape == (n, 3)
    assert held.hidden.shape[:2] == (n, 3) and held.anchors.shape == (n,)
    lm_head = target.get_output_embeddings()
    hits = tree_fit_data(drafter, lm_head, held.hidden, held.anchors, held.tokens)[1]
    assert torch.equal(held.labels.bool(), hits[..., 0].cumprod(-1).bool())
    assert held.labels.any() and not held.labels.all()  # both outcomes occur, so the comparison says something
    # the random target's greedy tokens are not the data's: other tokens, the same blocks
    assert torch.equal(own.anchors, held.anchors) and torch.equal(own.hidden, held.hidden)
    assert not torch.equal(own.tokens, held.tokens)
    logits, labels = collect_confidence(drafter, target, data, **blocks)
    assert torch.equal(logits, held.confidence_logits) and torch.equal(labels, held.labels)
    passes = []  # the tree fit's blocks need no drafter training pass
    original = type(drafter).training_logits
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(drafter), "training_logits", lambda *a, **k: passes.append(1) or original(*a, **k))
        hidden, anchors, tokens = collect_tree_blocks(drafter, target, data, **blocks)
        assert torch.equal(collect_tree_blocks(drafter, target, data, **blocks, against_target=True)[2], own.tokens)
    assert torch.equal(hidden, held.hidden) and torch.equal(anchors, held.anchors) and torch.equal(tokens, held.tokens)
    assert passes == []


def test_calibrate_cli_fits_and_reports_tree_estimates(tmp_path, capsys):
    from dspark_hf.cli import main
    from helpers import char_tokenizer

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(99).save_pretrained(tmp_path / "target")
    make_drafter(target, block_size=3).save_pretrained(tmp_path / "drafter")
    seqs = [torch.randint(0, 99, (30,)).tolist() for _ in range(6)]
    TokenDataset.from_sequences(seqs, [2] * 6).save(tmp_path / "heldout.npz")
    argv = ["calibrate", "--data", tmp_path / "heldout.npz", "--seq-len", 32, "--batches", 2, "--anchors", 8]
    argv += ["--target", tmp_path / "target", "--drafter", tmp_path / "drafter", "--out", tmp_path / "cal"]
    capsys.readouterr()
    assert main([str(a) for a in [*argv, "--tree-ranks", 2, "--tree-budget", 6]]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "cal/calibration.json").read_text())["tree"]
    fit = DSparkDraftModel.from_pretrained(tmp_path / "cal").config.tree_calibration
    assert fit == report["fit"] and len(fit) == 3 and all(len(depth) == 2 for depth in fit)
    assert len(report["ece_before"]) == len(report["ece_after"]) == 3 and len(report["ece_before"][0]) == 2
    assert report["depth"]["budget"] == 6
    for name in ("raw", "calibrated"):
        assert {"predicted", "measured"} <= set(report["depth"][name])
    assert "depth 1 (" in printed and "r2 " in printed
    assert "tree 6 (calibrated estimates, cross-fitted): expected accepted depth predicted" in printed
    assert main([str(a) for a in [*argv, "--overwrite", "--tree-budget", 0]]) == 2
    assert "--tree-budget must be >= 1, got 0." in capsys.readouterr().err
