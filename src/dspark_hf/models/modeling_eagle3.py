"""An EAGLE-3-style autoregressive drafter on DSpark's building blocks (the autoregressive baseline of the paper).

Architecture (EAGLE-3, Li et al. 2025), with this package's conventions:
  1. Entry p of the drafter's sequence reads `[embed(x_p) ; g_p]` and predicts x_{p+1}. For positions the target has
     run, `g_p = fc(f_{p-1})`: the raw outputs of `config.target_layer_ids` (low, middle, high) at position p - 1,
     concatenated and projected m·d -> d (entry 0 has no earlier position and reads zeros). For positions the
     drafter proposed itself, `g_p` is its own pre-norm output at entry p - 1 (it feeds itself).
  2. One Llama decoder layer whose q/k/v projections read the 2d-wide `[input_layernorm(embed) ; hidden_norm(g)]`
     (the marked deviation from `LlamaDecoderLayer`); the residual stream is `g`. Causal attention with a KV cache.
  3. `norm` then the target's LM head (borrowed, never stored), as for DSpark.

Drafting γ tokens is γ sequential forwards (the first also appends the newly verified positions to the cache), so
draft latency grows linearly with γ, unlike DSpark's one parallel pass. Training unrolls the same recursion for γ
steps on every anchor block (EAGLE-3's training-time test, `training_logits`), so it sees exactly what inference
computes: teacher-forced tokens, self-produced features.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from ..kernels.weights import out_features
from ..utils.devices import module_device
from .configuration_eagle3 import Eagle3Config
from .modeling_dspark import DrafterMixin, DSparkBlockDraft
from .modeling_dspark_layers import (
    DSparkAttention,
    DSparkMLP,
    DSparkRMSNorm,
    DSparkRotaryEmbedding,
    additive_attention_mask,
)


class Eagle3Attention(DSparkAttention):
    """Causal self-attention whose queries, keys and values read `[embed ; g]` (2 · hidden_size wide).

    DSpark's attention without context injection (its `context_hidden_states` stays None); masks are always explicit
    (`Eagle3DraftModel.forward` builds the causal one), so SDPA never guesses a causal alignment.
    """

    def __init__(self, config: Eagle3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        width, bias = 2 * config.hidden_size, config.attention_bias
        # diff with Llama: q/k/v project the concatenated [embedding ; fused feature], 2d -> heads
        self.q_proj = nn.Linear(width, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, config.num_key_value_heads * self.head_dim, bias=bias)


class Eagle3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Eagle3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = Eagle3Attention(config, layer_idx)
        self.mlp = DSparkMLP(config)
        self.hidden_norm = DSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # diff with Llama: norms g

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        residual = hidden_states
        # diff with Llama: attention reads [input_layernorm(embed) ; hidden_norm(g)]; the residual stream is g
        attn_input = torch.cat([self.input_layernorm(inputs_embeds), self.hidden_norm(hidden_states)], dim=-1)
        hidden_states, _ = self.self_attn(
            attn_input,
            context_hidden_states=None,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


@dataclass
class Eagle3ModelOutput(ModelOutput):
    """
    last_hidden_state (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`):
        Post-norm output, what the LM head reads.
    prenorm_hidden_state (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`):
        The layer output before `norm`: the feature `g` of the next entry when the drafter feeds itself.
    cache (`Cache`, *optional*): the drafter's KV cache, with this call's entries appended.
    """

    last_hidden_state: torch.FloatTensor | None = None
    prenorm_hidden_state: torch.FloatTensor | None = None
    cache: Cache | None = None


def causal_mask(num_queries: int, num_keys: int, key_mask: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """(B, 1, Q, K) boolean, True = visible: the Q new entries are the last Q of the K keys and see keys up to their
    own. key_mask (B, K') hides padded positions among the first K' keys (left padding); None hides none."""
    past = num_keys - num_queries
    keys = torch.arange(num_keys, device=device)
    mask = (keys[None, :] <= past + torch.arange(num_queries, device=device)[:, None])[None, None]  # (1, 1, Q, K)
    if key_mask is not None:
        visible = torch.ones(key_mask.shape[0], num_keys, dtype=torch.bool, device=device)
        visible[:, : key_mask.shape[1]] = key_mask.bool()
        mask = mask & visible[:, None, None, :]
    return mask


def shift_target_features(features: torch.Tensor) -> torch.Tensor:
    """Entry p reads the target features of position p - 1: (B, L, m·d) -> (B, L, m·d), zeros for entry 0."""
    return torch.cat([features.new_zeros(features[:, :1].shape), features[:, :-1]], dim=1)


class Eagle3PreTrainedModel(PreTrainedModel):
    config: Eagle3Config
    base_model_prefix = "eagle3"
    main_input_name = "inputs_embeds"
    _no_split_modules = ["Eagle3DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False  # training masks are custom (per-block diagonals)
    _supports_attention_backend = True


class Eagle3DraftModel(DrafterMixin, Eagle3PreTrainedModel):
    """EAGLE-3 drafter: fused low/mid/high target features, one decoder layer, γ sequential drafting forwards.

    Use it as `target.generate(**inputs, assistant_model=drafter)` after `import dspark_hf`.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config, 0)])
        self.norm = DSparkRMSNorm(d, eps=config.rms_norm_eps)
        self.rotary_emb = DSparkRotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        target_hidden_states: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> Eagle3ModelOutput:
        r"""
        inputs_embeds (`torch.Tensor` of shape `(batch_size, seq_len, hidden_size)`):
            Target embeddings of the entries' tokens x_p.
        target_hidden_states (`torch.Tensor` of shape `(batch_size, seq_len, len(target_layer_ids) * hidden_size)`):
            Raw target features of position p - 1 for each entry p (see `shift_target_features`), fused by `fc`.
        hidden_states (`torch.Tensor` of shape `(batch_size, seq_len, hidden_size)`):
            Instead of `target_hidden_states`: the drafter's own `prenorm_hidden_state` of the previous entry.
        position_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`): default: continue after `cache`.
        attention_mask (`torch.Tensor` of shape `(batch_size, 1, seq_len, cached + seq_len)`, *optional*):
            Boolean (True = visible) or additive float mask over cached and new keys; `None` is causal.
        cache (`Cache`, *optional*): the drafter's KV cache; the new entries are appended.
        """
        if (target_hidden_states is None) == (hidden_states is None):
            raise ValueError("Pass exactly one of `target_hidden_states` (target features) or `hidden_states`.")
        weight = self.fc.weight
        if target_hidden_states is not None:
            hidden_states = self.fc(target_hidden_states.to(device=weight.device, dtype=weight.dtype))
        hidden_states = hidden_states.to(device=weight.device, dtype=weight.dtype)
        inputs_embeds = inputs_embeds.to(device=weight.device, dtype=weight.dtype)
        past = cache.get_seq_length() if cache is not None else 0
        num_new = inputs_embeds.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + num_new, device=weight.device)[None]
        if attention_mask is None and num_new > 1:
            attention_mask = causal_mask(num_new, past + num_new, device=weight.device)
        attention_mask = additive_attention_mask(attention_mask, weight.dtype)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                inputs_embeds,
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                **kwargs,
            )
        return Eagle3ModelOutput(
            last_hidden_state=self.norm(hidden_states), prenorm_hidden_state=hidden_states, cache=cache
        )

    # -- inference ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def draft(
        self,
        sequence_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        cache: Cache,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        num_tokens: int,
        logits_processor: Callable | None = None,
        choose: Callable | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> DSparkBlockDraft:
        """Drafts `num_tokens` tokens after `sequence_ids` in `num_tokens` forwards (one when `num_tokens` is 0).

        sequence_ids (1, L): committed tokens, the last one the anchor. `cache` holds the exact entries 0..P-1 (P =
        its length); target_hidden_states (1, L - P, m·d) or (1, L - 1, m·d) when P = 0: target features of
        positions P - 1 .. L - 2, the ones the target computed since the last call. The first forward appends
        entries P..L-1 and predicts x_{L}; each further one feeds the last draft and its own output back. Afterwards
        the cache keeps entries 0..L-1 (exact) and drops the self-fed ones. key_mask (1, L): False at padded
        prompt positions. `choose(ids, logits)` picks each draft from the processed logits (1, V) -> (1,) (None: the
        argmax). Returns the tokens (1, n) and the processed logits (1, n, V) they were chosen from.
        """
        length, past = sequence_ids.shape[1], cache.get_seq_length()
        features = target_hidden_states
        if past == 0:  # entry 0 has no earlier position: it reads zeros
            features = torch.cat([features.new_zeros(features[:, :1].shape), features], dim=1)
        if features.shape[1] != length - past:
            raise RuntimeError(
                f"EAGLE-3 cache out of sync: {features.shape[1]} new features for {length - past} entries."
            )
        device = self.fc.weight.device
        new = sequence_ids[:, past:]
        out = self(
            inputs_embeds=embed_tokens(new.to(module_device(embed_tokens))),
            target_hidden_states=features,
            position_ids=torch.arange(past, length, device=device)[None],
            attention_mask=causal_mask(length - past, length, key_mask, device),
            cache=cache,
        )
        ids, logits_out = sequence_ids, []
        for k in range(num_tokens):
            if k:  # feed the last draft with the drafter's own output as its feature
                out = self(
                    inputs_embeds=embed_tokens(ids[:, -1:].to(module_device(embed_tokens))),
                    hidden_states=out.prenorm_hidden_state[:, -1:],
                    position_ids=torch.tensor([[length - 1 + k]], device=device),
                    attention_mask=causal_mask(1, length + k, key_mask, device),
                    cache=cache,
                )
            logits = self.base_logits(out.last_hidden_state[:, -1], lm_head)  # (1, V)
            if logits_processor is not None:
                logits = logits_processor(ids, logits)
            token = (logits.argmax(dim=-1) if choose is None else choose(ids, logits))[:, None]  # (1, 1)
            logits_out.append(logits)
            ids = torch.cat([ids, token.to(ids.device)], dim=-1)
        drafted = cache.get_seq_length() - length
        if drafted > 0:
            cache.crop(-drafted)  # self-fed entries: recomputed from target features once verified
        logits = (
            torch.stack(logits_out, dim=1)
            if logits_out
            else out.last_hidden_state.new_zeros(1, 0, out_features(lm_head))
        )
        return DSparkBlockDraft(tokens=ids[:, length:], logits=logits, confidence_logits=None, survival=[])

    # -- training -------------------------------------------------------------------------------------------------

    def training_logits(self, features, input_ids, blocks, embed_tokens, lm_head, vocab_ids=None, forward=None):
        """EAGLE-3's training-time test on the anchor blocks: (B, N, γ, V) draft logits, no confidence.

        Step 0 is one causal pass over the whole sequence (entries read the target's features, as verified
        positions do at inference); its output at anchor a drafts x_{a+1}. Step j = 1..γ-1 feeds, for every block
        at once, the teacher-forced token x*_{a+j} with the block's own step j-1 output; its query at position a + j
        sees the context entries 0..a and the block's steps 1..j, exactly the keys inference has then.
        features (B, L, m·d); input_ids (B, L); blocks: a `BlockBatch`; `forward`: the (possibly data-parallel)
        callable running this model.
        """
        run = forward or self
        gamma = self.config.block_size
        bsz, length = input_ids.shape
        anchors = blocks.anchors  # (B, N)
        n = anchors.shape[1]
        cache = DynamicCache()
        out = run(
            inputs_embeds=embed_tokens(input_ids),
            target_hidden_states=shift_target_features(features),
            position_ids=torch.arange(length, device=input_ids.device).expand(bsz, -1),
            attention_mask=causal_mask(length, length, device=input_ids.device),
            cache=cache,
        )
        index = anchors[..., None].expand(-1, -1, self.config.hidden_size)  # (B, N, d)
        prenorm = torch.gather(out.prenorm_hidden_state, 1, index)
        steps = [torch.gather(out.last_hidden_state, 1, index)]  # (B, N, d) per step
        sees_context = torch.arange(length, device=anchors.device)[None, None, :] <= anchors[..., None]  # (B, N, L)
        own = torch.eye(n, dtype=torch.bool, device=anchors.device).expand(bsz, -1, -1)  # a block's own entry
        for j in range(1, gamma):
            mask = torch.cat([sees_context] + [own] * j, dim=-1)[:, None]  # (B, 1, N, L + N·j)
            out = run(
                inputs_embeds=embed_tokens(blocks.prev_ids[:, :, j]),
                hidden_states=prenorm,
                position_ids=anchors + j,
                attention_mask=mask,
                cache=cache,
            )
            prenorm = out.prenorm_hidden_state
            steps.append(out.last_hidden_state)
        hidden = torch.stack(steps, dim=2)  # (B, N, γ, d)
        logits = self.base_logits(hidden.flatten(1, 2), lm_head, vocab_ids)
        return logits.view(bsz, n, gamma, -1), None


__all__ = ["Eagle3DraftModel", "Eagle3ModelOutput", "Eagle3PreTrainedModel"]


# Loaded as remote code, route `generate(assistant_model=drafter)` as `import dspark_hf` does (see modeling_dspark).
if not __name__.startswith("dspark_hf."):
    from ..integrations.generation import install

    install()
