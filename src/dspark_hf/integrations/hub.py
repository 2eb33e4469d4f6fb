"""Hub artifacts: a checkpoint folder with a generated model card, the hardware profile and `custom_generate/`.

`save_for_hub` writes everything a Hub repo needs; `push_to_hub` uploads that folder. The model card is generated
from measured results only (bench JSONs, the SPS profile, calibration and training records), never hand-written.
`custom_generate/` carries the DSpark generation code, so `target.generate(..., custom_generate="org/repo",
trust_remote_code=True)` works for users who do not pip install this package.
"""

import json
import os
import tempfile
from pathlib import Path

from transformers.utils import logging

from ..models.settings import AUTO_TREE_BUDGET
from ..utils.files import atomic_write_json, atomic_write_text, check_folder_free, write_folder
from .remote_code import write_flat


logger = logging.get_logger(__name__)

CALIBRATION_FILE = "calibration.json"  # written by `dspark-hf calibrate` beside the checkpoint

_CUSTOM_GENERATE_ENTRY = '''"""DSpark speculative decoding for users without the dspark-hf package:

    target.generate(**inputs, assistant_model=drafter, custom_generate="<this repo>", trust_remote_code=True)
"""

from .generation import generate


__all__ = ["generate"]
'''


def write_custom_generate(out_dir: str | os.PathLike) -> Path:
    """`custom_generate/generate.py`, the remote-code modules (`remote_code.MODULES`, flat) and requirements.txt."""
    folder = Path(out_dir) / "custom_generate"
    write_flat(folder)
    atomic_write_text(_CUSTOM_GENERATE_ENTRY, folder / "generate.py")
    atomic_write_text("torch\ntransformers>=5.24,<6\npackaging\ntqdm\n", folder / "requirements.txt")
    return folder


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _by_int(item) -> int:
    return int(item[0])


def _at(values, k):
    """values[k], or None when the list is missing or shorter."""
    return values[k] if values and k < len(values) else None


def _layer_note(config) -> str:
    """Which draft-layer layout the drafter has, and the DeepSpec / vLLM format it corresponds to."""
    if config.model_type != "dspark":
        return f"{config.model_type} (no DeepSpec equivalent)"
    if config.draft_layer == "gemma4":
        k_eq_v = ", shared K = V" if config.attention_k_eq_v else ""
        return (
            f"Gemma-4 (DeepSpec `Gemma4DSparkModel` layout, head {config.head_dim}{k_eq_v}): the layout of DeepSeek's "
            "released `deepseek-ai/dspark_gemma4_12b_block7`, whose DeepSpec checkpoint `DSparkDraftModel."
            "from_pretrained` loads (matched against DeepSpec's own code on tiny models to 3.3e-6 in float32)"
        )
    qk = "with" if config.use_qk_norm else "without"
    return f"Llama blocks {qk} QK-norm (DeepSpec `Qwen3DSparkModel` layout when with QK-norm)"


def _tree_note(budget) -> str:
    """A card's words for `tree_budget`."""
    if budget == "auto":
        return f"auto (trees of {AUTO_TREE_BUDGET} nodes where the round can price them, chains elsewhere)"
    return f"up to {budget} nodes" if budget else "none (chains)"


