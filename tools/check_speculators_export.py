"""Check `dspark-hf export --format speculators` against speculators' own loader and forward pass.

Two Python environments take part, because speculators pins an older transformers than this package:

1. ours writes test cases: tiny random targets (saved with `save_pretrained`) and drafters for every sequential head
   (markov, gated_markov, rnn, none = DFlash), with and without a draft vocabulary, exported with
   `export_speculators`; next to each, `reference.safetensors` holds the inputs (token ids, target features) and our
   drafter's block logits and confidence logits, computed block by block the way drafting runs (context < anchor,
   the whole own block, teacher-forced previous tokens);
2. the speculators environment loads each folder with `SpeculatorModel.from_pretrained` (which also reloads the
   embedding and LM head from the verifier folder the export recorded), reports its loading info, runs speculators'
   `DSparkDraftModel.forward` over the same inputs (its loss function replaced by one that keeps the logits and
   confidence logits it is given) and compares them with ours.

Set up the speculators environment once (never a dependency of dspark-hf):

    python3 -m venv /work/envs/speculators
    /work/envs/speculators/bin/pip install torch==2.13.0
    /work/envs/speculators/bin/pip install "transformers<=5.19.0" "numpy<=2.5.4" safetensors pydantic \
        pydantic-settings "loguru<=0.7.3" huggingface-hub "tqdm<=4.70.1" rich click typer psutil protobuf httpx \
        aiohttp openai
    /work/envs/speculators/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0

(`datasets`, which speculators imports at import time for training, is replaced by a stub below.) Then, from the
repository root with this package's environment:

    python tools/check_speculators_export.py [--speculators-python /work/envs/speculators/bin/python]

It prints one line per case and exits 1 when any case has missing or unexpected keys or differs by more than
`--atol` (1e-5, float32). `write DIR` and `check DIR` run the two halves separately.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


DEFAULT_PYTHON = "/work/envs/speculators/bin/python"
SEQ_LEN = 16
MASK_TOKEN = 5
# (name, target family, drafter overrides, draft vocabulary size or 0)
CASES = [
    ("markov", "llama", dict(sequential_head="markov"), 0),
    ("markov-draft-vocab", "llama", dict(sequential_head="markov"), 40),
    ("gated", "llama", dict(sequential_head="gated_markov"), 0),
    ("gated-draft-vocab", "llama", dict(sequential_head="gated_markov"), 40),
    ("rnn", "llama", dict(sequential_head="rnn"), 0),
    ("rnn-draft-vocab", "llama", dict(sequential_head="rnn"), 40),
    ("dflash", "llama", dict(sequential_head="none", confidence_with_markov=False), 0),
    ("dflash-draft-vocab", "llama", dict(sequential_head="none", confidence_with_markov=False), 40),
    ("dflash-no-confidence", "llama", dict(sequential_head="none", confidence_head=False), 0),
    ("markov-confidence-without-markov", "llama", dict(sequential_head="markov", confidence_with_markov=False), 0),
    ("rnn-llama3-rope-tied-target", "llama3", dict(sequential_head="rnn"), 40),
    ("markov-qwen3-target", "qwen3", dict(sequential_head="markov"), 0),
    ("markov-context-window", "llama", dict(sequential_head="markov", context_window=5), 0),  # bites from anchor 6
]


# -- our side -------------------------------------------------------------------------------------------------------


def make_target(family: str, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    shapes = dict(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**shapes)).eval()
    if family == "llama3":  # llama3 RoPE scaling and a tied LM head
        rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        config = LlamaConfig(
            **shapes,
            rope_theta=500000.0,
            rope_scaling=dict(rope, original_max_position_embeddings=16),
            tie_word_embeddings=True,
        )
        return LlamaForCausalLM(config).eval()
    return LlamaForCausalLM(LlamaConfig(**shapes)).eval()


def make_drafter(target, overrides: dict, draft_vocab: int, seed: int = 1):
    import torch

    from dspark_hf import DSparkConfig, DSparkDraftModel

    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=2, block_size=4, markov_rank=8, target_layer_ids=[0, 2], mask_token_id=MASK_TOKEN)
    config = DSparkConfig.for_target(target.config, **{**fields, **overrides, "use_qk_norm": True})
    config._attn_implementation = "eager"
    drafter = DSparkDraftModel(config).eval()
    with torch.no_grad():  # every weight random and non-trivial (norm gains, biases and zero-initialised heads too)
        for name, param in drafter.named_parameters():
            param.normal_(mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.3)
    if draft_vocab:
        drafter.set_draft_vocab(torch.randperm(config.vocab_size)[:draft_vocab])
    return drafter


def reference_outputs(drafter, target, input_ids, features):
    """Our block logits over the draft vocabulary (N, γ, V') and confidence logits (N, γ), anchors 1 .. L-γ-1.
    With a context window W, the block anchored at a sees the context a - W .. a - 1, as drafting feeds it."""
    import torch

    gamma, window = drafter.config.block_size, drafter.config.context_window
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    ids = drafter.draft_vocab_ids
    logits, confidence = [], []
    for a in range(1, input_ids.shape[1] - gamma):
        noise = drafter.block_input_embeds(input_ids[:, a : a + 1], embed)  # (1, γ, d): anchor + mask slots
        start = 0 if window is None else max(0, a - window)
        hidden = drafter(noise, features[:, start:a], torch.arange(start, a + gamma)[None]).last_hidden_state
        prev = input_ids[:, a : a + gamma]  # teacher forcing: the anchor, then the block's true tokens
        block = drafter.draft_base_logits(hidden, lm_head)
        bias, _ = drafter.draft_sequential_bias(prev, hidden)
        if bias is not None:
            block = block + bias
        if ids is not None:
            outside = torch.ones(block.shape[-1], dtype=torch.bool)
            outside[ids] = False
            assert torch.isneginf(block[..., outside]).all()  # we draft nothing outside the draft vocabulary
            block = block[..., ids]
        logits.append(block[0])
        conf = drafter.confidence_logits(hidden, prev)
        if conf is not None:
            confidence.append(conf[0])
    out = {"logits": torch.stack(logits)}
    if confidence:
        out["confidence"] = torch.stack(confidence)
    return out


def write_cases(root: Path) -> list[str]:
    import torch
    from safetensors.torch import save_file

    from dspark_hf.integrations.speculators import export_speculators

    names = []
    for name, family, overrides, draft_vocab in CASES:
        case = root / name
        target = make_target(family)
        target.save_pretrained(case / "target")  # the verifier speculators reloads embedding and LM head from
        drafter = make_drafter(target, overrides, draft_vocab)
        export_speculators(drafter, target, case / "speculators", verifier=str((case / "target").resolve()))
        torch.manual_seed(2)
        d = drafter.config.hidden_size
        input_ids = torch.randint(0, drafter.config.vocab_size, (1, SEQ_LEN))
        features = torch.randn(1, SEQ_LEN, len(drafter.config.target_layer_ids) * d)
        with torch.no_grad():
            expected = reference_outputs(drafter, target, input_ids, features)
        tensors = dict(input_ids=input_ids, features=features, verifier_last=torch.randn(1, SEQ_LEN, d), **expected)
        save_file({k: v.contiguous() for k, v in tensors.items()}, case / "reference.safetensors")
        names.append(name)
    return names


# -- speculators' side ----------------------------------------------------------------------------------------------


def _stub_datasets() -> None:
    """speculators imports `datasets` at import time (training data only); a stub stands in for it."""
    import types

    if "datasets" in sys.modules:
        return
    try:
        import datasets  # noqa: F401

        return
    except ImportError:
        pass
    stub = types.ModuleType("datasets")

    def _unavailable(*args, **kwargs):
        raise ImportError("datasets is stubbed out in this check")

    stub.load_from_disk = stub.load_dataset = _unavailable
    stub.Dataset = type("Dataset", (), {})
    sys.modules["datasets"] = stub


def check_case(case: Path, atol: float) -> dict:
    import torch
    from safetensors.torch import load_file

    _stub_datasets()
    import speculators.models.dspark.core as dspark_core
    from speculators import SpeculatorModel, SpeculatorModelConfig
    from speculators.models.dflash.utils import select_anchors

    folder = str(case / "speculators")
    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # CPU: no flex attention
    # with output_loading_info, from_pretrained returns (model, info) and skips the verifier reload
    _, info = SpeculatorModel.from_pretrained(folder, config=config, output_loading_info=True)
    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(folder, config=config).float().eval()  # the path users take
    nan = [k for k, v in model.state_dict().items() if v.is_floating_point() and v.isnan().any()]

    ref = load_file(case / "reference.safetensors")
    input_ids, features = ref["input_ids"], ref["features"]
    seq_len, gamma = input_ids.shape[1], model.block_size
    loss_mask = torch.ones(1, seq_len)
    loss_mask[:, 0] = 0
    n_blocks = seq_len - gamma - 1
    anchors, _ = select_anchors(loss_mask, n_blocks, gamma)
    assert anchors.tolist() == list(range(1, seq_len - gamma)), anchors  # every valid position: deterministic

    captured = {}

    def keep_outputs(logits, targets, confidence_logits, *args, **kwargs):
        captured.update(logits=logits, confidence=confidence_logits)
        return torch.zeros(()), {}

    original, dspark_core.compute_metrics = dspark_core.compute_metrics, keep_outputs
    try:
        with torch.no_grad():
            model(
                hidden_states=features,
                input_ids=input_ids,
                loss_mask=loss_mask,
                verifier_last_hidden_states=ref["verifier_last"],
                document_ids=torch.zeros(1, seq_len, dtype=torch.long),
                max_anchors=n_blocks,
            )
    finally:
        dspark_core.compute_metrics = original
    logits = captured["logits"].view(n_blocks, gamma, -1)
    result = dict(
        case=case.name,
        class_name=type(model).__name__,
        missing_keys=sorted(info.get("missing_keys", [])),
        unexpected_keys=sorted(info.get("unexpected_keys", [])),
        mismatched_keys=[str(k) for k in info.get("mismatched_keys", [])],
        nan_weights=nan,
        draft_vocab_size=int(model.draft_vocab_size),
        logits_shape=list(logits.shape),
        max_abs_logits=float((logits - ref["logits"]).abs().max()),
        logits_scale=float(ref["logits"].abs().max()),
        same_argmax=bool(torch.equal(logits.argmax(-1), ref["logits"].argmax(-1))),
    )
    conf = captured["confidence"]
    if ("confidence" in ref) != (conf is not None):
        result["confidence_mismatch"] = "one side has a confidence head, the other not"
    elif conf is not None:
        result["max_abs_confidence"] = float((conf.view(n_blocks, gamma) - ref["confidence"]).abs().max())
    result["ok"] = bool(
        not (result["missing_keys"] or result["unexpected_keys"] or result["mismatched_keys"] or nan)
        and logits.shape == ref["logits"].shape
        and result["max_abs_logits"] <= atol
        and result.get("max_abs_confidence", 0.0) <= atol
        and "confidence_mismatch" not in result
    )
    return result


def check_cases(root: Path, atol: float) -> int:
    _stub_datasets()
    import speculators  # noqa: F401  (fails early, with its own message, outside the speculators environment)

    results = [check_case(case, atol) for case in sorted(p for p in root.iterdir() if (p / "speculators").is_dir())]
    for r in results:
        conf = f"{r['max_abs_confidence']:.1e}" if "max_abs_confidence" in r else "-"
        print(
            f"{'OK  ' if r['ok'] else 'FAIL'} {r['case']:34s} {r['class_name']} missing={r['missing_keys']} "
            f"unexpected={r['unexpected_keys']} max|dlogits|={r['max_abs_logits']:.1e} "
            f"(scale {r['logits_scale']:.1f}) "
            f"max|dconf|={conf} argmax={'=' if r['same_argmax'] else '!='}"
        )
    (root / "results.json").write_text(json.dumps(results, indent=2))
    failed = [r["case"] for r in results if not r["ok"]]
    from importlib.metadata import version

    versions = ", ".join(f"{name} {version(name)}" for name in ("speculators", "transformers", "torch"))
    print(f"{len(results) - len(failed)}/{len(results)} cases match ({versions}); failed: {failed or 'none'}")
    return 1 if failed or not results else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=["all", "write", "check"], default="all")
    parser.add_argument("dir", nargs="?", help="cases folder (write/check); default: a temporary folder")
    parser.add_argument("--speculators-python", default=os.environ.get("SPECULATORS_PYTHON", DEFAULT_PYTHON))
    parser.add_argument("--atol", type=float, default=1e-5)
    args = parser.parse_args(argv)
    if args.mode == "check":
        return check_cases(Path(args.dir), args.atol)
    if args.mode == "write":
        write_cases(Path(args.dir))
        return 0
    if not Path(args.speculators_python).exists():
        print(f"No speculators environment at {args.speculators_python}; see the docstring.", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="speculators-check-") as tmp:
        root = Path(args.dir or tmp)
        names = write_cases(root)
        print(f"wrote {len(names)} cases to {root}", flush=True)
        cmd = [args.speculators_python, str(Path(__file__).resolve()), "check", str(root), "--atol", str(args.atol)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # never our package over there
        return subprocess.run(cmd, env={**env, "HF_HUB_OFFLINE": "1"}, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
