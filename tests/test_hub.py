"""Hub artifacts: generated model card, custom_generate/, push_to_hub, offline loading from a real cache layout."""

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf import DSparkDraftModel
from dspark_hf.integrations.deepspec import export_deepspec
from dspark_hf.integrations.hub import model_card, push_to_hub, save_for_hub


BLOCK_DSPARK = textwrap.dedent(
    """
    import importlib.abc, sys
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "dspark_hf" or name.startswith("dspark_hf."):
                raise ImportError("dspark_hf is blocked in this test")
    sys.meta_path.insert(0, _Block())
    """
)

RESULT = {
    "num_prompts": 3,
    "acceptance_length": 2.5,
    "speedup": 1.3,
    "all_identical": True,
    "per_position_acceptance": [0.8, 0.6, None, None],
}


PROFILE = {"device": "cpu", "dtype": "float32", "sps": {"2": 8.25, "1": 10.5, "10": 5.0}}
# the report `dspark-hf calibrate` writes (calibration.calibration_report), for a block of 2
CALIBRATION = {
    "before": {"ece": [0.1234, 0.2], "auroc": [0.7, 0.75], "brier": [0.2, 0.2]},
    "after": {"ece": [0.0123, 0.05], "auroc": [0.7, None], "brier": [0.1, 0.1]},
    "temperatures": [1.5, 0.8],
    "num_blocks": 64,
}


def test_model_card_is_built_from_measured_results(target):
    drafter = make_drafter(target)
    drafter.config.target_name_or_path = "org/tiny-target"
    drafter.config.target_revision = "abc123"
    training = {"data": "train.npz", "max_steps": 1000, "train_tokens": 12345}
    card = model_card(drafter.config, {"gsm8k": RESULT}, PROFILE, training, CALIBRATION)
    assert card.startswith("---\nlibrary_name: dspark-hf") and "base_model: org/tiny-target" in card
    assert "intended target: org/tiny-target at revision abc123 (llama, hidden 32, 4 layers, vocab 99)" in card
    assert "| gsm8k | 3 | 2.50 | 1.30x | True | 0.80 0.60 - - |" in card  # τ per dataset and per position
    assert "Profiled on cpu (float32)" in card and "1: 10.5, 2: 8.2, 10: 5.0" in card  # sorted by verify size
    assert "64 held-out blocks" in card
    assert "| 1 | 1.500 | 0.1234 | 0.0123 | 0.700 |" in card and "| 2 | 0.800 | 0.2000 | 0.0500 | - |" in card
    assert "\n| position | temperature | ECE before | ECE after | AUROC |\n|---|---|---|---|---|\n" in card
    assert '"train_tokens": 12345' in card
    assert "draft trees: none (chains)" in card
    drafter.config.tree_budget = "auto"
    assert "draft trees: auto (trees of 16 nodes" in model_card(drafter.config)
    drafter.config.tree_budget = 0
    crossed = {**CALIBRATION, "cross_fitted": {"ece": [0.0456, 0.06], "auroc": [0.7, None], "brier": [0.1, 0.1]}}
    card = model_card(drafter.config, calibration={**crossed, "folds": 2})
    assert (
        "\n| position | temperature | ECE before | ECE after | ECE cross-fitted | AUROC |\n|---|---|---|---|---|---|\n"
        in card
    )
    assert "(2 folds)" in card
    assert "| 1 | 1.500 | 0.1234 | 0.0123 | 0.0456 | 0.700 |" in card
    drafter.config.target_revision = None
    bare = model_card(drafter.config)
    assert "None recorded yet" in bare and "at revision unknown" in bare and "## Calibration" not in bare


def test_profile_and_calibration_beside_the_checkpoint_are_published(tmp_path, target):
    make_drafter(target).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "sps_profile.json").write_text(json.dumps(dict(PROFILE, format="dspark-sps-v1", target={})))
    (tmp_path / "ckpt" / "calibration.json").write_text(json.dumps(CALIBRATION))
    state = {"step": 400, "best_tau": 2.5, "config": {"data": "train.npz", "max_steps": 1000}}
    (tmp_path / "ckpt" / "trainer_state.json").write_text(json.dumps(state))  # as the trainer writes it
    folder = save_for_hub(DSparkDraftModel.from_pretrained(tmp_path / "ckpt"), tmp_path / "repo")
    assert json.loads((folder / "calibration.json").read_text()) == CALIBRATION
    assert json.loads((folder / "sps_profile.json").read_text())["sps"] == PROFILE["sps"]
    card = (folder / "README.md").read_text()
    assert "Profiled on cpu" in card and "| 1 | 1.500 | 0.1234 | 0.0123 | 0.700 |" in card
    assert '"data": "train.npz"' in card and '"step": 400' in card


