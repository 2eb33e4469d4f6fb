"""`--resume` never trains on wrong state: checksummed checkpoints with fallback, refused shape changes, honoured
schedule changes, and clear messages for damaged or missing checkpoints."""

import json
import shutil

import pytest
import torch
from test_trainer import config, tiny_dataset
from transformers.testing_utils import CaptureLogger

from conftest import make_target
from dspark_hf.training import trainer as trainer_module
from dspark_hf.training.trainer import (
    MANIFEST,
    DSparkTrainer,
    check_resume,
    find_resume_checkpoint,
    lr_factor,
    read_trainer_state,
)


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, target):
    """A straight 6-step run, and a run stopped after 4 steps (checkpoints 2 and 4) to copy and damage."""
    root = tmp_path_factory.mktemp("runs")
    straight = DSparkTrainer(config(root / "straight", max_steps=6), target, tiny_dataset()).train()
    DSparkTrainer(config(root / "stopped", max_steps=6), target, tiny_dataset()).train(stop_after=4)
    return root, {k: v.clone() for k, v in straight.state_dict().items()}


def stopped_copy(runs, tmp_path):
    root, _ = runs
    shutil.copytree(root / "stopped", tmp_path, dirs_exist_ok=True)
    return tmp_path / "run"


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_checkpoint_file_is_checksummed(runs, tmp_path):
    run = stopped_copy(runs, tmp_path)
    assert (run / "latest").read_text() == "checkpoint-4"
    manifest = json.loads((run / "checkpoint-4" / MANIFEST).read_text())["sha256"]
    files = sorted(p.name for p in (run / "checkpoint-4").iterdir() if p.name != MANIFEST)
    assert sorted(manifest) == files and {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(files)
    assert find_resume_checkpoint(run) == run / "checkpoint-4"


def test_a_flipped_byte_in_any_file_of_the_latest_checkpoint_falls_back(runs, tmp_path):
    """One byte flipped in each file of checkpoint-4 in turn (at its middle and at its last byte: for the weights, the
    payload behind an intact header): resume picks checkpoint-2 and the warning names the damaged file."""
    run = stopped_copy(runs, tmp_path)
    files = sorted(p for p in (run / "checkpoint-4").iterdir() if p.is_file())
    assert len(files) >= 5
    for path in files:
        original = path.read_bytes()
        for offset in (len(original) // 2, len(original) - 1):
            flip_byte(path, offset)
            with CaptureLogger(trainer_module.logger) as captured:
                assert find_resume_checkpoint(run) == run / "checkpoint-2", (path.name, offset)
            assert f"{path} " in captured.out, captured.out
            assert "Resuming from" in captured.out and "checkpoint-2" in captured.out
            path.write_bytes(original)
    assert find_resume_checkpoint(run) == run / "checkpoint-4"


def test_resume_from_the_fallback_reaches_the_uninterrupted_weights(runs, tmp_path, target):
    """Bytes flipped in the weight payload of the latest checkpoint (header intact): training resumes from the
    previous checkpoint and ends with exactly the weights of an uninterrupted run."""
    _, reference = runs
    run = stopped_copy(runs, tmp_path)
    weights = run / "checkpoint-4" / "model.safetensors"
    flip_byte(weights, weights.stat().st_size - 3)
    trainer = DSparkTrainer(config(tmp_path, max_steps=6), target, tiny_dataset())
    assert trainer.resume() and trainer.step == 2
    final = trainer.train()
    assert trainer.step == 6
    for name, value in final.state_dict().items():
        assert torch.equal(value, reference[name]), name


def test_no_intact_checkpoint_is_refused_naming_the_files(runs, tmp_path):
    run = stopped_copy(runs, tmp_path)
    flip_byte(run / "checkpoint-4" / "trainer_state.json", 3)
    flip_byte(run / "checkpoint-2" / "optimizer.pt", 100)
    with pytest.raises(ValueError, match="No intact checkpoint") as err:
        find_resume_checkpoint(run)
    message = str(err.value)
    assert "checkpoint-4/trainer_state.json" in message and "checkpoint-2/optimizer.pt" in message
    assert "--resume" in message  # how to go on


def test_latest_naming_a_deleted_checkpoint(runs, tmp_path):
    run = stopped_copy(runs, tmp_path)
    shutil.rmtree(run / "checkpoint-4")
    with CaptureLogger(trainer_module.logger) as captured:
        assert find_resume_checkpoint(run) == run / "checkpoint-2"
    assert "checkpoint-4 does not exist" in captured.out
    shutil.rmtree(run / "checkpoint-2")
    with pytest.raises(ValueError, match="latest names checkpoint-4, which does not exist"):
        find_resume_checkpoint(run)


def test_corrupt_trainer_state_is_named(runs, tmp_path):
    """Without checksums to catch it (a checkpoint from before manifests), a corrupt trainer_state.json is named."""
    run = stopped_copy(runs, tmp_path)
    for folder in run.glob("checkpoint-*"):
        (folder / MANIFEST).unlink()
    with CaptureLogger(trainer_module.logger) as captured:
        assert find_resume_checkpoint(run) == run / "checkpoint-4"  # legacy: used unverified, with a warning
    assert "unverified" in captured.out
    state = run / "checkpoint-4" / "trainer_state.json"
    state.write_text('{"step": 4, "total')
    with pytest.raises(ValueError, match="trainer_state.json is corrupt"):
        read_trainer_state(run / "checkpoint-4")
    with pytest.raises(ValueError, match=str(state)):
        check_resume(config(tmp_path, max_steps=6))


def test_a_fresh_output_dir_has_nothing_to_resume(tmp_path):
    assert check_resume(config(tmp_path)) is None


@pytest.mark.parametrize(
    "change", [{"block_size": 4}, {"num_hidden_layers": 2}, {"sequential_head": "rnn"}, {"train_vocab_size": 50}]
)
def test_a_shape_change_is_refused_naming_the_key(runs, tmp_path, change):
    stopped_copy(runs, tmp_path)
    (key,) = change
    with pytest.raises(ValueError, match=f"changed {key} ") as err:
        check_resume(config(tmp_path, max_steps=6, **change))
    assert "Set it back" in str(err.value)


def test_a_new_schedule_is_honoured(runs, tmp_path, target):
    """A finished 6-step run resumed with max_steps=10 and a new learning rate: the schedule is rebuilt (logged) and
    the extra steps train at the new cosine's rates, not at 0."""
    run = stopped_copy(runs, tmp_path)
    DSparkTrainer(config(tmp_path, max_steps=6), target, tiny_dataset()).train(resume=True)
    assert (run / "latest").read_text() == "checkpoint-6"
    cfg = config(tmp_path, max_steps=10, learning_rate=3e-2, weight_decay=0.1)
    trainer = DSparkTrainer(cfg, target, tiny_dataset())
    with CaptureLogger(trainer_module.logger) as captured:
        trainer.train(resume=True)
    assert "max_steps 6 -> 10" in captured.out and "learning_rate 0.01 -> 0.03" in captured.out
    assert trainer.optimizer.param_groups[0]["weight_decay"] == 0.1
    logged = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    rates = {r["step"]: r["lr"] for r in logged}
    warmup = max(1, int(cfg.warmup_ratio * 10))
    for step in range(7, 11):
        assert rates[step] == pytest.approx(3e-2 * lr_factor(step, warmup, 10)), step
    assert rates[7] > 1e-3 and rates[10] == pytest.approx(0.0, abs=1e-12)
