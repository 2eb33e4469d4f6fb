"""DeepSpec's Gemma-4 draft layer (`Gemma4DSparkModel`), written modular-style on Gemma-4's and our Llama blocks.

`DSparkConfig(draft_layer="gemma4")` builds `DSparkDraftModel` with these layers and Gemma-4 RMSNorms for the
context and final norms; the backbone, the sequential and confidence heads and decoding are the shared ones of
`modeling_dspark`. What differs from the Llama layout (DeepSpec `deepspec/modeling/dspark/gemma4/modeling.py`):

* Gemma-4 RMSNorm everywhere: `x * (mean(x²) + eps)^-0.5` in float32, times `weight` (not `1 + weight`).
* Attention: per-head `q_norm` / `k_norm`, a scale-free `v_norm`, scale 1.0 (queries and keys are normed), every
  layer full attention with the target's *global* head size; with `attention_k_eq_v` the values are the raw key
  projection (taken before `k_norm`, never rotated) and there is no `v_proj`.
* Sandwich norms around attention and MLP, and a `layer_scalar` buffer multiplying the layer's output.
* Unchanged from the shared backbone: context keys/values from `hidden_norm(fc(features))` without
  `input_layernorm`; RoPE from `rope_parameters` (the target's full-attention "proportional" RoPE, whose
  `rotate_half` pairs i with i + D/2 as Llama's does); the embedding and LM head are the target's (Gemma-4's
  embedding scales by sqrt(d) itself; `base_logits` applies `final_logit_softcapping` before the Markov bias).
"""

import torch
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

from .configuration_dspark import DSparkConfig
from .modeling_dspark_layers import DSparkAttention, DSparkMLP


class DSparkGemma4RMSNorm(Gemma4RMSNorm):
    pass


class DSparkGemma4Attention(DSparkAttention):
    """KV-injected, non-causal attention with Gemma-4's normed queries, keys and values."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        eps = config.rms_norm_eps
        self.scaling = 1.0  # diff with Llama: Gemma-4 attention is unscaled, q and k being RMS-normed
        self.q_norm = DSparkGemma4RMSNorm(self.head_dim, eps=eps)  # diff with Llama: always, Gemma-4's norm
        self.k_norm = DSparkGemma4RMSNorm(self.head_dim, eps=eps)
        self.v_norm = DSparkGemma4RMSNorm(self.head_dim, eps=eps, with_scale=False)  # diff with Llama: no weight
        if config.attention_k_eq_v:
            self.v_proj = None  # diff with Llama: the values are the key projection itself

    def project_qkv(self, hidden_states: torch.Tensor, context_hidden_states: torch.Tensor | None):
        """Queries (B, H, Q, hd); keys and values (B, Hkv, C + Q, hd) of context + block, normed, not rotated."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        kv_input = (
            hidden_states if context_hidden_states is None else torch.cat([context_hidden_states, hidden_states], 1)
        )
        kv_shape = (*kv_input.shape[:-1], -1, self.head_dim)

        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # (B, H, Q, hd)
        keys = self.k_proj(kv_input).view(kv_shape)  # (B, C + Q, Hkv, hd)
        # diff with Llama: with K = V the values are the keys *before* k_norm (and RoPE), then v_norm'ed
        values = keys if self.v_proj is None else self.v_proj(kv_input).view(kv_shape)
        return query_states, self.k_norm(keys).transpose(1, 2), self.v_norm(values).transpose(1, 2)


class DSparkGemma4DecoderLayer(GradientCheckpointingLayer):
    """Gemma-4 sandwich-norm block around the KV-injected attention, scaled by `layer_scalar`."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_size = d
        self.self_attn = DSparkGemma4Attention(config, layer_idx)
        # Gemma-4's MLP is Llama's gate/up/down with `hidden_act` gelu_pytorch_tanh (the draft layers never share
        # KV, so never Gemma-4's double-wide variant)
        self.mlp = DSparkMLP(config)
        self.input_layernorm = DSparkGemma4RMSNorm(d, eps=eps)
        self.post_attention_layernorm = DSparkGemma4RMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = DSparkGemma4RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = DSparkGemma4RMSNorm(d, eps=eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # persistent: DeepSpec checkpoints carry it

    def forward(
        self,
        hidden_states: torch.Tensor,
        context_hidden_states: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        attn_output, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            context_hidden_states=context_hidden_states,  # diff with Gemma-4: the context is not normed here
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        hidden_states = hidden_states + self.post_attention_layernorm(attn_output)
        hidden_states = hidden_states + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(hidden_states))
        )
        return hidden_states * self.layer_scalar


__all__ = ["DSparkGemma4Attention", "DSparkGemma4DecoderLayer", "DSparkGemma4RMSNorm"]
