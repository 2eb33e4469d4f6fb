"""`export_gguf`: what llama.cpp's DSpark path cannot carry is refused by name; the converter is called with a
speculators folder and the target's config and tokenizer (a stand-in converter checks them); slow, when a llama.cpp
tree, its converter environment and built tools exist under /work/envs/llamacpp: the real converter and llama.cpp."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_drafter, make_target
from dspark_hf.integrations.gguf import export_gguf
from helpers import char_tokenizer, tiny_qk


ROOT = Path(__file__).resolve().parents[1]
LLAMACPP = Path(os.environ.get("LLAMACPP_ROOT", "/work/envs/llamacpp"))
LLAMACPP_SRC = LLAMACPP / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
CONVERTER_PYTHON = LLAMACPP / "venv" / "bin" / "python"

# A stand-in for llama.cpp's convert_hf_to_gguf.py: checks what it is given, then writes --outfile.
FAKE_CONVERTER = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
draft, target = Path(args[0]), Path(args[args.index("--target-model-dir") + 1])
config = json.loads((draft / "config.json").read_text())
assert config["speculators_model_type"] == "dspark" and (draft / "model.safetensors").is_file(), config
assert json.loads((target / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
assert (target / "tokenizer.json").is_file()
if "FAIL" in Path(__file__).read_text().split("#" + " mode:")[-1]:
    print("converter exploded"); sys.exit(3)
Path(args[args.index("--outfile") + 1]).write_bytes(b"GGUF" + args[args.index("--outtype") + 1].encode())
"""


def fake_llamacpp(tmp_path: Path, fail: bool = False) -> Path:
    folder = tmp_path / ("fake-fail" if fail else "fake")
    folder.mkdir(parents=True)
    (folder / "convert_hf_to_gguf.py").write_text(FAKE_CONVERTER + ("# mode: FAIL\n" if fail else "# mode: ok\n"))
    return folder


def exportable(target, **overrides):
    return make_drafter(target, use_qk_norm=True, mask_token_id=5, **overrides)


def test_refuses_what_llamacpp_cannot_carry(tmp_path):
    target, tokenizer = make_target(), char_tokenizer(99)
    fake = fake_llamacpp(tmp_path)
    with pytest.raises(ValueError, match=r"llama.cpp \(GGUF\).*`sequential_head`: 'rnn'.*conversion/qwen.py"):
        export_gguf(exportable(target, sequential_head="rnn"), target, tokenizer, tmp_path / "d.gguf", fake)
    with pytest.raises(ValueError, match=r"`sequential_head`: 'gated_markov'"):
        export_gguf(exportable(target, sequential_head="gated_markov"), target, tokenizer, tmp_path / "d.gguf", fake)
    with pytest.raises(ValueError, match=r"`confidence_with_markov`.*src/models/dflash.cpp"):
        export_gguf(exportable(target, confidence_with_markov=False), target, tokenizer, tmp_path / "d.gguf", fake)
    learned = make_drafter(target, use_qk_norm=False, mask_token_id=None)
    with pytest.raises(ValueError, match=r"llama.cpp \(GGUF\).*`use_qk_norm`.*`mask_token_id`"):
        export_gguf(learned, target, tokenizer, tmp_path / "d.gguf", fake)
    with pytest.raises(ValueError, match="--llamacpp"):
        export_gguf(exportable(target), target, tokenizer, tmp_path / "d.gguf", None)
    with pytest.raises(ValueError, match="No convert_hf_to_gguf.py"):
        export_gguf(exportable(target), target, tokenizer, tmp_path / "d.gguf", tmp_path)
    assert not (tmp_path / "d.gguf").exists()


def test_runs_the_converter_on_a_speculators_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMACPP_DIR", raising=False)
    target, tokenizer = make_target(), char_tokenizer(99)
    target.config.architectures = None  # as a target loaded from a GGUF file: filled in from the model class
    out = export_gguf(exportable(target), target, tokenizer, tmp_path / "d.gguf", fake_llamacpp(tmp_path), "q8_0")
    assert out.read_bytes() == b"GGUFq8_0"
    with pytest.raises(FileExistsError, match="overwrite"):
        export_gguf(exportable(target), target, tokenizer, out, fake_llamacpp(tmp_path / "again"))
    dflash = exportable(target, sequential_head="none", confidence_with_markov=False, confidence_head=False)
    export_gguf(dflash, target, tokenizer, out, fake_llamacpp(tmp_path / "dflash"), overwrite=True)
    with pytest.raises(RuntimeError, match="converter exploded"):
        export_gguf(exportable(target), target, tokenizer, tmp_path / "x.gguf", fake_llamacpp(tmp_path, fail=True))
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf.tmp"))


