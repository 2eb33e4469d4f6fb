"""The wheel carries the whole package: every module of every subpackage and the embedded default drafter."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_holds_every_module_and_the_default_drafter(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            str(ROOT),
            "-w",
            str(tmp_path),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("dspark_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(
        ["git", "ls-files", "src/dspark_hf"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    expected = {Path(p).relative_to("src").as_posix() for p in tracked}
    assert expected - names == set()
    assert "dspark_hf/default_drafter/model.safetensors" in names
