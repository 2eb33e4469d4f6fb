"""Every writer of a folder keeps what a user saved: a non-empty folder is refused unless told to overwrite (one line
naming the folder and `overwrite=True`), and a folder is written beside its place, then renamed into it, so an
overwritten folder holds its old content until the new one is complete (`utils/files.write_folder`).

Writers: `save_for_hub`, the DeepSpec and speculators exports, the calibrated copy of `dspark-hf calibrate`, a
training run's `output_dir`. The GGUF export writes one file the same way (`test_export_gguf.py`). Also here: the
DeepSpec export of a drafter with a context window, which the format cannot carry.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import make_drafter
from dspark_hf.integrations.deepspec import export_deepspec
from dspark_hf.integrations.hub import save_for_hub
from dspark_hf.integrations.speculators import export_speculators
from dspark_hf.training.calibration import write_calibrated_copy
from dspark_hf.training.config import DSparkTrainingConfig
from dspark_hf.training.dataset import TokenDataset
from dspark_hf.training.trainer import DSparkTrainer
from dspark_hf.utils.files import write_folder


MASK_TOKEN = 5


def exportable(target, **overrides):
    return make_drafter(target, use_qk_norm=True, mask_token_id=MASK_TOKEN, **overrides)


def calibrated_copy(target, out, **kwargs):
    source = out.parent / "source-drafter"
    if not source.exists():
        make_drafter(target).save_pretrained(source)
    return write_calibrated_copy(source, out, [1.5, 1.0, 0.5, 2.0], {"temperatures": [1.5, 1.0, 0.5, 2.0]}, **kwargs)


# name -> write(target, out, **kwargs) -> the folder written; each writes config.json
WRITERS = {
    "save_for_hub": lambda target, out, **kw: save_for_hub(make_drafter(target), out, **kw),
    "export_deepspec": lambda target, out, **kw: export_deepspec(exportable(target), target, out, **kw),
    "export_speculators": lambda target, out, **kw: export_speculators(exportable(target), target, out, **kw),
    "calibrated copy": calibrated_copy,
    "write_folder": lambda target, out, **kw: write_folder(
        out, lambda tmp: (tmp / "config.json").write_text("{}"), **kw
    ),
}


def user_folder(path: Path) -> Path:
    """A folder holding something a user saved."""
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    return path


def beside(path: Path) -> list[str]:
    """What lies in `path`'s parent, apart from the source drafter of the calibrated copy: no temporary folder."""
    return sorted(p.name for p in path.parent.iterdir() if p.name != "source-drafter")


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_non_empty_folder_is_refused_and_kept(writer, target, tmp_path):
    out = user_folder(tmp_path / "mine")
    with pytest.raises(FileExistsError) as err:
        WRITERS[writer](target, out)
    message = str(err.value)
    assert str(out) in message and "overwrite=True" in message and "\n" not in message
    assert (out / "notes.txt").read_text() == "mine" and beside(out) == ["mine"]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_an_absent_or_empty_folder_is_written(writer, target, tmp_path):
    assert (WRITERS[writer](target, tmp_path / "new") / "config.json").is_file()
    (tmp_path / "empty").mkdir()
    assert (WRITERS[writer](target, tmp_path / "empty") / "config.json").is_file()
    assert beside(tmp_path / "new") == ["empty", "new"]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_overwrite_replaces_the_folder_whole(writer, target, tmp_path):
    out = user_folder(tmp_path / "mine")
    assert WRITERS[writer](target, out, overwrite=True) == out
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()  # replaced, not mixed in
    assert beside(out) == ["mine"]


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_the_old_folder_stays_until_the_new_one_is_in_place(writer, target, tmp_path, monkeypatch):
    """The rename of the new folder into place fails (a full disk, a crash): the old content is still there."""
    out = user_folder(tmp_path / "mine")
    rename, replace, failed = os.rename, os.replace, []

    def failing(real):
        def move(src, dst, *args, **kwargs):
            if Path(dst) == out and not failed:
                failed.append(src)
                raise OSError(28, "No space left on device (test)")
            return real(src, dst, *args, **kwargs)

        return move

    monkeypatch.setattr(os, "rename", failing(rename))
    monkeypatch.setattr(os, "replace", failing(replace))
    with pytest.raises(OSError, match="No space left"):
        WRITERS[writer](target, out, overwrite=True)
    assert failed and (out / "notes.txt").read_text() == "mine" and not (out / "config.json").exists()
    assert beside(out) == ["mine"]  # the new folder was removed


