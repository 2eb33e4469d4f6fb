"""The harness's inputs from the command line: prompt sets (`--prompts`, `--datasets`) and assistants (`--drafter
[LABEL=]PATH`, any folder or Hub id `load_assistant` reads)."""

from pathlib import Path

import torch

from ..kernels.packed_linear import inference_dtype


def parse_datasets(prompts=(), datasets: str | None = None) -> dict[str, Path]:
    """{name: JSONL path} from `--prompts FILE` (named by the file stem) and `--datasets name=path,...`."""
    named = {}
    for path in prompts or ():
        named[Path(path).stem] = Path(path)
    for item in (datasets or "").split(","):
        if not item.strip():
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--datasets takes name=path.jsonl pairs separated by commas, got {item!r}.")
        named[name.strip()] = Path(path.strip())
    for name, path in named.items():
        if not path.is_file():
            raise ValueError(f"Dataset {name!r}: no file at {path}.")
    return named


def parse_drafters(specs) -> dict[str, str]:
    """{label: path} from `--drafter [LABEL=]PATH` values; the label defaults to the folder's name."""
    named = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = Path(spec.rstrip("/")).name or spec, spec
        if label in named:
            raise ValueError(f"Two drafters labelled {label!r}: name them with --drafter LABEL=PATH.")
        named[label] = path
    return named


def load_assistant(path: str, dtype: torch.dtype | None = None):
    """A drafter or assistant model from a folder or Hub id: DSpark (ours or DeepSpec's), else any Auto model.

    `dtype` None: a DSpark drafter in `packed_linear.inference_dtype()` (bf16 on a CPU that computes it natively),
    any other assistant in float32."""
    from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ..integrations.deepspec import is_deepspec_config
    from ..models.modeling_dspark import DSparkDraftModel

    config = PretrainedConfig.get_config_dict(path)[0]
    if config.get("model_type") == "dspark" or is_deepspec_config(config):
        return DSparkDraftModel.from_pretrained(path, dtype=dtype or inference_dtype()).eval()
    auto = AutoModelForCausalLM if config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel
    return auto.from_pretrained(path, dtype=dtype or torch.float32).eval()


__all__ = ["load_assistant", "parse_datasets", "parse_drafters"]
