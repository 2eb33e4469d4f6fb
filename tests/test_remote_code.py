"""The remote code a saved drafter and the Hub `custom_generate/` folder ship: an explicit module list, copied flat
with imports transformers can follow. Loading both folders without the package is tested in test_registration.py
(`test_remote_code_generate_without_the_package`) and test_hub.py (`test_custom_generate_folder_works_without_...`)."""

import ast
import json
import re
from pathlib import Path

import pytest
from transformers.dynamic_module_utils import get_relative_import_files

from conftest import make_target
from dspark_hf import Eagle3Config, Eagle3DraftModel
from dspark_hf.integrations import remote_code


def test_the_module_list_is_exactly_what_the_roots_import():
    assert remote_code.closure() == set(remote_code.MODULES)


def test_flat_folder_imports_only_its_own_files(tmp_path):
    written = remote_code.write_flat(tmp_path)
    names = {path.stem for path in written}
    assert {"modeling_dspark", "generation", "core", "drafting", "compat"} <= names
    for path in written:
        text = path.read_text()
        assert not re.search(r"^\s*from\s+\.\.", text, re.M), path.name  # nothing above the folder
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, (path.name, node.lineno)
                imported = [node.module] if node.module else [alias.name for alias in node.names]
                assert set(imported) <= names, (path.name, node.lineno, imported)


def test_transformers_fetches_every_file_from_the_roots(tmp_path):
    """transformers copies a remote-code module's files by following `from .name import` lines only (`from . import
    name` is invisible to it), so every written file must be reachable from the roots that way."""
    written = {path.name for path in remote_code.write_flat(tmp_path)}
    fetched = set()
    for root in remote_code.ROOTS:
        root_file = tmp_path / f"{root.rsplit('.', 1)[-1]}.py"
        fetched |= {root_file.name, *(Path(f).name for f in get_relative_import_files(root_file))}
    assert fetched == written


def test_an_import_outside_the_list_is_refused(monkeypatch):
    monkeypatch.setattr(remote_code, "MODULES", tuple(m for m in remote_code.MODULES if m != "decoding.core"))
    with pytest.raises(RuntimeError, match=r"decoding\.core"):
        remote_code.flat_source("integrations.generation")


def test_eagle3_checkpoint_names_its_own_classes(tmp_path):
    config = Eagle3Config.for_target(make_target().config, block_size=4, target_layer_ids=[0, 1, 2])
    Eagle3DraftModel(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"] == {
        "AutoConfig": "configuration_eagle3.Eagle3Config",
        "AutoModel": "modeling_eagle3.Eagle3DraftModel",
    }
    assert (tmp_path / "modeling_eagle3.py").is_file() and (tmp_path / "generation.py").is_file()