def test_outtype_follows_the_range_the_weights_need(tmp_path):
    """auto writes f16, or bf16 for weights below float16's range, which f16 and q8_0 refuse (they would round the
    twin's q/k projections to zero)."""
    target, tokenizer = make_target(), char_tokenizer(99)
    assert export_gguf(exportable(target), target, tokenizer, tmp_path / "a.gguf", fake_llamacpp(tmp_path / "a"))
    assert (tmp_path / "a.gguf").read_bytes() == b"GGUFf16"
    twin = tiny_qk(exportable(target))
    export_gguf(twin, target, tokenizer, tmp_path / "b.gguf", fake_llamacpp(tmp_path / "b"))
    assert (tmp_path / "b.gguf").read_bytes() == b"GGUFbf16"
    for outtype in ("f16", "q8_0"):
        with pytest.raises(ValueError, match=rf"--outtype {outtype} .*layers.0.self_attn.q_proj.weight.*bf16"):
            export_gguf(twin, target, tokenizer, tmp_path / "c.gguf", fake_llamacpp(tmp_path / outtype), outtype)
    assert not (tmp_path / "c.gguf").exists()


def test_cli_export_gguf(tmp_path):
    from dspark_hf.cli import main as cli_main

    target = make_target()
    target.config.architectures = ["LlamaForCausalLM"]
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(99).save_pretrained(tmp_path / "target")
    exportable(target).save_pretrained(tmp_path / "drafter")
    argv = ["export", "--format", "gguf", "--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "target")]
    argv += ["--out", str(tmp_path / "d.gguf"), "--llamacpp", str(fake_llamacpp(tmp_path)), "--outtype", "bf16"]
    assert cli_main(argv) == 0
    assert (tmp_path / "d.gguf").read_bytes() == b"GGUFbf16"


needs_converter = pytest.mark.skipif(
    not (LLAMACPP_SRC / "convert_hf_to_gguf.py").is_file() or not CONVERTER_PYTHON.exists(),
    reason=f"no llama.cpp tree and converter environment under {LLAMACPP}",
)


def gguf_fields(path) -> dict:
    """The `dflash.*` keys, the mask token and the tensor shapes of a GGUF file, read with the tree's gguf-py."""
    read = (
        "import sys, json; from gguf import GGUFReader; r = GGUFReader(sys.argv[1]); "
        "print(json.dumps({f.name: f.contents() for f in r.fields.values() if f.name.startswith('dflash.') "
        "or f.name == 'tokenizer.ggml.mask_token_id'} | {'tensors': {t.name: [int(d) for d in t.shape] "
        "for t in r.tensors}}))"
    )
    env = {**os.environ, "PYTHONPATH": str(LLAMACPP_SRC / "gguf-py")}
    run = subprocess.run([str(CONVERTER_PYTHON), "-c", read, str(path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.slow
@needs_converter
def test_llamacpp_converter_writes_the_context_window(tmp_path):
    """A drafter's `context_window` reaches llama.cpp as the draft's sliding window, on every draft layer."""
    from dspark_hf import DSparkConfig, DSparkDraftModel
    from dspark_hf.default import load_default_target

    target, tokenizer = load_default_target()
    config = DSparkConfig.for_target(target.config, num_hidden_layers=2, block_size=4, markov_rank=16)
    config.context_window = 6
    drafter = DSparkDraftModel(config)
    python = str(CONVERTER_PYTHON)
    out = export_gguf(drafter, target, tokenizer, tmp_path / "w.gguf", LLAMACPP_SRC, "f32", python=python)
    info = gguf_fields(out)
    assert info["dflash.attention.sliding_window"] == 6
    assert info["dflash.attention.sliding_window_pattern"] == [True, True]


@pytest.mark.slow
@needs_converter
def test_llamacpp_converts_and_runs_the_drafter_losslessly(tmp_path):
    """llama.cpp's converter writes our target layers (+1: its layer-input numbering), block size and mask token; when
    the tools are built, llama.cpp + the drafter generates exactly llama.cpp's plain greedy text."""
    from dspark_hf import DSparkConfig, DSparkDraftModel
    from dspark_hf.default import load_default_target

    target, tokenizer = load_default_target()
    drafter = DSparkDraftModel(
        DSparkConfig.for_target(target.config, num_hidden_layers=1, block_size=4, markov_rank=16)
    )
    drafter.save_pretrained(tmp_path / "drafter")
    out = export_gguf(
        drafter, target, tokenizer, tmp_path / "d.gguf", LLAMACPP_SRC, "f32", python=str(CONVERTER_PYTHON)
    )
    info = gguf_fields(out)
    assert "dflash.attention.sliding_window" not in info
    assert info["dflash.target_layers"] == [i + 1 for i in drafter.config.target_layer_ids]
    assert info["dflash.block_size"] == 4 and info["tokenizer.ggml.mask_token_id"] == drafter.config.mask_token_id
    assert info["tensors"]["markov_w1.weight"] == [16, drafter.config.vocab_size]
    binaries = LLAMACPP / "build" / "bin"
    if not (binaries / "llama-speculative-simple").exists() or not (binaries / "llama-completion").exists():
        pytest.skip(f"llama.cpp tools not built in {binaries}")
    script = ROOT / "tools" / "check_llamacpp_dspark.py"
    cmd = [sys.executable, str(script), "--bin", str(binaries), "--draft", str(out), "--num-prompts", "2"]
    cmd += [
        "--max-new-tokens",
        "24",
        "--draft-max",
        "4",
        "--threads",
        "1",
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
    ]
    (tmp_path / "prompts.jsonl").write_text(
        '{"turns": ["Name three colours."]}\n{"turns": ["What is 12 times 7? Explain."]}\n'
    )
    run = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.splitlines()[-1])
    assert summary["prompts"] == summary["identical"] == 2
