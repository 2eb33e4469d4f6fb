"""Every transformers and torch name this package relies on beyond the documented API, in two tables.

The decoding loop runs on public API: `generate(custom_generate=<callable>)` (the callable receives the prepared
logits processors, stopping criteria and generation config), `DynamicCache`, `AttentionInterface`. What remains
below is either private or behaviour that the public API does not promise. Each entry: the name, where it is used,
why, and the transformers versions it was tested with. Remove an entry when the need goes away.

The table is `PRIVATE_API` below; the transformers version is checked on import (`check_transformers_version`).
torch's private names are in `PRIVATE_TORCH` (each with the modules that may use it, which `tests/test_layout.py`
holds the source to).
"""

from typing import NamedTuple

import transformers
from packaging import version
from transformers.utils import logging


logger = logging.get_logger(__name__)


class PrivateName(NamedTuple):
    name: str
    used_in: str
    why: str
    tested: tuple[str, ...]


PRIVATE_API = (
    PrivateName(
        "PreTrainedConfig._attn_implementation (read; set for one verify pass, then restored)",
        "verify_attention.routed",
        "route an 'sdpa' target's attention through SDPA's own grouped-query attention during a verify pass",
        ("5.24", "5.25"),
    ),
    PrivateName(
        "DynamicCache(ddp_cache_data=...); iterating a DynamicCache as (keys, values, ...)",
        "ragged_cache.RaggedCache",
        "rebuild a cache from gathered key/value tensors (admission, compaction)",
        ("5.24", "5.25"),
    ),
    PrivateName(
        "DynamicLayer subclassed (update writes into a buffer with spare slots; keys/values stay views of it, which "
        "crop and batch_select_indices slice or replace); Cache.layer_class_to_replicate set after construction",
        "ragged_cache.AppendCache / AppendLayer",
        "no copy of the whole KV cache per forward (DynamicLayer.update concatenates), so a round costs the same "
        "bookkeeping at 8k positions as at 256",
        ("5.25",),
    ),
    PrivateName(
        "output_hidden_states given as a list of indices keeps only those hidden states, the others None "
        "(utils.output_capturing.selected_hidden_states, for models with _can_record_outputs)",
        "core.SpeculativeDecoder._hidden_states_wanted, compat.selects_hidden_states",
        "the prefill and verify keep only the drafter's tapped layers instead of every layer's hidden states",
        ("5.25",),
    ),
    PrivateName(
        "custom_generate callables receive only the kwargs their signature names beyond GenerationMixin._sample's; "
        "assistant_model, streamer and tokenizer are dropped",
        "generation.install / generation.generate",
        "the routing passes the drafter, streamer and tokenizer on under names the hook keeps",
        ("5.24", "5.25"),
    ),
    PrivateName(
        "a 4-D float `attention_mask` (B, 1, q, kv) passes through masking_utils unchanged to every layer "
        "(`_preprocess_mask_arguments` returns a 4-D mask as given) and is added to the attention scores",
        "core.SpeculativeDecoder._verify, trees.tree_attention_mask",
        "a draft tree's verify: each slot sees the cache and its own ancestors (sliding-window targets refused)",
        ("5.25",),
    ),
    PrivateName(
        "stop_strings need `tokenizer` among generate()'s mode kwargs, which a custom_generate call drops",
        "generation._routed_kwargs",
        "the routing builds the StopStringCriteria itself and passes it as public `stopping_criteria`",
        ("5.24", "5.25"),
    ),
    PrivateName(
        "RepetitionPenaltyLogitsProcessor.prompt_ignore_length (a (B,) tensor of padding lengths), "
        "EncoderRepetitionPenaltyLogitsProcessor.encoder_input_ids, EncoderNoRepeatNGramLogitsProcessor."
        "{generated_ngrams, batch_size}, PrefixConstrainedLogitsProcessor._prefix_allowed_tokens_fn",
        "generation._row_processors",
        "processors built with one entry per batch row get a copy holding one row's entry, since each row's logits "
        "are processed on their own (a batch of one)",
        ("5.25",),
    ),
    PrivateName(
        "the op sequence of LlamaDecoderLayer / Qwen2, Qwen3, MistralDecoderLayer and their attention's forward "
        "(mirrored), the modeling module's apply_rotary_pos_emb and eager_attention_forward, "
        "masking_utils.create_causal_mask's positional order (config, inputs_embeds, attention_mask, cache, "
        "position_ids), ALL_ATTENTION_FUNCTIONS.get_interface; output-capturing hooks are closures of "
        "transformers.utils.output_capturing",
        "kernels.lean_forward, compat.only_capturing_hooks",
        "a round's target forward without the per-layer wrappers (~2 ms of a 36–40 ms forward of SmolLM2, 2 cores), "
        "bit-identical logits checked by tests/test_lean_forward.py on this version; the RMSNorm classes' own "
        "forward (`<Family>RMSNorm.forward`, inlined where it is the class's own)",
        ("5.25",),
    ),
    PrivateName(
        "CompileConfig._compile_all_devices (set after construction): generate() compiles a static cache's decoding "
        "step on the CPU too",
        "compat.compile_everywhere, evaluation.harness (the compiled plain baseline)",
        "`dspark-hf bench --compiled-baseline` times transformers' compiled static-cache plain decoding on a CPU, "
        "which generate() otherwise compiles only on accelerators",
        ("5.25",),
    ),
)


