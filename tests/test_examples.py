"""The user scripts in examples/ import without loading a model and answer `--help`; every script in examples/,
benchmarks/ and tools/ compiles; every such path the README and docs name exists."""

import contextlib
import importlib.util
import io
import re
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
SCRIPTS = sorted(p for folder in ("examples", "benchmarks", "tools") for p in (ROOT / folder).glob("*.py"))
# docs/history.md records commands as they were run, before scripts moved out of examples/
DOCS = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "history.md")]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # module level: imports and constants only
    return module


def test_examples_has_the_user_scripts():
    names = {p.stem for p in EXAMPLES}
    assert {"generate", "pipeline", "batched", "serve", "train_drafter", "export", "device_check"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_imports_and_shows_help(path):
    module = load(path)
    assert module.__doc__ and f"python examples/{path.name}" in module.__doc__, f"{path.name}: say how to run it"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert out.getvalue().startswith("usage:"), out.getvalue()[:200]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_compiles(path):
    compile(path.read_text(encoding="utf-8"), str(path), "exec")


def test_shell_scripts_parse():
    for path in (ROOT / "tools").glob("*.sh"):
        assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0, path.name


def test_script_paths_in_the_docs_exist():
    pattern = re.compile(r"\b((?:examples|benchmarks|tools)/[\w.-]+\.(?:py|sh))")
    named = {(doc.name, m) for doc in DOCS for m in pattern.findall(doc.read_text(encoding="utf-8"))}
    missing = sorted((doc, path) for doc, path in named if not (ROOT / path).exists())
    assert named and not missing, missing
