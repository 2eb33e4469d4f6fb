"""A careless user at the command line: every mistake is one line on stderr and exit status 2, caught before any
model loads (the loaders are replaced by ones that fail the test), with the traceback behind --debug."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_conversion import deepspec_config

import dspark_hf
from conftest import make_drafter, make_target
from dspark_hf.cli import main
from dspark_hf.training.dataset import TokenDataset
from dspark_hf.training.trainer import write_manifest


@pytest.fixture
def no_models(monkeypatch):
    """Loading any model fails the test: every case here must be refused before that."""
    import transformers

    import dspark_hf.default
    from dspark_hf.models.modeling_dspark import DSparkDraftModel

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was noticed")

    for owner, name in [
        (dspark_hf.default, "load_default_target"),
        (dspark_hf.default, "load_default"),
        (transformers.AutoModelForCausalLM, "from_pretrained"),
        (transformers.AutoModel, "from_pretrained"),
        (DSparkDraftModel, "from_pretrained"),
    ]:
        monkeypatch.setattr(owner, name, loaded)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Prompt files good and bad, a saved drafter, a dataset file and a dead port."""
    root = tmp_path_factory.mktemp("inputs")
    texts = {
        "good": '{"prompt": "Hello"}\n{"prompt": "there"}\n',
        "malformed": '{"prompt": "ok"}\n{"prompt": \n',
        "no_field": '{"text": "no prompt field"}\n',
        "empty": "\n\n",
        "number": '{"prompt": 5}\n',
        "bad_messages": '{"messages": [{"role": "user"}]}\n',
    }
    for name, text in texts.items():
        (root / f"{name}.jsonl").write_text(text)
    target = make_target()
    make_drafter(target).save_pretrained(root / "drafter")
    config = json.loads((root / "drafter/config.json").read_text())
    (root / "typo_drafter").mkdir()
    (root / "typo_drafter/config.json").write_text(json.dumps({**config, "block_size": "4"}))
    for drop in ("hidden_size", "vocab_size", "architectures"):
        (root / f"no_{drop}").mkdir()
        deepspec = {k: v for k, v in deepspec_config(target.config).items() if k != drop}
        (root / f"no_{drop}" / "config.json").write_text(json.dumps(deepspec))
    (root / "target").mkdir()
    target.config.to_json_file(root / "target/config.json")
    sequences = [torch.randint(0, 99, (40,)).tolist() for _ in range(3)]
    TokenDataset.from_sequences(sequences, [2] * 3).save(root / "data.npz")
    TokenDataset.from_sequences([], []).save(root / "no_sequences.npz")
    TokenDataset.from_sequences([[5, 6, 7]], [0]).save(root / "short.npz")
    (root / "zero_bytes.npz").write_bytes(b"")
    np.savez(root / "no_arrays.npz", ids=np.zeros(3))
    (root / "empty_prompt.jsonl").write_text('{"prompt": "Hello"}\n{"prompt": ""}\n')
    (root / "bad.json").write_text("{block_size: 3")
    (root / "list.json").write_text("[1, 2]")
    (root / "unknown.json").write_text('{"blok_size": 3}')
    with socket.socket() as s:  # a port nothing listens on (free a moment ago)
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    return root, dead_port


