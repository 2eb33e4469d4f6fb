"""Files a user keeps (`utils/files.py`): written atomically, with the permissions a plain `open()` or `mkdir` gives
them, so that another user or a server process can read an evaluation, a config or an exported folder."""

import os
import stat

import pytest

from dspark_hf.integrations.export import write_folder
from dspark_hf.utils.files import atomic_write_json, atomic_write_text, new_folder_beside


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_the_umask_not_owner_only(tmp_path, umask_022):
    atomic_write_json({"a": 1}, tmp_path / "evaluation.json")
    assert mode(tmp_path / "evaluation.json") == 0o644  # tempfile.mkstemp would leave 0600
    assert [p.name for p in tmp_path.iterdir()] == ["evaluation.json"]  # no temporary file left


def test_a_replaced_file_keeps_its_mode(tmp_path, umask_022):
    path = tmp_path / "config.json"
    path.write_text("old")
    path.chmod(0o640)
    atomic_write_text("new", path)
    assert path.read_text() == "new" and mode(path) == 0o640


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("old")

    with pytest.raises(TypeError):  # not text: the write fails half-way
        atomic_write_text(b"bytes", path)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_folders_renamed_into_place_get_the_umask(tmp_path, umask_022):
    folder = new_folder_beside(tmp_path / "out" / "export")
    assert folder.parent == tmp_path / "out" and folder.name.startswith(".export.") and mode(folder) == 0o755
    exported = write_folder(tmp_path / "drafter-gguf", False, lambda tmp: (tmp / "a.txt").write_text("x"))
    assert mode(exported) == 0o755 and (exported / "a.txt").read_text() == "x"  # mkdtemp would leave 0700
