"""STS calibration: metrics on hand-made cases, STS lowers ECE and keeps AUROC on a synthetic set, end to end."""

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.training import calibration
from dspark_hf.training.calibration import (
    auroc,
    calibration_report,
    collect_confidence,
    cross_fitted_survival,
    expected_calibration_error,
    fit_sts,
    reliability_diagram,
)
from dspark_hf.training.dataset import TokenDataset


def test_metrics_on_hand_made_cases():
    assert expected_calibration_error(torch.tensor([0.25, 0.25, 0.75, 0.75]), torch.tensor([0, 1, 1, 1.0])) == (
        pytest.approx((2 * 0.25 + 2 * 0.25) / 4)
    )
    assert auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])) is None


def synthetic(n=4000, gamma=3, overconfidence=3.0, seed=0):
    """True conditional acceptance p_k = σ(z_k); the head reports z_k·3 (over-confident)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, gamma, generator=gen)
    accepted = torch.rand(n, gamma, generator=gen) < torch.sigmoid(z)
    return z * overconfidence, accepted.long().cumprod(-1).float()


def test_sts_lowers_ece_and_keeps_ranking():
    logits, labels = synthetic()
    temps = fit_sts(logits, labels)
    report = calibration_report(logits, labels, temps)
    for k in range(3):
        assert report["after"]["ece"][k] < report["before"]["ece"][k] / 2
        assert report["after"]["auroc"][0] == pytest.approx(report["before"]["auroc"][0])
    assert temps[0] == pytest.approx(3.0, rel=0.25)  # recovers the over-confidence factor at position 1


def test_cross_fitted_scores_each_block_under_temperatures_fitted_elsewhere(monkeypatch):
    logits, labels = synthetic()
    report = calibration_report(logits, labels, fit_sts(logits, labels), folds=2)
    assert report["folds"] == 2 and len(report["cross_fitted"]["ece"]) == 3
    for k in range(3):  # real over-confidence: STS fitted on half the blocks still helps on the other half
        assert report["cross_fitted"]["ece"][k] < report["before"]["ece"][k] / 2

    fitted_on = []
    original = calibration.fit_sts

    def recording(fit_logits, fit_labels, **kwargs):
        fitted_on.append({tuple(row.tolist()) for row in fit_logits})
        return original(fit_logits, fit_labels, **kwargs)

    monkeypatch.setattr(calibration, "fit_sts", recording)
    small_logits, small_labels = logits[:40], labels[:40]
    cross_fitted_survival(small_logits, small_labels, folds=4)
    every = {tuple(row.tolist()) for row in small_logits}
    assert len(fitted_on) == 4 and all(len(rows) == 30 for rows in fitted_on)  # 3 of 4 folds each time
    assert set.union(*[every - rows for rows in fitted_on]) == every  # each block held out exactly once
    with pytest.raises(ValueError, match="folds"):
        cross_fitted_survival(small_logits, small_labels, folds=1)
    assert "cross_fitted" not in calibration_report(logits, labels, torch.ones(3), folds=0)


def test_collect_confidence_and_reliability_png(tmp_path):
    target = make_target()
    drafter = make_drafter(target, block_size=3)
    seqs = [torch.randint(0, 99, (30,)).tolist() for _ in range(6)]
    ds = TokenDataset.from_sequences(seqs, [2] * 6)
    logits, labels = collect_confidence(drafter, target, ds, seq_len=32, batch_size=2, num_anchors=8, num_batches=2)
    assert logits.shape == labels.shape and logits.shape[1] == 3 and logits.shape[0] > 0
    assert ((labels[:, 1:] <= labels[:, :-1]) | (labels[:, 1:] == 0)).all()  # prefix labels are non-increasing
    pytest.importorskip("matplotlib", reason="the reliability diagram needs matplotlib (the [dev] extra)")
    reliability_diagram(logits, labels, fit_sts(logits, labels), tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_calibrate_cli_writes_a_calibrated_copy_to_out(tmp_path):
    import json

    from dspark_hf import DSparkDraftModel
    from dspark_hf.cli import main
    from helpers import char_tokenizer

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(99).save_pretrained(tmp_path / "target")
    make_drafter(target, block_size=3).save_pretrained(tmp_path / "drafter")
    original = (tmp_path / "drafter/config.json").read_bytes()
    seqs = [torch.randint(0, 99, (30,)).tolist() for _ in range(6)]
    TokenDataset.from_sequences(seqs, [2] * 6).save(tmp_path / "heldout.npz")
    code = main(
        [
            "calibrate",
            "--data",
            str(tmp_path / "heldout.npz"),
            "--seq-len",
            "32",
            "--batches",
            "2",
            "--anchors",
            "8",
            "--target",
            str(tmp_path / "target"),
            "--drafter",
            str(tmp_path / "drafter"),
            "--out",
            str(tmp_path / "calibrated"),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "calibrated/calibration.json").read_text())
    drafter = DSparkDraftModel.from_pretrained(tmp_path / "calibrated")
    assert drafter.config.sts_temperatures == pytest.approx(report["temperatures"])
    assert (tmp_path / "drafter/config.json").read_bytes() == original  # the drafter it read is unchanged
    assert not (tmp_path / "drafter/calibration.json").exists()
    assert len(report["cross_fitted"]["ece"]) == 3 and report["folds"] == 2


def test_calibrate_cli_refuses_a_used_out_and_overwrites_it_whole(tmp_path, capsys):
    """`--out` holding other files: refused without `--overwrite` (one line, before any model loads); with it, the
    folder is replaced by the calibrated copy alone (nothing of what was there stays mixed in)."""
    from dspark_hf import DSparkDraftModel
    from dspark_hf.cli import main
    from helpers import char_tokenizer

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(99).save_pretrained(tmp_path / "target")
    make_drafter(target, block_size=3).save_pretrained(tmp_path / "drafter")
    seqs = [torch.randint(0, 99, (30,)).tolist() for _ in range(6)]
    TokenDataset.from_sequences(seqs, [2] * 6).save(tmp_path / "heldout.npz")
    out = tmp_path / "calibrated"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["calibrate", "--data", tmp_path / "heldout.npz", "--seq-len", 32, "--batches", 2, "--anchors", 8]
    argv = [str(a) for a in [*argv, "--target", tmp_path / "target", "--drafter", tmp_path / "drafter", "--out", out]]
    capsys.readouterr()  # the progress bars of the saves above
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {out} exists and is not an empty folder; pass --overwrite" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main([*argv, "--overwrite"]) == 0
    assert not (out / "notes.txt").exists() and (out / "calibration.json").is_file()
    assert DSparkDraftModel.from_pretrained(out).config.sts_temperatures is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibrated", "drafter", "heldout.npz", "target"]
