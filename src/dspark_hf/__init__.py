"""dspark-hf: DSpark speculative decoding for Hugging Face transformers.

import dspark_hf
target.generate(**inputs, assistant_model=drafter)   # batched, lossless
target.generate(**inputs, custom_generate=dspark_hf.speculative_generate, drafter=drafter)   # the same, no routing
"""

from .utils.third_party import import_torchao_quietly


import_torchao_quietly()  # first: before transformers' model classes import it with notices that say nothing here

from .decoding.scheduler import prefix_schedule
from .decoding.stats import DSparkGenerationStats
from .integrations.generation import generate, speculative_generate
from .integrations.registration import register
from .models.configuration_dspark import DSparkConfig
from .models.configuration_eagle3 import Eagle3Config
from .models.modeling_dspark import DSparkDraftModel, DSparkPreTrainedModel
from .models.modeling_eagle3 import Eagle3DraftModel
from .serving.engine import Engine, Request


register()


def load_default(**kwargs):
    """The embedded default: `(target, tokenizer, drafter)` for SmolLM2-135M-Instruct (see `dspark_hf.default`)."""
    from .default import load_default as _load_default

    return _load_default(**kwargs)


__version__ = "0.1.0"

__all__ = [
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkGenerationStats",
    "DSparkPreTrainedModel",
    "Eagle3Config",
    "Eagle3DraftModel",
    "Engine",
    "Request",
    "generate",
    "load_default",
    "prefix_schedule",
    "register",
    "speculative_generate",
]