class PrivateTorchName(NamedTuple):
    name: str  # as written in the code, e.g. "torch.ops.mkldnn._linear_pointwise"
    used_in: tuple[str, ...]  # the modules below dspark_hf that may use it
    why: str
    tested: tuple[str, ...]  # torch versions


PRIVATE_TORCH = (
    PrivateTorchName(
        "torch.ops.mkldnn._reorder_linear_weight",
        ("kernels.packed_linear", "kernels.verify_linears"),
        "pack a linear's weight once into oneDNN's blocked layout (what inductor does for CPU linears), so a draft "
        "or verify product does not repack it on every call",
        ("2.13",),
    ),
    PrivateTorchName(
        "torch.ops.mkldnn._linear_pointwise",
        ("kernels.packed_linear", "kernels.verify_linears"),
        "multiply by a packed weight",
        ("2.13",),
    ),
    PrivateTorchName(
        "torch.ops.mkldnn._is_mkldnn_bf16_supported",
        ("kernels.packed_linear",),
        "whether bf16 products are native on this CPU (a bf16 drafter is faster there, emulated elsewhere)",
        ("2.13",),
    ),
    PrivateTorchName(
        "_packed_params (a dynamically quantized Linear's holder and the ScriptObject inside it)",
        ("utils.compat",),
        "fingerprint such a linear by the packed object itself (`dynamic_packed_params`): unpacking its weight to "
        "read it costs ~0.4 s a call for SmolLM2's LM head",
        ("2.13",),
    ),
    PrivateTorchName(
        "torch.nn.modules.module._global_forward_hooks / _global_forward_pre_hooks",
        ("utils.compat",),
        "a lean forward, which skips the modules' __call__, runs only where no global hook would be skipped",
        ("2.13",),
    ),
)


def dynamic_packed_params(module) -> tuple[object, object] | None:
    """(the packed weight-and-bias object, its dtype) of a PyTorch dynamically quantized linear; None for any other
    module (see `PRIVATE_TORCH`)."""
    import torch

    holder = getattr(module, "_packed_params", None)
    packed = getattr(holder, "_packed_params", None)
    return (packed, getattr(holder, "dtype", None)) if isinstance(packed, torch.ScriptObject) else None


def compile_everywhere(**kwargs):
    """transformers' `CompileConfig(**kwargs)`, set to compile on any device (see `PRIVATE_API`)."""
    from transformers import CompileConfig

    config = CompileConfig(**kwargs)
    config._compile_all_devices = True
    return config


def selects_hidden_states(model) -> bool:
    """Whether `model(..., output_hidden_states=[i, j, ...])` keeps only those layers' hidden states (the others come
    back as None): models whose base model records its outputs by transformers' hooks (`_can_record_outputs`), on
    a release whose recorder takes indices. Elsewhere a list would still ask for every layer (it is truthy)."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    if not hasattr(output_capturing, "selected_hidden_states"):
        return False
    base = getattr(model, "base_model", model)
    return "hidden_states" in (getattr(base, "_can_record_outputs", None) or {})


def only_capturing_hooks(modules) -> bool:
    """Whether none of `modules` has a hook or a replaced `forward` (accelerate's offloading, `torch.compile`) beyond
    the output-capturing hooks transformers installs itself, and no global module hook is set: code that runs the
    modules' computation without calling them (`kernels.lean_forward`) would skip any other."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    for m in modules:
        if "forward" in vars(m) or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return False
        if any(getattr(h, "__module__", None) != CAPTURING_HOOKS for h in m._forward_hooks.values()):
            return False
    return True


CAPTURING_HOOKS = "transformers.utils.output_capturing"  # where transformers' output-capturing hooks are defined


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


__all__ = [
    "MIN_VERSION",
    "PRIVATE_API",
    "PRIVATE_TORCH",
    "TESTED",
    "PrivateName",
    "PrivateTorchName",
    "check_transformers_version",
    "selects_hidden_states",
]
