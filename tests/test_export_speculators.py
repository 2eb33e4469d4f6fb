"""`export_speculators`: the folder's structure (keys, shapes, config fields), refusals, the CLI, and (slow, when the
separate speculators environment exists) speculators' own loader and forward against ours."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from conftest import make_drafter, make_target
from dspark_hf.cli import main as cli_main
from dspark_hf.integrations.speculators import export_speculators


MASK_TOKEN = 5
ROOT = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = Path(os.environ.get("SPECULATORS_PYTHON", "/work/envs/speculators/bin/python"))


def exportable(target, **overrides):
    return make_drafter(target, use_qk_norm=True, mask_token_id=MASK_TOKEN, **overrides)


def read(folder: Path) -> tuple[dict, dict]:
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


@pytest.mark.parametrize(
    ("head", "head_type", "rank"), [("markov", "vanilla", 8), ("gated_markov", "gated", 8), ("rnn", "rnn", 8)]
)
def test_full_vocabulary_export_keeps_our_weights_and_maps_the_fields(tmp_path, head, head_type, rank):
    target = make_target()
    drafter = exportable(target, sequential_head=head)
    drafter.config.sts_temperatures = [1.5, 1.25, 1.0, 0.75]
    drafter.config.verify_policy = "scheduler"
    config, tensors = read(export_speculators(drafter, target, tmp_path / "out", verifier="org/target"))

    ours = drafter.state_dict()
    assert set(tensors) == set(ours)  # no embedding, no LM head: speculators reloads both from the verifier
    for key, value in ours.items():
        assert torch.equal(tensors[key], value), key
    assert (config["speculators_model_type"], config["architectures"]) == ("dspark", ["DSparkSpeculator"])
    assert (config["markov_head_type"], config["markov_rank"]) == (head_type, rank)
    assert config["draft_vocab_size"] == 99 and config["block_size"] == 4 and config["mask_token_id"] == MASK_TOKEN
    assert config["sample_from_anchor"] is True  # the anchor slot drafts the first token
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["aux_hidden_state_layer_ids"] == [1, 3]  # our layers [0, 2] in hidden_states numbering
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["vocab_size"] == 99
    assert (layer["hidden_size"], layer["intermediate_size"], layer["head_dim"]) == (32, 37, 8)
    assert (layer["num_attention_heads"], layer["num_key_value_heads"]) == (4, 2)
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dspark" and spec["verifier"]["name_or_path"] == "org/target"
    assert spec["proposal_methods"] == [dict(proposal_type="greedy", speculative_tokens=4, verifier_accept_k=1)]
    extras = config["dspark_hf"]
    assert extras["sts_temperatures"] == [1.5, 1.25, 1.0, 0.75] and extras["verify_policy"] == "scheduler"
    assert extras["target_model_type"] == "llama" and extras["num_target_layers"] == 4
    assert extras["target_layer_ids"] == [0, 2]


def test_draft_vocabulary_is_written_as_reduced_heads_and_d2t_t2d(tmp_path):
    target = make_target()
    drafter = exportable(target, sequential_head="rnn")
    ids = torch.tensor([3, 7, 8, 20, 41, 42, 77, 98])
    drafter.set_draft_vocab(ids[torch.randperm(len(ids))])  # any order in, sorted inside
    config, tensors = read(export_speculators(drafter, target, tmp_path / "out"))

    assert config["draft_vocab_size"] == 8
    assert set(tensors) == set(drafter.state_dict()) - {"draft_vocab_ids"} | {"lm_head.weight", "d2t", "t2d"}
    assert torch.equal(tensors["d2t"] + torch.arange(8), ids)  # target id = draft index + d2t[draft index]
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (99,)
    assert torch.equal(tensors["t2d"].nonzero().flatten(), ids)
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight[ids])
    assert torch.equal(tensors["markov_head.markov_w2.weight"], drafter.markov_head.markov_w2.weight[ids])
    assert tensors["markov_head.markov_w1.weight"].shape == (99, 8)  # indexed by target token ids


def test_dflash_mode_and_confidence_variants(tmp_path):
    target = make_target()
    dflash = exportable(target, sequential_head="none", confidence_with_markov=False)
    config, tensors = read(export_speculators(dflash, target, tmp_path / "dflash"))
    assert config["markov_rank"] == 0 and not any(k.startswith("markov_head.") for k in tensors)
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is False
    assert tensors["confidence_head.proj.weight"].shape == (1, 32)
    bare = exportable(target, sequential_head="none", confidence_head=False)
    config, tensors = read(export_speculators(bare, target, tmp_path / "bare"))
    assert config["enable_confidence_head"] is False and config["confidence_head_with_markov"] is False
    assert not any(k.startswith("confidence_head.") for k in tensors)


def test_refuses_what_the_format_cannot_carry(tmp_path):
    target = make_target()
    with pytest.raises(ValueError, match=r"vLLM / speculators.*`use_qk_norm`.*`mask_token_id`"):
        export_speculators(make_drafter(target, use_qk_norm=False, mask_token_id=None), target, tmp_path / "out")
    gemma = make_target(config_cls=Gemma3TextConfig, model_cls=Gemma3ForCausalLM)
    with pytest.raises(ValueError, match=r"`target_model_type`.*'gemma3_text'"):
        export_speculators(exportable(gemma), gemma, tmp_path / "out")
    with pytest.raises(ValueError, match="vocab"):  # made for another target
        export_speculators(exportable(target), make_target(vocab_size=120), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_speculators(exportable(target), target, tmp_path / "out")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_speculators(exportable(target), target, tmp_path / "out")
    export_speculators(exportable(target), target, tmp_path / "out", overwrite=True)
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_cli_export_speculators(tmp_path):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    exportable(target).save_pretrained(tmp_path / "drafter")
    argv = ["export", "--format", "speculators", "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "o")]
    assert cli_main([*argv, "--target", str(tmp_path / "target"), "--verifier", "org/target"]) == 0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark"
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target"


@pytest.mark.slow
@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(), reason=f"no speculators environment at {SPECULATORS_PYTHON}")
def test_speculators_loads_the_export_and_computes_our_logits(tmp_path):
    """Every sequential head, DFlash mode, with and without a draft vocabulary: speculators' from_pretrained reports
    no missing or unexpected keys, and its forward gives our block logits and confidence logits within 1e-5."""
    script = ROOT / "tools" / "check_speculators_export.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(script), "all", str(tmp_path), "--speculators-python", str(SPECULATORS_PYTHON)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    cases = runpy.run_path(str(script))["CASES"]  # every case the script writes, the context window's included
    assert len(results) == len(cases) and all(r["ok"] for r in results)
    assert all(r["missing_keys"] == [] and r["unexpected_keys"] == [] for r in results)
    assert max(r["max_abs_logits"] for r in results) <= 1e-5
    assert {r["draft_vocab_size"] for r in results} == {99, 40}
