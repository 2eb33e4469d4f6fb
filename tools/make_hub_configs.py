"""Regenerate `hub_configs/*.json`: one DSpark drafter config per supported target.

    python tools/make_hub_configs.py            # rewrite hub_configs/
    python tools/make_hub_configs.py --check    # exit 1 if a file differs from what this script builds

Every target below is the relevant part of its Hugging Face `config.json`, copied verbatim (legacy keys such as
`rope_theta`/`rope_scaling` included; transformers turns them into `rope_parameters`), with a comment naming where
the numbers were read. The transformers config class is built from those values and passed to
`DSparkConfig.for_target`, so the drafter's fingerprint and block shapes come from the same code path as
`DSparkConfig.for_target(AutoConfig.from_pretrained(repo))` would take. No download happens here.

Drafter choices:
- Qwen3-4B/8B/14B and Gemma-4-12B-it match DeepSeek's released `deepseek-ai/dspark_*_block7` drafters
  (DeepSpec `config/dspark/dspark_*.py` at commit afdfa7c): block 7, 5 draft layers, vanilla Markov head of rank 256,
  confidence head fed the Markov embedding, DeepSeek's target layers and mask token; Gemma-4 with DeepSpec's Gemma-4
  draft layer (`draft_layer="gemma4"`).
- Llama-3.1-8B-Instruct and the SmolLM2 family: 2 draft layers (paper Fig. 3: the biggest gain is 1 -> 2 layers and
  a 2-layer DSpark already beats the 5-layer DFlash), block 7, layers from `default_target_layer_ids`, a learned mask
  embedding. Markov rank 64 for SmolLM2 (the CPU trials' rank); 256 for Llama-3.1-8B, the rank DeepSeek uses for
  every target of that size (4B-14B).
"""

import argparse
import json
import sys
from pathlib import Path

from transformers import Gemma4UnifiedConfig, LlamaConfig, Qwen3Config
from transformers.utils import logging

from dspark_hf import DSparkConfig
from dspark_hf.models.configuration_dspark import default_target_layer_ids


HUB_CONFIGS = Path(__file__).resolve().parent.parent / "hub_configs"

# PreTrainedConfig keys that say nothing about the drafter (and are not DSparkConfig fields).
GENERIC_KEYS = (
    "transformers_version",
    "architectures",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "dtype",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "_name_or_path",
)

# DeepSeek's released drafters (DeepSpec config/dspark/dspark_{qwen3_4b,qwen3_8b,qwen3_14b,gemma4_12b}.py).
DEEPSEEK = dict(
    num_hidden_layers=5, markov_rank=256, sequential_head="markov", confidence_head=True, confidence_with_markov=True
)

QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

