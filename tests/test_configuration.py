"""DSparkConfig: defaults, default target layers, validation errors, `for_target`, `check_target`, JSON round trip."""

import json
import re

import pytest
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from dspark_hf import DSparkConfig
from dspark_hf.models.configuration_dspark import default_target_layer_ids


# Small, deliberately uneven target shapes shared by every family below (configs only: no weights are built).
SMALL = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def small_llama(**changes) -> LlamaConfig:
    return LlamaConfig(**{**SMALL, **changes})


# -- defaults ------------------------------------------------------------------------------------------------------


def test_defaults_are_valid_and_filled_in():
    config = DSparkConfig()
    config.validate_architecture()  # does not raise
    assert config.model_type == "dspark"
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.target_layer_ids == default_target_layer_ids(config.num_target_layers)
    assert config.num_target_layers - 1 not in config.target_layer_ids
    assert config.sts_temperatures == [1.0] * config.block_size
    assert config.rope_parameters["rope_type"] == "default"
    assert config.layer_types == ["full_attention"] * config.num_hidden_layers


# -- default_target_layer_ids --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [3, 4, 8, 30, 36, 40])
def test_default_target_layer_ids_are_valid(num_layers):
    ids = default_target_layer_ids(num_layers)
    assert 1 <= len(ids) <= 5
    assert ids == sorted(set(ids))  # strictly increasing, no duplicates
    assert all(0 <= i < num_layers - 1 for i in ids)  # in range and never the final (already normed) layer
    assert num_layers - 1 not in ids
    DSparkConfig(num_target_layers=num_layers, target_layer_ids=ids)  # accepted by validation


@pytest.mark.parametrize(
    "num_layers, expected",
    [
        (3, [0, 1]),
        (4, [0, 1, 2]),
        (8, [1, 2, 3, 4, 5]),
        (30, [1, 7, 14, 21, 27]),
        (36, [1, 9, 17, 25, 33]),
        (40, [1, 10, 19, 28, 37]),
    ],
)
def test_default_target_layer_ids_values(num_layers, expected):
    assert default_target_layer_ids(num_layers) == expected
    assert DSparkConfig(num_target_layers=num_layers).target_layer_ids == expected


def test_default_target_layer_ids_respects_num_features_and_rejects_tiny_targets():
    assert default_target_layer_ids(36, num_features=1) == [1]
    assert default_target_layer_ids(36, num_features=3) == [1, 17, 33]
    with pytest.raises(ValueError, match="at least 2"):
        default_target_layer_ids(1)


# -- validation errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(block_size=0), "block_size.*got 0"),
        (dict(block_size=-3), "block_size.*got -3"),
        (dict(sequential_head="transformer"), "'transformer'"),
        (dict(target_layer_ids=[1, 29]), r"contains \[29\]"),  # the final layer of a 30-layer target
        (dict(target_layer_ids=[1, 30]), r"contains \[30\]"),  # past the end
        (dict(target_layer_ids=[-1, 2]), r"contains \[-1\]"),  # negative (no Python-style indexing)
        (dict(target_layer_ids=[3, 3, 5]), r"duplicates: \[3, 3, 5\]"),
        (dict(target_layer_ids=[]), "at least one"),
        (dict(sts_temperatures=[1.0, 1.0]), r"7 positive finite numbers.*\[1.0, 1.0\]"),
        (
            dict(block_size=3, sts_temperatures=[1.0, 1.0, 1.0, 1.0]),
            r"3 positive finite numbers.*\[1.0, 1.0, 1.0, 1.0\]",
        ),
        (dict(block_size=2, sts_temperatures=[1.0, 0.0]), r"\[1.0, 0.0\]"),
        (dict(sequential_head="none"), "confidence_with_markov.*sequential_head='none'"),
        (dict(mask_token_id=49152), r"`mask_token_id` must be .*0\.\.49151.*got 49152"),  # == vocab_size
        (dict(mask_token_id=-1), "`mask_token_id`.*got -1"),
        (dict(vocab_size=100, mask_token_id=100), r"0\.\.99.*got 100"),
        (dict(verify_policy="greedy"), "'greedy'"),
        (dict(markov_rank=0), "markov_rank.*got 0"),
        (dict(confidence_threshold=1.5), "1.5"),
        (dict(num_attention_heads=9, num_key_value_heads=2), r"\(9\).*\(2\)"),
        (dict(num_hidden_layers=0), "num_hidden_layers.*got 0"),
    ],
)
def test_invalid_fields_raise_value_error_naming_the_value(fields, named):
    with pytest.raises(ValueError, match=named):
        DSparkConfig(**fields)


