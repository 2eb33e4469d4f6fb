"""Registers DSpark with transformers' Auto classes, once, on `import dspark_hf`."""

from transformers import AutoConfig, AutoModel

from .configuration_dspark import DSparkConfig
from .generation import install_candidate_generator
from .modeling_dspark import DSparkDraftModel


def register() -> None:
    """AutoConfig/AutoModel entries, `auto_map` in saved checkpoints, and the generate() routing. Idempotent."""
    AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
    AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)
    # save_pretrained then copies configuration_dspark.py / modeling_dspark.py (and what they import) next to the
    # weights, so `AutoModel.from_pretrained(path, trust_remote_code=True)` works without this package.
    DSparkConfig.register_for_auto_class()
    DSparkDraftModel.register_for_auto_class("AutoModel")
    install_candidate_generator()