def test_record_target_finds_the_hub_revision(tmp_path, monkeypatch, target):
    from huggingface_hub import constants

    sha = "89abcdef0123456789abcdef0123456789abcdef"
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / sha
    target.save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(sha)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config = make_drafter(target).config
    for name in ("org/tiny", str(snapshot)):  # a cached repo id, or its snapshot folder
        target.config._name_or_path = name
        config.record_target(target)
        assert (config.target_name_or_path, config.target_revision) == (name, sha)
    target.config._name_or_path = str(tmp_path)  # a plain folder: unknown, unless given
    config.record_target(target)
    assert config.target_revision is None
    config.record_target(target, revision="v1.0")
    assert config.target_revision == "v1.0"


def test_save_for_hub_writes_a_complete_folder(tmp_path, target):
    drafter = make_drafter(target)
    folder = save_for_hub(drafter, tmp_path / "repo", results={"chat": RESULT}, profile={"device": "cpu", "sps": {}})
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    for expected in (
        "config.json",
        "model.safetensors",
        "configuration_dspark.py",
        "modeling_dspark.py",
        "README.md",
        "sps_profile.json",
        "custom_generate/generate.py",
        "custom_generate/drafting.py",
        "custom_generate/requirements.txt",
    ):
        assert expected in names, expected
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    assert not any(n.endswith(".bin") for n in names)


def test_save_for_hub_without_code_loads_with_the_package(tmp_path, target):
    """The embedded default's layout: weights, config and card, no remote code; it loads and drafts the same."""
    from dspark_hf import DSparkDraftModel

    drafter = make_drafter(target)
    folder = save_for_hub(drafter, tmp_path / "repo", with_code=False)
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert names == {"config.json", "model.safetensors", "README.md"}
    assert "auto_map" not in json.loads((folder / "config.json").read_text())
    loaded = DSparkDraftModel.from_pretrained(folder)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_push_to_hub_uploads_the_folder(tmp_path, target):
    class FakeApi:
        def __init__(self):
            self.calls = []

        def create_repo(self, repo_id, private, exist_ok):
            self.calls.append(("create", repo_id, private))

        def upload_folder(self, repo_id, folder_path, commit_message):
            shutil.copytree(folder_path, tmp_path / "uploaded")
            self.calls.append(("upload", repo_id))
            return type("Info", (), {"commit_url": f"https://hub/{repo_id}/commit/1"})()

    api = FakeApi()
    url = push_to_hub(make_drafter(target), "org/dspark-tiny", results={"x": RESULT}, api=api)
    assert url.endswith("/commit/1") and api.calls == [
        ("create", "org/dspark-tiny", False),
        ("upload", "org/dspark-tiny"),
    ]
    assert (tmp_path / "uploaded/README.md").is_file() and (
        tmp_path / "uploaded/custom_generate/generate.py"
    ).is_file()
    with pytest.raises(ValueError, match="org/name"):
        push_to_hub(make_drafter(target), "no-slash", api=api)


def _lay_out_cache(cache, repo_id, source):
    """A real Hugging Face cache snapshot: models--org--name/{refs/main, snapshots/<sha>/...}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(source, root / "snapshots" / sha)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)


def test_load_by_repo_id_offline_from_the_cache(tmp_path, target):
    """Our format by repo id and a DeepSpec-format repo by AutoModel, from a real cache layout, HF_HUB_OFFLINE=1."""
    drafter = make_drafter(target)
    save_for_hub(drafter, tmp_path / "repo")
    _lay_out_cache(tmp_path / "cache", "org/dspark-tiny", tmp_path / "repo")
    exportable = make_drafter(target, use_qk_norm=True, mask_token_id=5)
    exportable.save_pretrained(tmp_path / "ours")
    export_deepspec(exportable, target, tmp_path / "deepspec")
    _lay_out_cache(tmp_path / "cache", "deepseek-ai/dspark-tiny", tmp_path / "deepspec")
    code = textwrap.dedent(
        f"""
        import torch, dspark_hf
        from transformers import AutoModel
        from dspark_hf import DSparkDraftModel
        def same(a, b):
            return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
        d = DSparkDraftModel.from_pretrained("org/dspark-tiny")
        assert same(d, DSparkDraftModel.from_pretrained({str(tmp_path / "repo")!r}))
        ds = AutoModel.from_pretrained("deepseek-ai/dspark-tiny")
        assert isinstance(ds, DSparkDraftModel), type(ds)
        assert same(ds, DSparkDraftModel.from_pretrained({str(tmp_path / "ours")!r}))
        print("OK")
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_custom_generate_folder_works_without_the_package(tmp_path):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    save_for_hub(make_drafter(target), tmp_path / "repo")
    code = BLOCK_DSPARK + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModel, AutoModelForCausalLM
        from transformers.generation.utils import GenerationMixin
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r}).eval()
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            setattr(target.generation_config, key, None)
        drafter = AutoModel.from_pretrained({str(tmp_path / "repo")!r}, trust_remote_code=True).eval()
        # the remote modeling file installs the routing of generate(assistant_model=drafter), as a user has it
        assert getattr(GenerationMixin.generate, "_dspark_routing", False)
        ids = torch.randint(0, 99, (1, 6))
        ref = target.generate(ids, max_new_tokens=12, do_sample=False)
        # the README's Hub call, as it is written there
        out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                              custom_generate={str(tmp_path / "repo")!r}, trust_remote_code=True)
        assert torch.equal(ref, out), (ref, out)
        assert drafter.generation_stats.num_target_forwards > 0
        print("OK", drafter.generation_stats.num_target_forwards)
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "home"))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def _foreign_custom_generate(folder):
    """A Hub-style folder whose `custom_generate/generate.py` is not DSpark's."""
    (folder / "custom_generate").mkdir(parents=True)
    (folder / "custom_generate" / "generate.py").write_text(
        "def generate(model, **kwargs):\n    raise AssertionError('the foreign custom_generate ran')\n"
    )
    return folder