def run(argv, capsys):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def cases(root, dead_port):
    good, drafter, data = root / "good.jsonl", root / "drafter", root / "data.npz"
    train = ["train", "--set", f"data={data}", f"output_dir={root / 'run'}"]

    def calibrate(data_path):
        return ["calibrate", "--data", data_path, "--drafter", drafter, "--out", root / "calibrated"]

    def features(data_path):
        return ["features", "--data", data_path, "--out", root / "features"]

    def train_on(data_path):
        return ["train", "--set", f"data={data_path}"]

    return {
        "bench malformed JSONL": (["bench", "--prompts", root / "malformed.jsonl"], "malformed.jsonl:2 is not valid"),
        "bench missing field": (["bench", "--prompts", root / "no_field.jsonl"], 'needs a "prompt"'),
        "bench empty file": (["bench", "--prompts", root / "empty.jsonl"], "holds no prompts"),
        "bench prompt 5": (["bench", "--prompts", root / "number.jsonl"], '"prompt" must be a string'),
        "bench bad messages": (["bench", "--prompts", root / "bad_messages.jsonl"], 'string "role"'),
        "bench missing prompts file": (["bench", "--prompts", root / "nope.jsonl"], "no file at"),
        "bench --drafter missing": (
            ["bench", "--prompts", good, "--drafter", "/no/such/drafter"],
            "--drafter: No DSpark checkpoint (config.json) at /no/such/drafter: the folder does not exist",
        ),
        "bench --target missing": (
            ["bench", "--prompts", good, "--target", "/no/such/target", "--drafter", drafter],
            "--target /no/such/target: no such folder",
        ),
        "bench --limit -1": (["bench", "--prompts", good, "--limit", "-1"], "--limit must be >= 1, got -1"),
        "bench --temperature": (["bench", "--prompts", good, "--temperature", "0,hot"], "--temperature '0,hot'"),
        "bench --serve dead url": (
            ["bench", "--serve", "--url", f"http://127.0.0.1:{dead_port}"],
            f"No server answers at http://127.0.0.1:{dead_port}",
        ),
        "bench --serve bad url": (["bench", "--serve", "--url", "localhost:8000"], "must look like http://HOST:PORT"),
        "bench --serve --concurrency": (["bench", "--serve", "--concurrency", "0"], "counts must be >= 1"),
        "export --drafter missing": (
            ["export", "--drafter", "/no/such/drafter", "--out", root / "out"],
            "No DSpark checkpoint (config.json) at /no/such/drafter",
        ),
        "export --target missing": (
            ["export", "--drafter", drafter, "--target", "/no/such/target", "--out", root / "out"],
            "--target /no/such/target: no such folder",
        ),
        "export --out not empty": (["export", "--drafter", drafter, "--out", drafter], "pass --overwrite"),
        "demo --drafter missing": (["demo", "--drafter", "/no/such/drafter"], "the folder does not exist"),
        "demo --target missing": (
            ["demo", "--target", "/no/such/target", "--drafter", drafter],
            "--target /no/such/target: no such folder",
        ),
        "demo --max-new-tokens -5": (["demo", "--max-new-tokens", "-5"], "--max-new-tokens must be >= 1, got -5"),
        "demo --repeats 0": (["demo", "--repeats", "0"], "--repeats must be >= 1"),
        "train target missing": ([*train, "target=/no/such/target"], "target /no/such/target: no such folder"),
        "train init_drafter missing": ([*train, "init_drafter=/no/such/d"], "init_drafter: No DSpark checkpoint"),
        "train data missing": (["train", "--set", "data=/no/such.npz"], "data /no/such.npz: no such file"),
        "train no data": (["train"], "train needs a token dataset"),
        "train max_steps=abc": ([*train, "max_steps=abc"], "`max_steps` must be int, got 'abc' (str)"),
        "train learning_rate=fast": ([*train, "learning_rate=fast"], "`learning_rate` must be float"),
        "train unknown key": ([*train, "blok_size=3"], "Unknown training option(s) ['blok_size']"),
        "train --config missing": (["train", "--config", root / "nope.json"], "nope.json: no such file"),
        "train --config bad JSON": (["train", "--config", root / "bad.json"], "bad.json is not valid JSON"),
        "train --config a list": (["train", "--config", root / "list.json"], "must hold a mapping of options"),
        "train --config unknown key": (["train", "--config", root / "unknown.json"], "Unknown training option"),
        "profile --context-len -5": (["profile", "--context-len", "-5"], "--context-len must be >= 1, got -5"),
        "profile --lengths": (["profile", "--lengths", "0-3"], "token counts >= 1"),
        "profile --device nonsense": (["profile", "--device", "gpu7"], "--device 'gpu7' is not a device name"),
        "profile --target missing": (["profile", "--target", "/no/such/target"], "no such folder"),
        "serve --port 99999": (["serve", "--port", "99999"], "--port must be in 0..65535, got 99999"),
        "serve --api-key empty": (["serve", "--api-key", " ", "--port", "0"], "--api-key is empty"),
        "serve --max-batch-size 0": (["serve", "--max-batch-size", "0"], "--max-batch-size must be >= 1"),
        "serve --drafter missing": (["serve", "--drafter", "/no/such/drafter", "--port", "0"], "does not exist"),
        "calibrate --data missing": (calibrate("/no/such.npz"), "--data /no/such.npz: no such file"),
        # folders that hold no usable drafter: a typed config with a string where an int belongs, DeepSpec configs
        # missing a field, a target's checkpoint
        **{
            f"demo --drafter {folder}": (["demo", "--drafter", root / folder], message)
            for folder, message in [
                (
                    "typo_drafter",
                    "Invalid DSparkConfig (config.json): Field 'block_size' expected int, got str (value: '4')",
                ),
                ("no_hidden_size", "DeepSpec config lacks the target field(s) ['hidden_size']"),
                ("no_vocab_size", "DeepSpec config lacks the target field(s) ['vocab_size']"),
                ("no_architectures", "looks like a DeepSpec DSpark config"),
                ("target", "has model_type 'llama', not 'dspark': it is not this kind of drafter's checkpoint"),
            ]
        },
        # token datasets that are no datasets, or empty, or too short: found before any model loads
        **{
            f"{command} {what}": (argv(root / name), message)
            for command, argv in [("calibrate", calibrate), ("train", train_on), ("features", features)]
            for what, name, message in [
                ("0-byte .npz", "zero_bytes.npz", "is not a readable .npz token dataset (the file is empty)"),
                (".npz without arrays", "no_arrays.npz", "lacks the array(s) ['tokens', 'offsets'"),
                ("0 sequences", "no_sequences.npz", "no_sequences.npz holds no sequences"),
                # numpy said "pickled data ... allow_pickle=False", naming neither the file's kind nor the fix
                ("a JSONL file", "good.jsonl", "good.jsonl is not a .npz token dataset (it is not a zip archive"),
            ]
        },
        "calibrate too short": (
            calibrate(root / "short.npz"),
            "short.npz is too short to calibrate: a held-out block of this block-4 drafter needs 5 supervised tokens "
            "in a row, and the data holds 0 such blocks; calibration needs at least 2",
        ),
        "calibrate default drafter too short": (
            ["calibrate", "--data", root / "short.npz", "--out", root / "cal"],
            "block-7 drafter needs 8 supervised tokens",
        ),
        "train heldout 0 sequences": ([*train, f"heldout={root / 'no_sequences.npz'}"], "heldout "),
        "bench empty prompt": (
            ["bench", "--prompts", root / "empty_prompt.jsonl"],
            'empty_prompt.jsonl:2: "prompt" is empty',
        ),
        # calibrate writes a calibrated copy to --out, never into the drafter it reads or the installed package
        "calibrate --out in the package": (
            ["calibrate", "--data", data, "--out", Path(dspark_hf.__file__).parent / "default_drafter"],
            "is inside",
        ),
        "calibrate --out = --drafter": (
            ["calibrate", "--data", data, "--drafter", drafter, "--out", drafter, "--overwrite"],
            "the drafter being calibrated, which is never changed in place",
        ),
        # an earlier run's output_dir is never trained over
        "train output_dir not empty": (
            ["train", "--set", f"data={data}", f"output_dir={drafter}"],
            "/drafter is not empty (it holds acceptance.py, checkpoints.py, compat.py, ...); pass resume=True "
            "(--resume) to continue the run in it, or overwrite=True (--overwrite) to replace it with a new run",
        ),
        # the shipped drafter has a context window, which DeepSpec cannot carry: the way to export it anyway
        "export the shipped drafter to deepspec": (
            ["export", "--out", root / "out"],
            "(`context_window` = 512: each block attends to the 512 positions before it), which the DeepSpec format "
            "cannot carry. Export it with --format speculators",
        ),
        "export --drop-context-window speculators": (
            ["export", "--format", "speculators", "--drop-context-window", "--out", root / "out"],
            "--drop-context-window applies to --format deepspec",
        ),
        # a mistyped local path shaped like a Hub id (HF_HUB_OFFLINE in the tests: it cannot be fetched)
        "export --drafter drafters/mine": (
            ["export", "--drafter", "drafters/mine", "--out", root / "out"],
            "--drafter drafters/mine: no such local folder, and as a Hub repo id it cannot be fetched",
        ),
    }


