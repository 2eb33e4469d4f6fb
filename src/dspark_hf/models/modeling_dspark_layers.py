"""The DSpark drafter's Llama-style blocks: attention with the target's features injected as extra keys/values.

Written modular-style on transformers' Llama blocks; `modeling_dspark.py` builds the drafter from them (or from the
Gemma-4 draft layer, `modeling_dspark_gemma4.py`, which reuses the attention here).
"""

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .configuration_dspark import DSparkConfig


class DSparkRMSNorm(LlamaRMSNorm):
    pass


class DSparkMLP(LlamaMLP):
    pass


class DSparkRotaryEmbedding(LlamaRotaryEmbedding):
    pass


def apply_rotary_pos_emb(q, k, cos, sin):
    """RoPE where keys span context + block but queries only the block: queries take the last `q_len` positions.

    q (B, H, Q, hd), k (B, Hkv, C + Q, hd), cos/sin (B, C + Q, hd).
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_len = q.shape[-2]
    q_embed = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
    k_embed = k * cos + rotate_half(k) * sin
    return q_embed, k_embed


def additive_attention_mask(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Eager attention adds the mask to the scores: turn "visible" booleans into 0 / most-negative floats (a float
    mask passes through)."""
    if attention_mask is None or attention_mask.dtype != torch.bool:
        return attention_mask
    return torch.zeros_like(attention_mask, dtype=dtype).masked_fill(~attention_mask, torch.finfo(dtype).min)


class DSparkAttention(LlamaAttention):
    """Llama attention whose keys/values are `[W_k H_ctx ; W_k H_block]` (KV injection)."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False  # diff with Llama: the block attends bidirectionally (and to all context)
        if config.use_qk_norm:  # diff with Llama: optional Qwen3/Gemma-style per-head QK-norm
            self.q_norm = DSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = DSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_qkv(self, hidden_states: torch.Tensor, context_hidden_states: torch.Tensor | None):
        """Queries of the block (B, H, Q, hd); keys and values (B, Hkv, C + Q, hd) of context + block, normed but
        not rotated."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        # diff with Llama: keys/values also cover the fused target context, prepended along the sequence axis
        kv_input = (
            hidden_states if context_hidden_states is None else torch.cat([context_hidden_states, hidden_states], 1)
        )
        kv_shape = (*kv_input.shape[:-1], -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, Q, hd)
        key_states = self.k_proj(kv_input).view(kv_shape).transpose(1, 2)  # (B, Hkv, C + Q, hd)
        value_states = self.v_proj(kv_input).view(kv_shape).transpose(1, 2)
        if hasattr(self, "q_norm"):
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        return query_states, key_states, value_states

    def forward(
        self,
        hidden_states: torch.Tensor,
        context_hidden_states: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        query_states, key_states, value_states = self.project_qkv(hidden_states, context_hidden_states)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class DSparkDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DSparkAttention(config, layer_idx)  # diff with Llama: KV-injected, non-causal attention
        self.mlp = DSparkMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context_hidden_states: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            context_hidden_states=context_hidden_states,  # diff with Llama: the context is not normed here
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


__all__ = [
    "DSparkAttention",
    "DSparkDecoderLayer",
    "DSparkMLP",
    "DSparkRMSNorm",
    "DSparkRotaryEmbedding",
    "additive_attention_mask",
    "apply_rotary_pos_emb",
]
