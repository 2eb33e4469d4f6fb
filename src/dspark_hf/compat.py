"""Every transformers name this package relies on beyond the documented API, in one table, checked on import.

The decoding loop runs on public API: `generate(custom_generate=<callable>)` (the callable receives the prepared
logits processors, stopping criteria and generation config), `DynamicCache`, `AttentionInterface`. What remains
below is either private or behaviour that the public API does not promise. Each entry: the name, where it is used,
why, and the transformers versions it was tested with. Remove an entry when the need goes away.

| name | used in | why | tested |
|---|---|---|---|
| `PreTrainedConfig._attn_implementation` (read, and set for one verify pass) | `verify_attention.routed` | route an "sdpa" target's attention through SDPA's own GQA for a verify pass, restored after it | 5.24, 5.25 |
| `DynamicCache(ddp_cache_data=...)`, iterating a `DynamicCache` as (keys, values, ...) | `ragged_cache` | rebuild a cache from gathered key/value tensors (compaction, admission) | 5.24, 5.25 |
| `custom_generate` callables get only the keyword arguments named in their signature that `GenerationMixin._sample` lacks; `assistant_model`, `streamer` and `tokenizer` are dropped | `generation` | the routing passes the drafter, streamer and tokenizer under its own names | 5.24, 5.25 |
| `GenerationConfig.stop_strings` needs `tokenizer` in `generate()`'s mode kwargs | `generation` | the routing builds the stop-string criterion itself and hands it over as a public `stopping_criteria` | 5.24, 5.25 |
"""

import transformers
from packaging import version
from transformers.utils import logging


logger = logging.get_logger(__name__)

# the transformers releases this package was tested with: the public hook exists from 5.24 on (see README)
TESTED = ("5.24", "5.25")
MIN_VERSION, MAX_VERSION = "5.24.0", "6.0.0"


def check_transformers_version() -> None:
    """Refuse a transformers release without the public hook; warn once on one newer than those tested."""
    found = version.parse(transformers.__version__)
    if found < version.parse(MIN_VERSION):
        raise ImportError(
            f"dspark-hf needs transformers>={MIN_VERSION} (generate()'s `custom_generate` callables); found "
            f'{transformers.__version__}. Upgrade: pip install "transformers>={MIN_VERSION},<{MAX_VERSION}".'
        )
    if f"{found.major}.{found.minor}" not in TESTED:
        logger.warning_once(
            f"dspark-hf was tested with transformers {', '.join(TESTED)}; found {transformers.__version__}. "
            "Lossless decoding is checked by the test suite (`make test`): run it once on this version, and report "
            "a failure with your transformers version."
        )


__all__ = ["MIN_VERSION", "TESTED", "check_transformers_version"]
