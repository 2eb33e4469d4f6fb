"""The shipped default drafter's folder is consistent with the code that loads it (no target needed).

A verify kernel change that leaves the shipped SPS profile behind would make every `load_default()` ignore it and
take a quick profile instead; a recalibration that forgets the config would ship mismatched temperatures.
"""

import json
import re

import pytest
import torch
from safetensors import safe_open

from dspark_hf import DSparkConfig, DSparkDraftModel
from dspark_hf.decoding.profiling import load_profile, sps_table
from dspark_hf.default import DEFAULT_DRAFTER_DIR
from dspark_hf.kernels import verify_head


CONFIG = DSparkConfig.from_pretrained(DEFAULT_DRAFTER_DIR)


def test_weights_are_safetensors_under_40_mb_and_match_the_config():
    weights = DEFAULT_DRAFTER_DIR / "model.safetensors"
    assert weights.stat().st_size < 40 * 2**20
    with safe_open(weights, framework="pt") as f:
        names = set(f.keys())
        assert f.get_slice("draft_vocab_ids").get_shape() == [CONFIG.draft_vocab_size]
    assert sum(name.startswith("layers.") for name in names) > 0
    assert {int(name.split(".")[1]) for name in names if name.startswith("layers.")} == set(
        range(CONFIG.num_hidden_layers)
    )


def test_sps_profile_matches_what_the_verify_passes_run():
    profile = load_profile(DEFAULT_DRAFTER_DIR / "sps_profile.json")
    assert profile["verify_head"] == verify_head.VERSION, (
        "the shipped sps_profile.json was timed with other verify kernels: re-take it with `dspark-hf profile "
        "--lengths 1-16,24,32,48,64,96,128 --context-len 256 --repeats 15` (docs/results.md)"
    )
    assert (profile["device"], profile["dtype"]) == ("cpu", "float32")
    target = profile["target"]
    assert (target["model_type"], target["hidden_size"], target["vocab_size"]) == (
        CONFIG.target_model_type,
        CONFIG.hidden_size,
        CONFIG.vocab_size,
    )
    assert max(CONFIG.target_layer_ids) < target["num_hidden_layers"]
    assert max(sps_table(profile)) >= CONFIG.block_size + 1  # the whole block and its anchor can be priced


def test_calibration_report_matches_the_config():
    report = json.loads((DEFAULT_DRAFTER_DIR / "calibration.json").read_text())
    assert CONFIG.sts_temperatures == pytest.approx(report["temperatures"])
    assert len(report["before"]["ece"]) == len(report["after"]["ece"]) == CONFIG.block_size


def test_model_card_reports_measured_results():
    card = (DEFAULT_DRAFTER_DIR / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: dspark-hf")
    assert re.search(r"\| mt-bench \| \d+ \| [\d.]+ \| [\d.]+x \|", card)  # a measured row: prompts, τ, speedup
    assert "## Calibration (STS)" in card and "Profiled on cpu (float32)" in card


def test_the_shipped_drafter_exports_to_vllm_and_llamacpp():
    """Issue 35: the default goes to the engines as it is (QK-norm, a vocabulary mask token, the window carried as a
    sliding window); its tiny q/k weights keep it out of float16."""
    from dspark_hf.integrations.export import export_blockers
    from dspark_hf.utils.devices import below_float16

    assert CONFIG.use_qk_norm and CONFIG.mask_token_id is not None and CONFIG.context_window is not None
    assert export_blockers(CONFIG) == []
    drafter = DSparkDraftModel.from_pretrained(DEFAULT_DRAFTER_DIR)
    assert any("q_proj" in name for name in below_float16(drafter))


def test_export_without_a_drafter_writes_the_shipped_one(tmp_path, monkeypatch):
    """`dspark-hf export` reads the shipped default when no --drafter is given; its window becomes sliding layers.
    The default target is stood in for by a random Llama of its shapes (the real one: test_default_target.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark_hf import default
    from dspark_hf.cli import main

    shape = CONFIG.target_fingerprint()
    stand_in = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=shape["hidden_size"],
            num_hidden_layers=shape["num_hidden_layers"],
            vocab_size=shape["vocab_size"],
            intermediate_size=8,
            num_attention_heads=CONFIG.num_attention_heads,
            num_key_value_heads=CONFIG.num_key_value_heads,
            head_dim=CONFIG.head_dim,
            tie_word_embeddings=True,
        )
    )
    monkeypatch.setattr(default, "load_default_target", lambda dtype=torch.float32: (stand_in, None))
    assert main(["export", "--format", "speculators", "--out", str(tmp_path / "spec")]) == 0
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    layers = config["transformer_layer_config"]
    assert config["mask_token_id"] == CONFIG.mask_token_id and config["sliding_window_non_causal"]
    assert layers["use_sliding_window"] and layers["sliding_window"] == CONFIG.context_window
    assert layers["layer_types"] == ["sliding_attention"] * CONFIG.num_hidden_layers