def test_valid_variants_of_the_rejected_fields_are_accepted():
    # the counterparts of the errors above, so that the errors are not raised for everything
    assert DSparkConfig(block_size=1).sts_temperatures == [1.0]
    assert DSparkConfig(target_layer_ids=[0, 28]).target_layer_ids == [0, 28]
    assert DSparkConfig(sequential_head="none", confidence_with_markov=False).sequential_head == "none"
    assert DSparkConfig(sequential_head="none", confidence_head=False).confidence_head is False
    assert DSparkConfig(mask_token_id=0).mask_token_id == 0
    assert DSparkConfig(mask_token_id=49151).mask_token_id == 49151
    for policy in ("threshold", "fixed", "scheduler"):
        assert DSparkConfig(verify_policy=policy).verify_policy == policy
    for head in ("markov", "gated_markov", "rnn"):
        assert DSparkConfig(sequential_head=head).sequential_head == head
    assert DSparkConfig(block_size=3, sts_temperatures=[1.0, 1.5, 2.0]).sts_temperatures == [1.0, 1.5, 2.0]


# -- for_target ----------------------------------------------------------------------------------------------------


def assert_copies_block_shapes(config: DSparkConfig, target):
    assert config.target_model_type == target.model_type
    assert config.hidden_size == target.hidden_size
    assert config.num_target_layers == target.num_hidden_layers
    assert config.vocab_size == target.vocab_size
    assert config.intermediate_size == target.intermediate_size
    assert config.num_attention_heads == target.num_attention_heads
    assert config.num_key_value_heads == target.num_key_value_heads
    assert config.head_dim == target.head_dim
    assert config.rms_norm_eps == target.rms_norm_eps
    assert config.max_position_embeddings == target.max_position_embeddings
    assert config.target_layer_ids == default_target_layer_ids(target.num_hidden_layers) == [1, 2, 3]
    config.check_target(target)  # a config made for a target accepts it


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config, MistralConfig])
def test_for_target_llama_like(config_class):
    target = config_class(**SMALL, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    config = DSparkConfig.for_target(target)
    assert_copies_block_shapes(config, target)
    assert config.hidden_act == target.hidden_act == "silu"
    # exportable by default: the engines' Qwen3 draft layer (QK-norm) and a vocabulary mask token
    assert config.use_qk_norm is True
    assert config.mask_token_id == 999  # the last vocabulary id
    assert config.final_logit_softcapping is None
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    assert config.bos_token_id == target.bos_token_id and config.eos_token_id == target.eos_token_id
    # opting out keeps the family's own attention and learns a mask embedding
    native = DSparkConfig.for_target(target, exportable=False)
    assert native.use_qk_norm is False and native.mask_token_id is None
    assert DSparkConfig.for_target(target, use_qk_norm=False).mask_token_id == 999  # explicit overrides win


def test_exportable_mask_token_skips_special_tokens():
    target = small_llama(bos_token_id=998, eos_token_id=[999, 5], pad_token_id=997)
    assert DSparkConfig.for_target(target).mask_token_id == 996
    assert DSparkConfig.for_target(target, mask_token_id=7).mask_token_id == 7


def test_for_target_copies_special_tokens_and_head_dim():
    target = small_llama(head_dim=32, bos_token_id=5, eos_token_id=[6, 7], pad_token_id=8)
    config = DSparkConfig.for_target(target)
    assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (5, [6, 7], 8)


def test_for_target_qwen3_uses_qk_norm_and_its_mask_token():
    target = Qwen3Config(**{**SMALL, "vocab_size": 151936})  # Qwen3's real vocabulary, so that 151669 exists
    config = DSparkConfig.for_target(target)
    assert_copies_block_shapes(config, target)
    assert config.target_model_type == "qwen3"
    assert config.use_qk_norm is True
    assert config.mask_token_id == 151669


def test_for_target_qwen3_small_vocabulary_falls_back_to_another_mask_token():
    # The known Qwen3 mask token does not exist in a tiny vocabulary: the last vocabulary id is used instead (a
    # learned mask embedding when not exportable), and forcing the token anyway is a clear error.
    target = Qwen3Config(**SMALL)
    assert DSparkConfig.for_target(target).mask_token_id == 999
    assert DSparkConfig.for_target(target, exportable=False).mask_token_id is None
    with pytest.raises(ValueError, match=r"`mask_token_id` must be an int in 0\.\.999 .*got 151669"):
        DSparkConfig.for_target(target, mask_token_id=151669)


def test_for_target_gemma2_activation_and_softcapping():
    # a non-default activation, so that the value can only have come from `hidden_activation`
    target = Gemma2Config(**SMALL, hidden_activation="gelu_new", final_logit_softcapping=30.0)
    assert getattr(target, "hidden_act", None) is None
    config = DSparkConfig.for_target(target)
    assert_copies_block_shapes(config, target)
    assert config.hidden_act == "gelu_new"
    assert config.final_logit_softcapping == 30.0
    assert config.use_qk_norm is False


def test_for_target_gemma3_text_activation_softcapping_qk_norm_and_rope():
    target = Gemma3TextConfig(**SMALL, hidden_activation="gelu_new", final_logit_softcapping=25.0)
    assert getattr(target, "hidden_act", None) is None
    config = DSparkConfig.for_target(target)
    assert_copies_block_shapes(config, target)
    assert config.hidden_act == "gelu_new"
    assert config.final_logit_softcapping == 25.0
    assert config.use_qk_norm is True
    # per-layer-type RoPE: the drafter (all full attention) takes the full-attention parameters
    assert config.rope_parameters == dict(target.rope_parameters["full_attention"])
    default = DSparkConfig.for_target(Gemma3TextConfig(**SMALL))
    assert default.final_logit_softcapping is None  # Gemma 3 does not soft-cap by default
    assert default.hidden_act == "gelu_pytorch_tanh"


def test_for_target_overrides():
    config = DSparkConfig.for_target(
        small_llama(), num_hidden_layers=1, block_size=5, sequential_head="rnn", markov_rank=8, target_layer_ids=[0, 4]
    )
    assert (config.num_hidden_layers, config.block_size, config.sequential_head) == (1, 5, "rnn")
    assert config.markov_rank == 8 and config.target_layer_ids == [0, 4]
    assert config.sts_temperatures == [1.0] * 5  # re-derived for the new block size


def test_for_target_unknown_override_raises():
    with pytest.raises(ValueError, match=re.escape("['blok_size']")):
        DSparkConfig.for_target(small_llama(), blok_size=4)


def test_for_target_invalid_override_raises():
    with pytest.raises(ValueError, match=r"contains \[5\]"):  # the final layer of the 6-layer target
        DSparkConfig.for_target(small_llama(), target_layer_ids=[1, 5])


def test_for_target_rejects_non_configs():
    with pytest.raises(TypeError):
        DSparkConfig.for_target({"hidden_size": 64})


# -- check_target --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, named",
    [
        (dict(hidden_size=128, head_dim=32), "hidden_size: drafter expects 64, target has 128"),
        (dict(vocab_size=1001), "vocab_size: drafter expects 1000, target has 1001"),
        (dict(num_hidden_layers=7), "num_hidden_layers: drafter expects 6, target has 7"),
    ],
)
def test_check_target_rejects_mismatched_targets(changes, named):
    config = DSparkConfig.for_target(small_llama())
    with pytest.raises(ValueError, match=named):
        config.check_target(small_llama(**changes))