def model_card(
    config,
    results: dict | None = None,
    profile: dict | None = None,
    training: dict | None = None,
    calibration: dict | None = None,
) -> str:
    """Markdown model card with YAML front matter, built from measured results.

    results: {dataset name: bench JSON (see `dspark_hf.evaluation.harness.run_bench`)}; profile: an SPS profile
    (`dspark-hf profile`); training: the training config and data summary; calibration: the report of
    `dspark-hf calibrate` (`calibration.json`, see `dspark_hf.training.calibration.calibration_report`).
    """
    target = config.target_name_or_path or f"a {config.target_model_type} target"
    front = ["---", "library_name: dspark-hf", "tags:", "- speculative-decoding", "- dspark", "- drafter"]
    if config.target_name_or_path:
        front.append(f"base_model: {config.target_name_or_path}")
    front.append("---")
    lines = front + [
        f"# DSpark drafter for {target}",
        "",
        "A DSpark speculative-decoding drafter (semi-autoregressive: parallel block backbone fed with the target's",
        "hidden states, plus a sequential head). Outputs are identical to the target's own (lossless).",
        "",
        "```python",
        "import dspark_hf",
        "from transformers import AutoModelForCausalLM",
        f'target = AutoModelForCausalLM.from_pretrained("{config.target_name_or_path or "<target>"}")',
        'drafter = dspark_hf.DSparkDraftModel.from_pretrained("<this repo>")',
        "out = target.generate(**inputs, assistant_model=drafter)",
        "```",
        "",
        "## Architecture",
        "",
        f"- intended target: {target} at revision {config.target_revision or 'unknown'} "
        f"({config.target_model_type}, hidden {config.hidden_size}, {config.num_target_layers} layers, "
        f"vocab {config.vocab_size})",
        f"- draft layers: {config.num_hidden_layers}; block size γ = {config.block_size}; target layers "
        f"{config.target_layer_ids}",
        f"- draft layer: {_layer_note(config)}",
        f"- sequential head: {config.sequential_head} (rank {config.markov_rank}); confidence head: "
        f"{config.confidence_head}; verify policy: {config.verify_policy}; draft trees: "
        f"{_tree_note(getattr(config, 'tree_budget', 0))}",
        f"- STS temperatures: {[round(t, 3) for t in config.sts_temperatures]}",
        "",
    ]
    if getattr(config, "context_window", None) is not None:
        lines.insert(-1, f"- context window: {config.context_window} (each block attends to the target features of "
                     f"the {config.context_window} positions before its anchor)")  # fmt: skip
    if results:
        padded = any(r.get("speedup_vs_padded") is not None for r in results.values())
        lines += [
            "## Measured results",
            "",
            "| dataset | prompts | τ | speedup |"
            + (" vs padded plain |" if padded else "")
            + " identical | per-position acceptance |",
            "|---|---|---|---|" + ("---|" if padded else "") + "---|---|",
        ]
        for name, r in results.items():
            rates = " ".join(_fmt(x) for x in r.get("per_position_acceptance", []))
            vs_padded = f" {_fmt(r.get('speedup_vs_padded'))}x |" if padded else ""
            lines.append(
                f"| {name} | {r.get('num_prompts')} | {_fmt(r.get('acceptance_length'))} | "
                f"{_fmt(r.get('speedup'))}x |{vs_padded} {r.get('all_identical')} | {rates} |"
            )
        if padded:
            lines += [
                "",
                "speedup: over transformers' plain decoding; vs padded plain: over plain decoding whose steps run as "
                "two rows with the same few-rows products the verify passes use (`dspark_hf.kernels.verify_head`), "
                "so it counts what speculation itself buys.",
            ]
        lines.append("")
    if profile:
        lines += [
            "## Hardware",
            "",
            f"Profiled on {profile.get('device')} ({profile.get('dtype')}); target verify steps/s by verify size "
            "(`sps_profile.json`): "
            + ", ".join(f"{b}: {float(v):.1f}" for b, v in sorted((profile.get("sps") or {}).items(), key=_by_int)),
            "",
        ]
    if calibration:
        before, after = calibration.get("before") or {}, calibration.get("after") or {}
        crossed = calibration.get("cross_fitted")  # reports before 2026-12-04 have none
        cross_column = ["ECE cross-fitted"] if crossed else []
        columns = ["position", "temperature", "ECE before", "ECE after", *cross_column, "AUROC"]
        intro = f"{calibration.get('num_blocks')} held-out blocks; ECE of the cumulative survival per position."
        if crossed:
            intro += (
                " The cross-fitted column scores each block under temperatures fitted on the other blocks"
                f" ({calibration.get('folds')} folds): whether STS helps beyond the blocks it was fitted on."
            )
        lines += [
            "## Calibration (STS)",
            "",
            intro,
            "",
            "| " + " | ".join(columns) + " |",
            "|---" * len(columns) + "|",
        ]
        for k, temp in enumerate(calibration.get("temperatures") or []):
            row = [f"{k + 1}", f"{temp:.3f}", _fmt(_at(before.get("ece"), k), 4), _fmt(_at(after.get("ece"), k), 4)]
            if crossed:
                row.append(_fmt(_at(crossed.get("ece"), k), 4))
            lines.append("| " + " | ".join([*row, _fmt(_at(after.get("auroc"), k), 3)]) + " |")
        lines.append("")
    if training:
        lines += ["## Training", "", "```json", json.dumps(training, indent=2, default=str), "```", ""]
    if not results:
        lines += ["## Measured results", "", "None recorded yet: run `dspark-hf bench` and regenerate this card.", ""]
    return "\n".join(lines)