def test_a_file_where_the_folder_goes_is_refused_even_with_overwrite(tmp_path):
    (tmp_path / "out").write_text("a user's file")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="is a file, not a folder"):
            write_folder(tmp_path / "out", lambda tmp: None, overwrite=overwrite)
    assert (tmp_path / "out").read_text() == "a user's file"


def test_a_link_to_a_folder_stays_a_link(tmp_path):
    real = user_folder(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    write_folder(tmp_path / "link", lambda tmp: (tmp / "config.json").write_text("{}"), overwrite=True)
    assert (tmp_path / "link").is_symlink() and (real / "config.json").is_file() and not (real / "notes.txt").exists()


# -- a training run's output_dir ------------------------------------------------------------------------------------


def run_config(output_dir: Path, **overrides) -> DSparkTrainingConfig:
    settings = dict(num_hidden_layers=1, block_size=3, markov_rank=8, seq_len=24, batch_size=2, num_anchors=4)
    settings.update(max_steps=2, save_every=2, log_every=1, learning_rate=1e-2)
    return DSparkTrainingConfig(output_dir=str(output_dir), **{**settings, **overrides})


def tiny_dataset(n=6) -> TokenDataset:
    gen = np.random.default_rng(0)
    return TokenDataset.from_sequences([gen.integers(0, 99, size=30).tolist() for _ in range(n)], [3] * n)


def test_a_fresh_run_into_a_used_output_dir_is_refused(target, tmp_path):
    out = user_folder(tmp_path / "run")
    with pytest.raises(FileExistsError) as err:
        DSparkTrainer(run_config(out), target, tiny_dataset()).train()
    message = str(err.value)
    assert str(out) in message and "resume=True" in message and "overwrite=True" in message
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_overwrite_replaces_a_run_only_when_the_new_one_has_its_checkpoint(target, tmp_path, monkeypatch):
    out = user_folder(tmp_path / "run")
    trainer = DSparkTrainer(run_config(out), target, tiny_dataset())
    monkeypatch.setattr(trainer, "save_checkpoint", lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # killed before its first checkpoint
        trainer.train(overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # the old run is untouched
    DSparkTrainer(run_config(out), target, tiny_dataset()).train(overwrite=True)
    assert (out / "checkpoint-2").is_dir() and (out / "latest").read_text() == "checkpoint-2"
    assert not (out / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no staging folder left
    resumed = DSparkTrainer(run_config(out, max_steps=4), target, tiny_dataset())  # resume into the same folder
    resumed.train(resume=True)
    assert resumed.step == 4 and (out / "latest").read_text() == "checkpoint-4"


# -- the DeepSpec export of a drafter with a context window ---------------------------------------------------------


def test_a_windowed_drafter_is_refused_with_advice_that_applies(target, tmp_path):
    with pytest.raises(ValueError) as err:
        export_deepspec(exportable(target, context_window=8), target, tmp_path / "out")
    message = str(err.value)
    assert "`context_window` = 8" in message and "drop_context_window=True" in message
    assert "--drop-context-window" in message and "--format speculators" in message
    assert "train it" not in message and "build the drafter" not in message  # its weights need no rebuild
    assert not (tmp_path / "out").exists()


def test_a_drafter_with_other_blockers_gets_the_rebuild_advice(target, tmp_path):
    with pytest.raises(ValueError, match="build the drafter") as err:
        export_deepspec(make_drafter(target, use_qk_norm=False, context_window=8), target, tmp_path / "out")
    assert "context_window" in str(err.value)


def test_dropping_the_window_exports_the_drafter_without_it(target, tmp_path, caplog):
    drafter = exportable(target, context_window=8)
    with caplog.at_level("WARNING"):
        out = export_deepspec(drafter, target, tmp_path / "out", drop_context_window=True)
    assert "whole context" in caplog.text and "context_window" in caplog.text
    assert drafter.config.context_window == 8  # the drafter itself is unchanged
    plain = export_deepspec(exportable(target), target, tmp_path / "plain")
    assert json.loads((out / "config.json").read_text()) == json.loads((plain / "config.json").read_text())
    from safetensors.torch import load_file

    ours, theirs = load_file(out / "model.safetensors"), load_file(plain / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_cli_exports_a_windowed_drafter_with_drop_context_window(target, tmp_path, capsys):
    from dspark_hf.cli import main

    target.save_pretrained(tmp_path / "target")
    exportable(target, context_window=8).save_pretrained(tmp_path / "drafter")
    argv = ["export", "--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "target")]
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 2
    assert "--drop-context-window" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert main([*argv, "--out", str(tmp_path / "out"), "--drop-context-window"]) == 0
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "context_window" not in json.dumps(config)
