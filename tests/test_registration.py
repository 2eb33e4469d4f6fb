"""Auto-class registration, save/load round trips, and remote code (`trust_remote_code`) without this package."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel

import dspark_hf
from conftest import make_drafter
from dspark_hf import DSparkConfig, DSparkDraftModel


SRC_DIR = Path(dspark_hf.__file__).resolve().parent.parent  # .../src


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


def config_fields(model) -> dict:
    fields = model.config.to_dict()
    fields.pop("_name_or_path")  # the folder it was loaded from
    fields.pop("auto_map", None)  # written into the saved config.json only (remote code)
    return fields


def test_auto_config_and_auto_model_from_config():
    config = AutoConfig.for_model("dspark")
    assert type(config) is DSparkConfig
    model = AutoModel.from_config(config)
    assert type(model) is DSparkDraftModel
    assert model.config.model_type == "dspark"


def test_auto_classes_with_tiny_config(target):
    config = DSparkConfig.for_target(target.config, num_hidden_layers=1, block_size=3, markov_rank=4)
    fields = {k: v for k, v in config.to_diff_dict().items() if k not in ("model_type", "transformers_version")}
    rebuilt = AutoConfig.for_model("dspark", **fields)
    assert type(rebuilt) is DSparkConfig and rebuilt.to_dict() == config.to_dict()
    model = AutoModel.from_config(config)
    assert type(model) is DSparkDraftModel
    assert len(model.layers) == 1 and model.fc.in_features == len(config.target_layer_ids) * 32


def test_register_is_idempotent():
    from transformers import AutoModel, AutoModelForCausalLM

    routed = (AutoModel.from_pretrained.__func__, AutoModelForCausalLM.from_pretrained.__func__)
    dspark_hf.register()
    dspark_hf.register()
    assert type(AutoConfig.for_model("dspark")) is DSparkConfig
    # the DeepSpec routing wraps each Auto class once (not a wrapper of a wrapper)
    assert (AutoModel.from_pretrained.__func__, AutoModelForCausalLM.from_pretrained.__func__) == routed
    assert not hasattr(routed[0].__wrapped__, "_dspark_deepspec")


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # learned mask embedding, Markov head, confidence head
        dict(mask_token_id=7, sequential_head="rnn"),
        dict(sequential_head="gated_markov", confidence_with_markov=False),
        dict(sequential_head="none", confidence_head=False),
    ],
)
def test_save_and_from_pretrained_round_trip_is_bit_exact(target, tmp_path, overrides):
    drafter = make_drafter(target, **overrides)
    with torch.no_grad():  # make every tensor non-trivial, so that a re-initialised one cannot pass by chance
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    drafter.save_pretrained(tmp_path)

    files = set(os.listdir(tmp_path))
    assert "model.safetensors" in files
    assert not any(f.endswith((".bin", ".pt", ".pth")) for f in files), files
    assert {"config.json", "configuration_dspark.py", "modeling_dspark.py"} <= files
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "dspark"
    assert saved["auto_map"] == {
        "AutoConfig": "configuration_dspark.DSparkConfig",
        "AutoModel": "modeling_dspark.DSparkDraftModel",
    }

    loaded = DSparkDraftModel.from_pretrained(tmp_path)
    assert type(loaded) is DSparkDraftModel
    assert config_fields(loaded) == config_fields(drafter)
    assert_same_weights(drafter, loaded)

    auto = AutoModel.from_pretrained(tmp_path)
    assert type(auto) is DSparkDraftModel
    assert_same_weights(drafter, auto)


def test_loaded_drafter_config_round_trips(target, tmp_path):
    drafter = make_drafter(target, block_size=3, sts_temperatures=[1.0, 1.25, 1.5], verify_policy="fixed")
    drafter.save_pretrained(tmp_path)
    config = DSparkDraftModel.from_pretrained(tmp_path).config
    for name in (
        "target_layer_ids",
        "block_size",
        "sts_temperatures",
        "verify_policy",
        "markov_rank",
        "hidden_size",
        "num_target_layers",
        "vocab_size",
        "target_model_type",
    ):
        assert getattr(config, name) == getattr(drafter.config, name), name


def test_loaded_drafter_generates_like_the_original(target, tmp_path):
    drafter = make_drafter(target, verify_policy="fixed")
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path)
    ids = torch.randint(0, 99, (1, 6))
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    out_a = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    stats_a = drafter.generation_stats
    out_b = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=loaded)
    stats_b = loaded.generation_stats
    assert torch.equal(ref, out_a) and torch.equal(ref, out_b)
    # identical weights draft identically: same verify/accept history
    assert stats_b is not None
    a, b = stats_a.to_dict(), stats_b.to_dict()
    survivals_a, survivals_b = a.pop("survivals"), b.pop("survivals")
    a.pop("fewer_threads_rounds"), b.pop("fewer_threads_rounds")  # how fast rounds ran at each thread count
    assert a == b  # identical decisions and acceptances
    for x, y in zip(survivals_a, survivals_b, strict=True):  # float survivals: equal up to kernel rounding
        assert x == pytest.approx(y, abs=1e-5)


# -- remote code in a process that cannot import dspark_hf ---------------------------------------------------------

REMOTE_CODE = r"""
import importlib.abc, importlib.util, json, os, sys