def test_check_target_accepts_the_right_target_and_same_shapes_of_another_family():
    config = DSparkConfig.for_target(small_llama())
    config.check_target(small_llama())
    config.check_target(small_llama(intermediate_size=128))  # only the fingerprint matters
    config.check_target(MistralConfig(**SMALL))  # another family of the same shapes: a warning, not an error


# -- serialization -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        dict(),
        dict(
            num_hidden_layers=1,
            block_size=5,
            sts_temperatures=[1.0, 1.5, 2.0, 2.5, 3.0],
            mask_token_id=7,
            sequential_head="rnn",
            verify_policy="fixed",
            target_layer_ids=[0, 4],
        ),
        dict(sequential_head="none", confidence_with_markov=False, confidence_head=True, block_size=2),
    ],
)
def test_json_round_trip(fields):
    config = DSparkConfig.for_target(small_llama(eos_token_id=[2, 3]), **fields)
    as_json = json.loads(json.dumps(config.to_dict()))
    restored = DSparkConfig.from_dict(as_json)
    assert isinstance(restored, DSparkConfig)
    assert restored.to_dict() == config.to_dict()
    assert DSparkConfig.from_dict(json.loads(config.to_json_string())).to_dict() == config.to_dict()
    for name in (
        "target_layer_ids",
        "sts_temperatures",
        "block_size",
        "mask_token_id",
        "sequential_head",
        "eos_token_id",
        "rope_parameters",
    ):
        assert getattr(restored, name) == getattr(config, name)


def test_save_and_from_pretrained_round_trip(tmp_path):
    config = DSparkConfig.for_target(small_llama(), block_size=3, sts_temperatures=[1.0, 2.0, 3.0])
    config.save_pretrained(tmp_path)
    restored = DSparkConfig.from_pretrained(tmp_path)
    assert restored.to_dict() == config.to_dict()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "dspark"


def test_from_dict_validates():
    data = DSparkConfig().to_dict()
    data["target_layer_ids"] = [1, 29]
    with pytest.raises(ValueError, match=r"contains \[29\]"):
        DSparkConfig.from_dict(data)