def _beside_checkpoint(drafter, name: str) -> Path | None:
    """`name` in the drafter's local checkpoint folder (e.g. `sps_profile.json`), if it exists."""
    folder = getattr(drafter, "name_or_path", None)
    path = Path(folder) / name if folder and os.path.isdir(folder) else None
    return path if path is not None and path.is_file() else None


def _strip_remote_code(folder: Path) -> None:
    """Remove the modeling files `save_pretrained` copies for `trust_remote_code` and the `auto_map` naming them."""
    for path in folder.glob("*.py"):
        path.unlink()
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("auto_map", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_for_hub(
    drafter,
    out_dir,
    results=None,
    profile=None,
    training=None,
    calibration=None,
    with_code: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a complete Hub folder atomically: weights, code (auto_map), README.md, profile, custom_generate/.

    `profile`, `calibration` and `training` default to what `dspark-hf profile`, `dspark-hf calibrate` and
    `dspark-hf train` stored beside the drafter's local checkpoint (`sps_profile.json`, `calibration.json`,
    `trainer_state.json`). `with_code=False` leaves out the remote code (modeling files, `auto_map`,
    `custom_generate/`): for a checkpoint that is only ever loaded with this package installed, such as the
    embedded default inside it.

    A non-empty `out_dir` is refused (`FileExistsError`, before anything is written) unless `overwrite`; the folder is
    filled beside `out_dir` and renamed into place once complete, so an overwritten folder keeps its old content
    until then (`utils.files.write_folder`).
    """
    from ..decoding.profiling import PROFILE_FILE, load_profile

    check_folder_free(out_dir, overwrite)  # before reading or writing anything
    if profile is None and (path := _beside_checkpoint(drafter, PROFILE_FILE)) is not None:
        profile = load_profile(path)
    if calibration is None and (path := _beside_checkpoint(drafter, CALIBRATION_FILE)) is not None:
        calibration = json.loads(path.read_text(encoding="utf-8"))
    if training is None and (path := _beside_checkpoint(drafter, "trainer_state.json")) is not None:
        training = json.loads(path.read_text(encoding="utf-8"))  # step, held-out τ, the training settings

    def write(tmp: Path) -> None:
        drafter.save_pretrained(tmp)
        if not with_code:
            _strip_remote_code(tmp)
        if profile is not None:
            atomic_write_json(profile, tmp / PROFILE_FILE)
        if calibration is not None:
            atomic_write_json(calibration, tmp / CALIBRATION_FILE)
        if with_code:
            write_custom_generate(tmp)
        (tmp / "README.md").write_text(model_card(drafter.config, results, profile, training, calibration))

    return write_folder(out_dir, write, overwrite=overwrite)


def push_to_hub(
    drafter,
    repo_id: str,
    results=None,
    profile=None,
    training=None,
    calibration=None,
    private=False,
    token=None,
    api=None,
    commit_message="Upload DSpark drafter",
) -> str:
    """Upload the `save_for_hub` folder to `repo_id`; returns the commit URL. `api` defaults to `HfApi(token)`."""
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(f"`repo_id` must look like 'org/name', got {repo_id!r}.")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_for_hub(drafter, Path(tmp) / "repo", results, profile, training, calibration)
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