TARGETS = {
    # Qwen/Qwen3-4B config.json, as vendored verbatim in citsjtu2020/LLM-Prof `sglang/Model_Config.md` and in
    # musubi-tuner's `zimage` Qwen3 loader (QWEN3_4B_CONFIG_JSON); both agree on every field used here.
    # No pad_token_id in the Hub file.
    "qwen3-4b": dict(
        hub_id="Qwen/Qwen3-4B",
        config_class=Qwen3Config,
        config={
            **QWEN3_COMMON,
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "max_window_layers": 36,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "tie_word_embeddings": True,
        },
        drafter=dict(DEEPSEEK, target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669),
    ),
    # Qwen/Qwen3-8B config.json, same two vendored copies as Qwen3-4B (QWEN3_8B_CONFIG_JSON).
    "qwen3-8b": dict(
        hub_id="Qwen/Qwen3-8B",
        config_class=Qwen3Config,
        config={
            **QWEN3_COMMON,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "max_window_layers": 36,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "tie_word_embeddings": False,
        },
        drafter=dict(DEEPSEEK, target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669),
    ),
    # Qwen/Qwen3-14B config.json, vendored verbatim in citsjtu2020/LLM-Prof `sglang/Model_Config.md`.
    "qwen3-14b": dict(
        hub_id="Qwen/Qwen3-14B",
        config_class=Qwen3Config,
        config={
            **QWEN3_COMMON,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "max_window_layers": 40,
            "num_attention_heads": 40,
            "num_hidden_layers": 40,
            "tie_word_embeddings": False,
        },
        drafter=dict(DEEPSEEK, target_layer_ids=[1, 10, 19, 28, 37], mask_token_id=151669),
    ),
    # google/gemma-4-12B-it `text_config` (model_type gemma4_unified). Read from the verbatim config.json of
    # DeepSeek's released drafter deepseek-ai/dspark_gemma4_12b_block7 @ 2fa72e76 (DeepSpec deep-copies the target's
    # text_config into it: num_target_layers 48, bos 2, eos 1, pad 0, softcap 30.0, ...), as quoted in a Modular MAX
    # test, and cross-checked against google/gemma-4-12B @ 56820d7d config.json (fetched from the Hub in a public
    # agent log) and an MLX Swift test fixture `gemma4Unified12BConfigDecode`; all three agree.
    "gemma-4-12b": dict(
        hub_id="google/gemma-4-12B-it",
        config_class=Gemma4UnifiedConfig,
        config={
            "model_type": "gemma4_unified",
            "tie_word_embeddings": True,
            "text_config": {
                "attention_bias": False,
                "attention_dropout": 0.0,
                "attention_k_eq_v": True,
                "bos_token_id": 2,
                "enable_moe_block": False,
                "eos_token_id": 1,
                "final_logit_softcapping": 30.0,
                "global_head_dim": 512,
                "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh",
                "hidden_size": 3840,
                "hidden_size_per_layer_input": 0,
                "initializer_range": 0.02,
                "intermediate_size": 15360,
                "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 8,
                "max_position_embeddings": 262144,
                "model_type": "gemma4_unified_text",
                "moe_intermediate_size": None,
                "num_attention_heads": 16,
                "num_experts": None,
                "num_global_key_value_heads": 1,
                "num_hidden_layers": 48,
                "num_key_value_heads": 8,
                "num_kv_shared_layers": 0,
                "pad_token_id": 0,
                "rms_norm_eps": 1e-06,
                "rope_parameters": {
                    "full_attention": {
                        "partial_rotary_factor": 0.25,
                        "rope_theta": 1000000.0,
                        "rope_type": "proportional",
                    },
                    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                },
                "sliding_window": 1024,
                "tie_word_embeddings": True,
                "top_k_experts": None,
                "use_bidirectional_attention": "vision",
                "use_cache": True,
                "use_double_wide_mlp": False,
                "vocab_size": 262144,
                "vocab_size_per_layer_input": 262144,
            },
        },
        # for_target gives Gemma-4 targets DeepSpec's Gemma-4 draft layer (`draft_layer="gemma4"`, the released
        # Gemma4DSparkModel layout: global head 512, one shared K = V head); QK-norm is part of that layer.
        drafter=dict(DEEPSEEK, target_layer_ids=[5, 17, 29, 41, 46], mask_token_id=4, use_qk_norm=True),
    ),
    # meta-llama/Llama-3.1-8B-Instruct config.json, vendored verbatim in a model-dump markdown
    # ("# meta-llama/Llama-3.1-8B-Instruct ... ## config.json"); the same numbers appear in a Go test fixture
    # "TestLlama31_8BInstructConfigDerivesProductionAxes". No pad_token_id in the Hub file.
    "llama-3.1-8b-instruct": dict(
        hub_id="meta-llama/Llama-3.1-8B-Instruct",
        config_class=LlamaConfig,
        config={
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 131072,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "vocab_size": 128256,
        },
        drafter=dict(num_hidden_layers=2, markov_rank=256, target_layer_ids=default_target_layer_ids(32)),
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct: shapes as in the base SmolLM2-135M config.json (vendored in several
    # repos: 576/1536/30 layers/9 heads/3 kv, rope_theta 100000, max 8192) and in the Instruct checkpoint itself
    # (docs/transformers-integration.md §10: 30 layers, hidden 576, vocab 49152, bos 1, eos 2, pad 2).
    "smollm2-135m-instruct": dict(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        config_class=LlamaConfig,
        config={
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 576,
            "initializer_range": 0.041666666666666664,
            "intermediate_size": 1536,
            "max_position_embeddings": 8192,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 9,
            "num_hidden_layers": 30,
            "num_key_value_heads": 3,
            "pad_token_id": 2,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 100000,
            "tie_word_embeddings": True,
            "vocab_size": 49152,
        },
        drafter=dict(num_hidden_layers=2, markov_rank=64, target_layer_ids=default_target_layer_ids(30)),
    ),
    # HuggingFaceTB/SmolLM2-360M-Instruct config.json: every value below (hidden 960, intermediate 2560, 32 layers,
    # 15 heads, 5 kv heads, head_dim 64, rope_theta 100000, rope_scaling null, max 8192, eps 1e-5, vocab 49152,
    # tied, bos 1 / eos 2 / pad 2, initializer 0.02) equals the verbatim copy of that file in the Hub mirror
    # huggingface.co/eduardoworrel/SmolLM2-360M-Instruct/blob/main/config.json (`_name_or_path`
    # "HuggingFaceTB/SmolLM2-360M-Instruct", transformers 4.46.1, the `transformers.js_config` HuggingFaceTB's own
    # repos carry), read through the documentation search. Cross-checks: the base model's config.json as mirrored
    # in unsloth/SmolLM2-360M has the same shapes and rope_theta; and these shapes give 361,821,120 parameters
    # (47,185,920 embedding), the count a public transformers load log prints for HuggingFaceTB/SmolLM2-360M.
    "smollm2-360m-instruct": dict(
        hub_id="HuggingFaceTB/SmolLM2-360M-Instruct",
        config_class=LlamaConfig,
        config={
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 960,
            "initializer_range": 0.02,
            "intermediate_size": 2560,
            "max_position_embeddings": 8192,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 15,
            "num_hidden_layers": 32,
            "num_key_value_heads": 5,
            "pad_token_id": 2,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 100000,
            "tie_word_embeddings": True,
            "vocab_size": 49152,
        },
        drafter=dict(num_hidden_layers=2, markov_rank=64, target_layer_ids=default_target_layer_ids(32)),
    ),
    # HuggingFaceTB/SmolLM2-1.7B-Instruct config.json, vendored verbatim in a model-dump markdown
    # ("# HuggingFaceTB/SmolLM2-1.7B-Instruct ... ## config.json") and as "SmolLM2-1.7B-Instruct config.json,
    # revision 31b70e2e" in a Rust test; both agree (note rope_theta 130000 and 32 kv heads).
    "smollm2-1.7b-instruct": dict(
        hub_id="HuggingFaceTB/SmolLM2-1.7B-Instruct",
        config_class=LlamaConfig,
        config={
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 8192,
            "max_position_embeddings": 8192,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 24,
            "num_key_value_heads": 32,
            "pad_token_id": 2,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 130000,
            "tie_word_embeddings": True,
            "vocab_size": 49152,
        },
        drafter=dict(num_hidden_layers=2, markov_rank=64, target_layer_ids=default_target_layer_ids(24)),
    ),
}


def target_config(name: str):
    """The transformers config of target `name`, built from the recorded Hub values."""
    spec = TARGETS[name]
    values = {k: v for k, v in spec["config"].items() if k != "model_type"}
    config = spec["config_class"](**values)
    text = config.get_text_config(decoder=True)
    if getattr(text, "is_heterogeneous", False):
        # Gemma 4: head_dim / num_key_value_heads differ between sliding and full layers; read the global
        # (config.json top-level) values, as the fingerprint records them.
        text.allow_global_per_layer_attribute_access = True
    return config


def build(name: str) -> dict:
    """The hub_configs JSON content (a dict) for target `name`."""
    spec = TARGETS[name]
    drafter = DSparkConfig.for_target(
        target_config(name), block_size=7, target_name_or_path=spec["hub_id"], **spec["drafter"]
    )
    return {k: v for k, v in drafter.to_dict().items() if k not in GENERIC_KEYS}


def render(name: str) -> str:
    return json.dumps(build(name), indent=2) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare, exit 1 on a difference")
    parser.add_argument("--out", type=Path, default=HUB_CONFIGS)
    args = parser.parse_args()
    logging.set_verbosity_error()
    stale = []
    for name in TARGETS:
        path = args.out / f"{name}.json"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(stale)} (run python tools/make_hub_configs.py)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
