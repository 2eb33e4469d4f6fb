"""Registers DSpark with transformers' Auto classes, once, on `import dspark_hf`.

DeepSpec checkpoints (DeepSeek's released `deepseek-ai/dspark_*_block7`) carry the *target's* `model_type` (e.g.
`"qwen3"`) and no `auto_map`, so no config registration can claim them: stock `AutoModel.from_pretrained` would build
a plain `Qwen3Model` from the draft layers and drop the DSpark weights with a warning. `register()` therefore wraps
two public entry points, changing nothing for any other checkpoint:

* `AutoModel.from_pretrained(deepspec_folder_or_repo)` returns a `DSparkDraftModel` (converted on the fly, as
  `DSparkDraftModel.from_pretrained` does); this is the Auto class our own DSpark checkpoints load with too.
* `AutoModelForCausalLM.from_pretrained(...)` (and so `pipeline("text-generation", model=...)`) raises `ValueError`:
  a drafter has no LM head of its own and cannot generate alone.

Other Auto classes (sequence classification, ...) are not wrapped. Without `import dspark_hf` the stock behaviour
applies; load DeepSpec checkpoints with this package imported.
"""

import functools
from pathlib import Path

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from ..models.configuration_dspark import DSparkConfig
from ..models.configuration_eagle3 import Eagle3Config
from ..models.modeling_dspark import DrafterMixin, DSparkDraftModel
from ..models.modeling_eagle3 import Eagle3DraftModel
from .generation import install
from .remote_code import write_remote_code


def _load_deepspec_as_drafter(path, folder, model_args, kwargs):
    from .deepspec import load_deepspec_checkpoint

    if model_args:
        raise TypeError(f"A DeepSpec checkpoint takes no positional model arguments, got {model_args}.")
    kwargs.pop("trust_remote_code", None)  # a DeepSpec folder holds no code: nothing to trust
    kwargs.pop("config", None)  # None here (an explicit config skips the DeepSpec routing)
    return load_deepspec_checkpoint(folder, **kwargs)


def _refuse_deepspec_as_causal_lm(path, folder, model_args, kwargs):
    raise ValueError(
        f"{path} is a DeepSpec DSpark drafter (architectures Qwen3DSparkModel/Gemma4DSparkModel), not a causal "
        "language model: it has no LM head of its own and drafts only from a target's hidden states. Load it with "
        "`AutoModel.from_pretrained(...)` or `dspark_hf.DSparkDraftModel.from_pretrained(...)` and pass it as "
        "`target.generate(..., assistant_model=drafter)`, with the target loaded by AutoModelForCausalLM."
    )


def _read_deepspec(path, model_args, kwargs):
    """`DSparkDraftModel.from_pretrained`'s reader of DeepSpec checkpoints (their config.json is the target's)."""
    from .deepspec import resolve_deepspec_folder

    folder = resolve_deepspec_folder(path, kwargs)
    return None if folder is None else _load_deepspec_as_drafter(path, folder, model_args, kwargs)


def read_drafter_config(path, subfolder: str = ""):
    """The config of a local drafter checkpoint, read without its weights: ours (DSpark, EAGLE-3) or DeepSpec's,
    converted. A missing folder, a corrupt or mistyped config.json, a DeepSpec config lacking a field, or a folder
    that is no drafter's (a target's) is an OSError / ValueError naming it. None for a name only the Hub can
    resolve."""
    from ..utils.checkpoints import check_local_folder, check_model_type, read_config_file
    from .deepspec import dspark_config_from_deepspec, is_deepspec_config

    check_local_folder(path, subfolder)
    folder = Path(path).expanduser() / subfolder
    if not folder.is_dir():
        return None
    config = read_config_file(folder / "config.json")
    if is_deepspec_config(config):
        return dspark_config_from_deepspec(config)
    for config_class in (DSparkConfig, Eagle3Config):
        if config.get("model_type") == config_class.model_type:
            return config_class.from_dict(config)
    check_model_type(folder, DSparkConfig.model_type)  # raises, naming what the folder holds instead
    return None


def _route_deepspec(auto_class, handler) -> None:
    """Wrap `auto_class.from_pretrained` so that DeepSpec checkpoints go to `handler`. Idempotent."""
    original = auto_class.from_pretrained.__func__
    if getattr(original, "_dspark_deepspec", False):
        return

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        if kwargs.get("config") is None:  # an explicit config means the caller chose the model class
            from .deepspec import resolve_deepspec_folder

            folder = resolve_deepspec_folder(pretrained_model_name_or_path, kwargs)
            if folder is not None:
                return handler(pretrained_model_name_or_path, folder, model_args, kwargs)
        return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    from_pretrained._dspark_deepspec = True
    auto_class.from_pretrained = classmethod(from_pretrained)


def register() -> None:
    """AutoConfig/AutoModel entries, `auto_map` in saved checkpoints, DeepSpec routing and the generate() routing
    (`generation.install`, a wrapper of the public `GenerationMixin.generate`).

    Idempotent.
    """
    for config_class, model_class in ((DSparkConfig, DSparkDraftModel), (Eagle3Config, Eagle3DraftModel)):
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)
    # save_pretrained then writes the remote code (flat) and `auto_map`, so that
    # `AutoModel.from_pretrained(path, trust_remote_code=True)` works without this package
    if write_remote_code not in DrafterMixin.checkpoint_writers:
        DrafterMixin.checkpoint_writers.append(write_remote_code)
    if _read_deepspec not in DSparkDraftModel.checkpoint_readers:
        DSparkDraftModel.checkpoint_readers.append(_read_deepspec)
    _route_deepspec(AutoModel, _load_deepspec_as_drafter)
    _route_deepspec(AutoModelForCausalLM, _refuse_deepspec_as_causal_lm)
    install()