def test_our_custom_generate_with_a_dspark_assistant_routes_once(tmp_path, target):
    """With the routing of `import dspark_hf` installed, the README's Hub call (a DSpark `assistant_model` and our
    `custom_generate` folder) runs DSpark's loop once, as do our functions passed as `custom_generate`."""
    import dspark_hf
    from dspark_hf.integrations import generation

    drafter = make_drafter(target)
    save_for_hub(drafter, tmp_path / "repo")
    ids = torch.randint(0, 99, (1, 6))
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    calls = []
    original = generation.speculative_generate

    @functools.wraps(original)  # its signature: transformers passes the keyword arguments it names
    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    for custom in (str(tmp_path / "repo"), dspark_hf.generate, dspark_hf.speculative_generate):
        calls.clear()
        drafter.generation_stats = None
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(generation, "speculative_generate", counted)
            out = target.generate(
                ids,
                max_new_tokens=10,
                do_sample=False,
                assistant_model=drafter,
                custom_generate=custom,
                trust_remote_code=True,
            )
        assert torch.equal(ref, out), custom
        assert calls == [1] and drafter.generation_stats.num_target_forwards > 0, custom
    # loading the folder's flat copy in this process left the package's own kernels registered
    from transformers import AttentionInterface

    from dspark_hf.kernels import verify_attention

    registered = AttentionInterface()[verify_attention.ATTN_IMPLEMENTATION]
    assert registered is verify_attention.verify_sdpa_attention_forward


def test_a_foreign_custom_generate_with_a_dspark_assistant_is_refused(tmp_path, target):
    drafter = make_drafter(target)
    ids = torch.randint(0, 99, (1, 6))
    foreign = _foreign_custom_generate(tmp_path / "foreign")

    def mine(model, **kwargs):
        raise AssertionError("the foreign callable ran")

    for custom, named in ((str(foreign), str(foreign)), (mine, "mine")):
        with pytest.raises(ValueError, match=r"custom_generate.*is not DSpark's.*assistant_model") as err:
            target.generate(
                ids, max_new_tokens=4, assistant_model=drafter, custom_generate=custom, trust_remote_code=True
            )
        assert named in str(err.value) and "\n" not in str(err.value)


def test_pairing_check_at_load_and_generate_with_tokenizer_hashes(tmp_path, target, caplog):
    import logging

    from helpers import char_tokenizer

    drafter = make_drafter(target)
    tok = char_tokenizer(99)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    drafter.config.record_target(target, tok)
    assert drafter.config.target_tokenizer_hash and drafter.config.target_chat_template_hash
    drafter.save_pretrained(tmp_path / "d")
    DSparkDraftModel.from_pretrained(tmp_path / "d", target=target, tokenizer=tok)  # same target: fine
    other = char_tokenizer(99)
    other.add_tokens(["zz"])  # a different vocabulary
    ids = torch.randint(0, 99, (1, 5))
    with pytest.raises(ValueError, match="tokenizer vocabulary"):
        DSparkDraftModel.from_pretrained(tmp_path / "d", target=target, tokenizer=other)
    with pytest.raises(ValueError, match="tokenizer vocabulary"):  # and again at generate()
        target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=drafter, tokenizer=other)
    with pytest.raises(ValueError, match="another target"):
        DSparkDraftModel.from_pretrained(tmp_path / "d", target=make_target(vocab_size=101))

    retemplated = char_tokenizer(99)
    retemplated.chat_template = "{{ messages }}"  # only the chat template differs: a warning, no error
    for load_or_generate in (
        lambda: DSparkDraftModel.from_pretrained(tmp_path / "d", target=target, tokenizer=retemplated),
        lambda: target.generate(ids, max_new_tokens=6, assistant_model=drafter, tokenizer=retemplated),
    ):
        logging.Logger.warning_once.cache_clear()  # transformers' warning_once would hide a repeated warning
        caplog.clear()
        with caplog.at_level("WARNING", logger="dspark_hf.models.configuration_dspark"):
            load_or_generate()
        assert "chat template differs" in caplog.text
    assert torch.equal(
        target.generate(ids, max_new_tokens=6, do_sample=False),
        target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=drafter, tokenizer=retemplated),
    )
