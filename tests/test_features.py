"""Offline target features: exact dry-run size, resumable build, offline training equal to online, wrong caches."""

import json
import re

import pytest
import torch
from test_trainer import config, tiny_dataset

from conftest import make_target
from dspark_hf.cli import main
from dspark_hf.training import features as features_module
from dspark_hf.training.dataset import TokenDataset
from dspark_hf.training.features import FeatureCache, build_features
from dspark_hf.training.step import target_features
from dspark_hf.training.trainer import DSparkTrainer, build_drafter


LAYERS = [0, 2]


def files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_cli_dry_run_writes_nothing_and_predicts_the_exact_size(tmp_path, capsys):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    tiny_dataset().save(tmp_path / "train.npz")
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"target": str(tmp_path / "target"), "data": str(tmp_path / "train.npz")}))
    args = ["features", "--config", str(cfg), "--out", str(tmp_path / "cache"), "--shard-tokens", "100"]
    assert main(args + ["--dry-run", "--batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    assert "nothing written" in printed and not (tmp_path / "cache").exists()
    predicted = int(re.search(r"manifest = (\d+) bytes", printed).group(1))
    assert main(args + ["--batch-size", "4"]) == 0
    written = files(tmp_path / "cache")
    assert sum(len(b) for b in written.values()) == predicted
    # the data part is tokens x (m + 1)·d x 2 bytes (bf16); the rest is shard headers and the manifest
    manifest = json.loads(written["manifest.json"])
    m, d, tokens = len(manifest["layer_ids"]), manifest["hidden_size"], tiny_dataset().num_tokens
    overhead = predicted - tokens * (m + 1) * d * 2
    assert 0 < overhead < 200 * len(manifest["shards"]) + len(written["manifest.json"])


def test_interrupted_build_resumes_to_identical_shards(tmp_path, monkeypatch):
    target, ds = make_target(), tiny_dataset()
    build_features(target, ds, tmp_path / "a", LAYERS, shard_tokens=100, batch_size=3)
    reference = files(tmp_path / "a")
    assert len(reference) > 3  # several shards and the manifest

    real_save, calls = features_module.save_file, []

    def save_then_die(tensors, path):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"half a shard")  # what a kill -9 mid-write leaves behind
            raise KeyboardInterrupt
        real_save(tensors, path)

    monkeypatch.setattr(features_module, "save_file", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        build_features(target, ds, tmp_path / "b", LAYERS, shard_tokens=100, batch_size=3)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert [s["done"] for s in manifest["shards"]][:2] == [True, False]
    with pytest.raises(ValueError, match="incomplete"):
        FeatureCache(tmp_path / "b", ds)

    monkeypatch.setattr(features_module, "save_file", real_save)
    forwarded = []

    def counting(target, input_ids, layer_ids):
        forwarded.append(len(input_ids))
        return target_features(target, input_ids, layer_ids)

    monkeypatch.setattr(features_module, "target_features", counting)
    build_features(target, ds, tmp_path / "b", LAYERS, shard_tokens=100, batch_size=3)
    first_shard = manifest["shards"][0]["sequences"]
    assert sum(forwarded) == len(ds) - (first_shard[1] - first_shard[0])  # the finished shard was skipped
    resumed = files(tmp_path / "b")
    resumed.pop(".shard-00001.safetensors.tmp", None)  # the stray partial file, harmless (overwritten, never read)
    assert resumed == reference


def test_cached_windows_are_the_targets_features_of_the_whole_sequence(tmp_path):
    target, ds = make_target(), tiny_dataset()
    cache = FeatureCache(build_features(target, ds, tmp_path / "c", LAYERS, dtype="fp32", shard_tokens=64), ds)
    indices, offsets, _ = ds.sample_windows(6, 16, seed=3)
    assert any(o > 0 for o in offsets)  # some windows are cut from longer sequences
    context, last = cache.window(indices, offsets, 16)
    for row, (i, offset) in enumerate(zip(indices, offsets)):
        seq = torch.from_numpy(ds.sequence(i)[0])[None]
        full_context, full_last = target_features(target, seq, LAYERS)
        n = min(16, seq.shape[1] - offset)
        torch.testing.assert_close(context[row, :n], full_context[0, offset : offset + n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last[row, :n], full_last[0, offset : offset + n], rtol=1e-5, atol=1e-5)
        assert not context[row, n:].any() and not last[row, n:].any()


def losses(trainer, steps=3):
    return [trainer.train_step()["loss"] for _ in range(steps)]


def test_offline_training_equals_online_and_never_runs_the_target(tmp_path, monkeypatch):
    """seq_len covers every sequence, so online (target on the window) and offline (cached whole sequences) are
    the same computation: equal losses with an fp32 cache, close with bf16."""
    ds = tiny_dataset()
    cfg = dict(seq_len=48, max_steps=3, num_anchors=6)
    online = losses(DSparkTrainer(config(tmp_path / "on", **cfg), make_target(), ds))

    target = make_target()
    layers = build_drafter(config(tmp_path / "probe", **cfg), target).config.target_layer_ids
    for dtype in ("fp32", "bf16"):
        build_features(target, ds, tmp_path / dtype, layers, dtype=dtype, shard_tokens=128)

    def no_forward(*args, **kwargs):
        raise AssertionError("offline training ran the target's forward")

    monkeypatch.setattr(target.model, "forward", no_forward)
    offline = losses(DSparkTrainer(config(tmp_path / "off", features=str(tmp_path / "fp32"), **cfg), target, ds))
    assert offline == pytest.approx(online, rel=1e-5)
    bf16 = losses(DSparkTrainer(config(tmp_path / "off16", features=str(tmp_path / "bf16"), **cfg), target, ds))
    assert bf16 == pytest.approx(online, rel=5e-3) and bf16 != offline


def test_refuses_a_cache_of_another_target_layers_or_dataset(tmp_path):
    target, ds = make_target(), tiny_dataset()
    folder = build_features(target, ds, tmp_path / "c", LAYERS, shard_tokens=128)
    FeatureCache.open(folder, ds, target, LAYERS)  # the right one opens
    with pytest.raises(ValueError, match="another target .*weights_sha256"):
        FeatureCache.open(folder, ds, make_target(seed=1), LAYERS)
    with pytest.raises(ValueError, match=r"holds target layers \[0, 2\].*reads layers \[0, 1\]"):
        FeatureCache.open(folder, ds, target, [0, 1])
    other = TokenDataset.from_sequences([[1, 2, 3, 4]] * 3, [1] * 3)
    with pytest.raises(ValueError, match="another dataset"):
        FeatureCache.open(folder, other, target, LAYERS)
    with pytest.raises(ValueError, match="No feature cache"):
        FeatureCache(tmp_path / "missing", ds)
    with pytest.raises(ValueError, match="other dtype"):
        build_features(target, ds, folder, LAYERS, dtype="fp16", shard_tokens=128)
    with pytest.raises(ValueError, match="another target"):  # the trainer checks before training
        DSparkTrainer(config(tmp_path / "run", features=str(folder)), make_target(seed=1), ds)