SRC = os.path.realpath(sys.argv[1])


def holds_source_tree(entry):
    real = os.path.realpath(entry or os.getcwd())
    return real == SRC or real.startswith(SRC + os.sep) or (
        os.path.isdir(os.path.join(real, "dspark_hf")) and "-packages" not in real
    )


# The editable install puts src/ on sys.path (a .pth file): take it, and any other source checkout, off again.
sys.path[:] = [p for p in sys.path if not holds_source_tree(p)]
sys.path_importer_cache.clear()
importlib.invalidate_caches()
spec = importlib.util.find_spec("dspark_hf")
# None with the editable install; a regular (non-editable) install is left to the blocker below
assert spec is None or "-packages" in (spec.origin or ""), f"dspark_hf is still importable from {spec.origin}"


class BlockDSpark(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "dspark_hf" or name.startswith("dspark_hf."):
            raise ImportError(f"blocked: {name}")
        return None

sys.meta_path.insert(0, BlockDSpark())
try:
    import dspark_hf  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("dspark_hf was imported")

import torch
from transformers import AutoModel, LlamaForCausalLM

drafter_dir, target_dir, ids = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
torch.set_num_threads(1)
drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True).eval()
target = LlamaForCausalLM.from_pretrained(target_dir, attn_implementation="eager").eval()
ids = torch.tensor([ids])
plain = target.generate(ids, max_new_tokens=12, do_sample=False)
assisted = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
stats = getattr(drafter, "generation_stats", None)
print("RESULT " + json.dumps({
    "match": bool(torch.equal(plain, assisted)),
    "plain": plain[0].tolist(),
    "assisted": assisted[0].tolist(),
    "has_stats": stats is not None,
    "num_target_forwards": None if stats is None else stats.num_target_forwards,
    "accepted": None if stats is None else sum(stats.accepted_lengths),
    "drafter_class": type(drafter).__name__,
    "drafter_module": type(drafter).__module__,
    "dspark_hf_loaded": any(m == "dspark_hf" or m.startswith("dspark_hf.") for m in sys.modules),
}))
"""


def test_remote_code_generate_without_the_package(target, tmp_path):
    drafter = make_drafter(target, verify_policy="fixed")
    drafter_dir, target_dir = tmp_path / "drafter", tmp_path / "target"
    drafter.save_pretrained(drafter_dir)
    target.save_pretrained(target_dir)
    ids = torch.randint(0, 99, (1, 6))
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HF_MODULES_CACHE=str(tmp_path / "hf_modules"),  # the remote code is copied here, not to ~/.cache
        PYTHONNOUSERSITE="1",
        CUDA_VISIBLE_DEVICES="",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(REMOTE_CODE),
            str(SRC_DIR),
            str(drafter_dir),
            str(target_dir),
            json.dumps(ids[0].tolist()),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT ") :])

    assert result["dspark_hf_loaded"] is False
    assert result["drafter_class"] == "DSparkDraftModel"
    assert result["drafter_module"].startswith("transformers_modules"), result["drafter_module"]
    assert result["plain"] == expected  # the saved target is the fixture's target
    assert result["match"] is True and result["assisted"] == expected
    # the remote-code drafter was really used through DSpark's candidate generator
    assert result["has_stats"] is True
    assert result["num_target_forwards"] >= 1
    assert result["accepted"] + result["num_target_forwards"] + 1 == 12
