"""Loud failures: incomplete, pickle-only or corrupt checkpoints, and drafters paired with the wrong target."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import make_drafter, make_target
from dspark_hf import DSparkConfig, DSparkDraftModel
from helpers import char_tokenizer


@pytest.fixture
def saved(drafter, tmp_path):
    """A complete checkpoint of the `drafter` fixture in tmp_path / "full"."""
    path = tmp_path / "full"
    drafter.save_pretrained(path)
    return path


def copy_of(saved, tmp_path, name):
    path = tmp_path / name
    shutil.copytree(saved, path)
    return path


# -- checkpoint files ----------------------------------------------------------------------------------------------


def test_complete_checkpoint_loads(saved, drafter):
    model, info = DSparkDraftModel.from_pretrained(saved, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(model.fc.weight, drafter.fc.weight)


def test_config_only_folder(saved, tmp_path):
    path = tmp_path / "config_only"
    path.mkdir()
    shutil.copy(saved / "config.json", path / "config.json")
    with pytest.raises((OSError, ValueError), match="safetensors"):
        DSparkDraftModel.from_pretrained(path)


def test_pickle_only_folder_is_refused(saved, drafter, tmp_path):
    path = tmp_path / "pickle_only"
    path.mkdir()
    shutil.copy(saved / "config.json", path / "config.json")
    torch.save(drafter.state_dict(), path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle") as err:
        DSparkDraftModel.from_pretrained(path)
    assert "pytorch_model.bin" in str(err.value) and "safetensors" in str(err.value)


@pytest.mark.parametrize("name", ["model.pt", "weights.pth"])
def test_other_pickle_files_are_refused(saved, drafter, tmp_path, name):
    path = tmp_path / "pickle_only"
    path.mkdir()
    shutil.copy(saved / "config.json", path / "config.json")
    torch.save(drafter.state_dict(), path / name)
    with pytest.raises(ValueError, match=f"pickle.*{name}"):
        DSparkDraftModel.from_pretrained(path)


@pytest.mark.parametrize("keep", [0.5, "minus_one_byte", "header_only"])
def test_truncated_safetensors(saved, tmp_path, keep):
    path = copy_of(saved, tmp_path, "truncated")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    header_len = 8 + int.from_bytes(data[:8], "little")
    cut = {"minus_one_byte": len(data) - 1, "header_only": header_len}.get(keep) or int(len(data) * keep)
    weights.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="corrupt") as err:
        DSparkDraftModel.from_pretrained(path)
    assert "model.safetensors" in str(err.value)


@pytest.mark.parametrize("garbage", [b"", b"not a safetensors file", b"\xff" * 64])
def test_garbage_safetensors(saved, tmp_path, garbage):
    path = copy_of(saved, tmp_path, "garbage")
    (path / "model.safetensors").write_bytes(garbage)
    with pytest.raises(ValueError, match="corrupt"):
        DSparkDraftModel.from_pretrained(path)


@pytest.mark.parametrize(
    "key",
    [
        "norm.weight",
        "layers.1.self_attn.k_proj.weight",
        "layers.0.self_attn.q_norm.weight",  # exportable by default: QK-norm, a vocabulary mask token
        "markov_head.markov_w2.weight",
        "confidence_head.proj.bias",
    ],
)
def test_missing_weight(saved, tmp_path, key):
    path = copy_of(saved, tmp_path, "missing")
    state = load_file(path / "model.safetensors")
    assert key in state
    del state[key]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 drafter weight") as err:
        DSparkDraftModel.from_pretrained(path)
    assert key in str(err.value)


def test_checkpoint_of_another_configuration(tmp_path, target):
    # weights of a one-layer drafter under the config of a two-layer one: the second layer would be random
    small = make_drafter(target, num_hidden_layers=1)
    small.save_pretrained(tmp_path / "small")
    make_drafter(target, num_hidden_layers=2).config.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match="lacks") as err:
        DSparkDraftModel.from_pretrained(tmp_path / "small")
    assert "layers.1." in str(err.value)


def test_mismatched_shape_is_refused(saved, tmp_path):
    path = copy_of(saved, tmp_path, "mismatched")
    state = load_file(path / "model.safetensors")
    state["norm.weight"] = torch.ones(33)  # hidden size is 32
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises((RuntimeError, ValueError)):  # transformers refuses first
        DSparkDraftModel.from_pretrained(path)
    with pytest.raises(ValueError, match="wrong shape"):  # and DSpark when the user asks transformers to tolerate it
        DSparkDraftModel.from_pretrained(path, ignore_mismatched_sizes=True)


def test_use_safetensors_false_is_refused(saved):
    with pytest.raises(ValueError, match="safetensors"):
        DSparkDraftModel.from_pretrained(saved, use_safetensors=False)
    DSparkDraftModel.from_pretrained(saved, use_safetensors=True)  # the explicit default is fine


# -- pairing with the wrong target in generate() -------------------------------------------------------------------


def greedy_assisted(target, drafter, ids, **kwargs):
    return target.generate(ids, max_new_tokens=5, do_sample=False, assistant_model=drafter, **kwargs)


def test_drafter_for_another_hidden_size(drafter):
    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=99,
            hidden_size=48,
            intermediate_size=37,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            attn_implementation="eager",
        )
    ).eval()
    with pytest.raises(ValueError, match="hidden_size: drafter expects 32, target has 48"):
        greedy_assisted(other, drafter, torch.randint(0, 99, (1, 5)))


def test_drafter_for_another_depth(drafter):
    with pytest.raises(ValueError, match="num_hidden_layers: drafter expects 4, target has 5"):
        greedy_assisted(make_target(num_layers=5), drafter, torch.randint(0, 99, (1, 5)))


def test_drafter_for_another_vocabulary(drafter):
    other = make_target(vocab_size=101)
    ids = torch.randint(0, 99, (1, 5))
    # the pairing check runs before transformers' own checks (which would talk of universal assisted decoding)
    with pytest.raises(ValueError, match="vocab_size: drafter expects 99, target has 101"):
        greedy_assisted(other, drafter, ids)
    with pytest.raises(ValueError, match="vocab_size: drafter expects 99, target has 101"):
        greedy_assisted(other, drafter, ids, tokenizer=char_tokenizer(101), assistant_tokenizer=char_tokenizer(99))


def test_matching_drafter_generates(target, drafter):
    # the counterpart of the errors above: the right pairing works and is lossless
    ids = torch.randint(0, 99, (1, 5))
    assert torch.equal(greedy_assisted(target, drafter, ids), target.generate(ids, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("layer_ids", [[0, 3], [0, 4], [0, 7], [-1, 1]])
def test_layer_ids_out_of_range_for_the_target(target, layer_ids):
    # the config refuses before a drafter (or a generate() call) exists; 3 is the final layer of the 4-layer target
    bad = [i for i in layer_ids if not 0 <= i <= 2]
    with pytest.raises(ValueError, match=rf"contains \[{bad[0]}\].*4-layer target"):
        make_drafter(target, target_layer_ids=layer_ids)
    with pytest.raises(ValueError, match=rf"contains \[{bad[0]}\]"):
        DSparkConfig.for_target(target.config, target_layer_ids=layer_ids)


# -- missing folders and unreadable configs (issue 27) --------------------------------------------------------------


@pytest.mark.parametrize("path", ["/no/such/folder", "./no_such_folder", "a/b/c"])
def test_a_missing_folder_is_named(path):
    with pytest.raises(FileNotFoundError, match="No DSpark checkpoint \\(config.json\\) at .*does not exist"):
        DSparkDraftModel.from_pretrained(path)


def test_a_folder_without_config_json_is_named(saved, tmp_path):
    path = copy_of(saved, tmp_path, "no_config")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=f"No DSpark checkpoint \\(config.json\\) at {path}"):
        DSparkDraftModel.from_pretrained(path)


@pytest.mark.parametrize(("text", "expected"), [("{not json", "is not valid JSON"), ("[]", "holds a JSON list")])
def test_a_garbage_config_json_is_named(saved, tmp_path, text, expected):
    path = copy_of(saved, tmp_path, "garbage")
    (path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=expected) as err:
        DSparkDraftModel.from_pretrained(path)
    assert str(path / "config.json") in str(err.value)


def test_dflash_mode_needs_no_confidence_flag(target):
    """sequential_head="none" (DFlash) infers confidence_with_markov=False; asking for both stays an error."""
    config = DSparkConfig.for_target(target.config, sequential_head="none")
    assert config.confidence_head and not config.confidence_with_markov
    assert DSparkConfig.for_target(target.config).confidence_with_markov
    with pytest.raises(ValueError, match="confidence_with_markov"):
        DSparkConfig.for_target(target.config, sequential_head="none", confidence_with_markov=True)


# -- configs that name the wrong thing --------------------------------------------------------------------------------


def test_a_mistyped_config_field_is_named(saved):
    import json

    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "block_size": "4"}))
    with pytest.raises(ValueError, match=r"Field 'block_size' expected int, got str \(value: '4'\)"):
        DSparkDraftModel.from_pretrained(saved)


@pytest.mark.parametrize(
    "drop, message",
    [
        ("hidden_size", r"lacks the target field\(s\) \['hidden_size'\]"),
        ("vocab_size", r"lacks the target field\(s\) \['vocab_size'\]"),
        ("architectures", r"looks like a DeepSpec DSpark config .* lacks `architectures`"),
    ],
)
def test_deepspec_configs_missing_a_field_are_named(target, tmp_path, drop, message):
    import json

    from test_conversion import deepspec_config

    (tmp_path / "ds").mkdir()
    config = {k: v for k, v in deepspec_config(target.config).items() if k != drop}
    (tmp_path / "ds/config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(tmp_path / "ds")


def test_a_target_folder_as_drafter_is_named(target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="has model_type 'llama', not 'dspark'"):
        DSparkDraftModel.from_pretrained(tmp_path / "target")