CASES = sorted(cases(Path("/x"), 1))  # the case names


@pytest.mark.parametrize("case", CASES)
def test_user_errors_are_one_line_and_status_2(case, files, no_models, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.delenv("DSPARK_DEBUG", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    argv, expected = cases(*files)[case]
    code, err = run(argv, capsys)
    assert code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line
    assert err.startswith(f"dspark-hf {argv[0]}: error: ") and "Traceback" not in err
    assert expected in err, err


def test_profile_on_cuda_without_cuda(no_models, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = run(["profile", "--device", "cuda"], capsys)
    assert code == 2 and "this machine has no CUDA device" in err and "--device cpu" in err


def test_serve_on_a_port_in_use(no_models, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code, err = run(["serve", "--port", busy.getsockname()[1]], capsys)
    assert code == 2 and "Cannot serve on 127.0.0.1:" in err and "choose another --host or --port" in err


def test_a_refused_resume_stops_before_the_target_loads(files, no_models, capsys, tmp_path):
    """`train --resume` with a changed block_size: refused naming the key, with no model loaded."""
    from dspark_hf.training.config import DSparkTrainingConfig

    root, _ = files
    run_dir = tmp_path / "run"
    saved = DSparkTrainingConfig(data=str(root / "data.npz"), output_dir=str(run_dir), block_size=3)
    checkpoint = run_dir / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2, "config": saved.to_dict()}))
    write_manifest(checkpoint)
    (run_dir / "latest").write_text("checkpoint-2")
    argv = ["train", "--resume", "--set", f"data={root / 'data.npz'}", f"output_dir={run_dir}", "block_size=5"]
    code, err = run(argv, capsys)
    assert code == 2 and "changed block_size (block_size 3 -> 5)" in err and err.count("\n") == 1


def test_debug_shows_the_traceback(files, no_models, capsys, monkeypatch):
    argv = ["bench", "--prompts", str(files[0] / "number.jsonl")]
    with pytest.raises(ValueError, match='"prompt" must be a string'):
        main(["--debug", *argv])
    with pytest.raises(ValueError, match='"prompt" must be a string'):
        main([*argv, "--debug"])
    monkeypatch.setenv("DSPARK_DEBUG", "1")
    with pytest.raises(ValueError, match='"prompt" must be a string'):
        main(argv)


def test_the_installed_command_prints_no_traceback(files):
    """The real process: exit status 2, no traceback, and our single line alone on stderr (no third-party notices
    from importing transformers and torchao: `utils/third_party.py`)."""
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_DEBUG"}
    argv = [sys.executable, "-m", "dspark_hf.cli", "bench", "--prompts", str(files[0] / "good.jsonl"), "--limit", "-1"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "dspark-hf bench: error: --limit must be >= 1, got -1.\n"


# argparse's own errors (types, choices, unknown commands, missing options): one line, status 2, no usage block
ARGPARSE_CASES = {
    "demo --max-new-tokens abc": "argument --max-new-tokens: invalid int value: 'abc'",
    "bench --max-new-tokens abc": "argument --max-new-tokens: invalid int value: 'abc'",
    "profile --max-tokens abc": "argument --max-tokens: invalid int value: 'abc'",
    "serve --port abc": "argument --port: invalid int value: 'abc'",
    "demo --drafter-dtype int8": "argument --drafter-dtype: invalid choice: 'int8'",
    "calibrate --data x.npz --seq-len abc": "argument --seq-len: invalid int value: 'abc'",
    "train --stop-after abc": "argument --stop-after: invalid int value: 'abc'",
    "features --batch-size abc": "argument --batch-size: invalid int value: 'abc'",
    "data --out x --num-prompts abc": "argument --num-prompts: invalid int value: 'abc'",
    "export --format onnx --drafter d --out x": "argument --format: invalid choice: 'onnx'",
    "export --format gguf": "the following arguments are required: --out",
    "bench --no-such-option": "unrecognized arguments: --no-such-option",
    "frobnicate": "argument command: invalid choice: 'frobnicate'",
    "": "the following arguments are required: command",
}


@pytest.mark.parametrize("line", sorted(ARGPARSE_CASES))
def test_argparse_errors_are_one_line_and_status_2(line, no_models, capsys):
    argv = line.split()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.endswith("\n") and err.count("\n") == 1 and "usage" not in err, err
    prog = "dspark-hf" if not argv or argv[0] == "frobnicate" else f"dspark-hf {argv[0]}"
    assert err.startswith(f"{prog}: error: {ARGPARSE_CASES[line]}") and err.endswith(f"(see {prog} --help)\n"), err
