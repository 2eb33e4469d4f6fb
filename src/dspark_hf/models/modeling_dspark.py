"""The DSpark drafter, written modular-style on top of transformers' Llama blocks.

Architecture (DSpark paper §3, DFlash §4):
  1. Target features: raw outputs of `config.target_layer_ids` (HF `hidden_states[i + 1]`) concatenated,
     fused by `fc` (m·d -> d) and `hidden_norm` (RMSNorm) into `H_ctx`.
  2. Every draft layer projects `H_ctx` with its own k/v projections and prepends the result to the block's
     keys/values (KV injection). Context features never pass through q/o or the MLP.
  3. The block (anchor + γ-1 mask slots) attends bidirectionally to itself and to all context; one pass gives
     `h_1..h_γ`. Anchor-predicts-first: slot j predicts the token at anchor position + j + 1.
  4. Base logits `U_k = lm_head(h_k)` through the *target's* LM head (borrowed, never stored here), a sequential
     head adds `B_k(x_{k-1})`, and tokens are sampled one by one; a confidence head predicts survival.

The embedding and LM head are the target's, passed in at call time, so a checkpoint holds only drafter weights.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from ..kernels import packed_linear
from ..kernels.few_rows import gathered_rows
from ..kernels.weights import bias_of, dense_weight, dequantized, input_dtype, out_features
from .configuration_dspark import DSparkConfig
from .heads import SEQUENTIAL_HEAD_CLASSES, DSparkConfidenceHead, survival_probabilities
from .modeling_dspark_layers import (
    DSparkDecoderLayer,
    DSparkRMSNorm,
    DSparkRotaryEmbedding,
    additive_attention_mask,
)


logger = logging.get_logger(__name__)


def draft_layer_classes(config: DSparkConfig) -> tuple[type[nn.Module], type[nn.Module]]:
    """(RMSNorm, decoder layer) classes of `config.draft_layer`: Llama blocks, or DeepSpec's Gemma-4 draft layer
    (`modeling_dspark_gemma4`); the backbone, heads and decoding are the same for both."""
    if config.draft_layer == "gemma4":
        from .modeling_dspark_gemma4 import DSparkGemma4DecoderLayer, DSparkGemma4RMSNorm

        return DSparkGemma4RMSNorm, DSparkGemma4DecoderLayer
    return DSparkRMSNorm, DSparkDecoderLayer


@dataclass
class DSparkModelOutput(ModelOutput):
    """
    last_hidden_state (`torch.FloatTensor` of shape `(batch_size, block_len, hidden_size)`):
        Post-norm backbone output `h_k` for every block slot.
    cache (`Cache`, *optional*): the drafter's context cache (projected target features, plus this block).
    """

    last_hidden_state: torch.FloatTensor | None = None
    cache: Cache | None = None


@dataclass
class DSparkBlockDraft:
    """One drafted block, after token-by-token sampling and truncation.

    tokens (1, n): the drafts to verify; logits (1, n, V): the processed, biased draft logits they were drawn from
    (what speculative sampling compares against); confidence_logits (1, m): raw confidence logits of the m >= n
    positions examined; survival (m,): calibrated cumulative survival of those positions.
    """

    tokens: torch.LongTensor
    logits: torch.FloatTensor
    confidence_logits: torch.FloatTensor | None
    survival: list[float]


class DrafterMixin:
    """What every drafter of this package shares: logits through the target's LM head (borrowed at call time, never
    stored), strict safetensors-only loading with an optional target check, and `generation_stats`.

    List it before the `PreTrainedModel` base: `class MyDraftModel(DrafterMixin, MyPreTrainedModel)`.
    """

    generation_stats = None  # a `DSparkGenerationStats`, filled by the candidate generator after each generate()
    # callables (model, folder) run after `save_pretrained` writes a folder; `dspark_hf.register()` adds the one that
    # ships the remote code (`integrations/remote_code.py`)
    checkpoint_writers: list = []

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        """`PreTrainedModel.save_pretrained`, then the `checkpoint_writers` (on the main process only)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            for write in self.checkpoint_writers:
                write(self, save_directory)
        if push_to_hub:  # after the writers, so the upload carries what they wrote
            repo_id = kwargs.get("repo_id") or Path(save_directory).name
            self.push_to_hub(repo_id, **{k: kwargs[k] for k in ("commit_message", "private", "token") if k in kwargs})

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, restricted to safetensors and strict about missing weights.

        Pass `target=` (and `tokenizer=`) to check at load time that the drafter was made for that target.
        """
        from ..utils.checkpoints import check_checkpoint_files, check_model_type, raise_on_incomplete_load

        target, tokenizer = kwargs.pop("target", None), kwargs.pop("tokenizer", None)
        if kwargs.get("use_safetensors") is False:
            raise ValueError("DSpark drafters load from safetensors only; drop `use_safetensors=False`.")
        check_model_type(pretrained_model_name_or_path, cls.config_class.model_type, kwargs.get("subfolder") or "")
        check_checkpoint_files(pretrained_model_name_or_path, kwargs)
        kwargs["use_safetensors"] = True
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        raise_on_incomplete_load(pretrained_model_name_or_path, info)
        if target is not None:  # optional pairing check at load time (generate() checks again)
            model.config.check_target(target.config, tokenizer)
        return (model, info) if want_info else model

    def base_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module, vocab_ids=None) -> torch.Tensor:
        """`U_k = lm_head(h_k)`, soft-capped for Gemma-family targets: (B, K, d) -> (B, K, V) float32.

        With `vocab_ids` (V',) only those columns are computed, (B, K, V'): training on a vocabulary shortlist.
        The product runs in the narrower of the drafter's and the head's dtypes: a bf16 drafter beside a float32
        target multiplies by a bf16 copy of the head's rows (kept between no-grad calls), half the memory traffic of
        the float32 rows on every draft; a float32 drafter beside a bf16 head casts its hidden states down instead
        (no float32 copy of a large head). On the CPU through oneDNN's packed layout (`packed_linear.linear`).
        A quantised or hooked head (`weights.weight_kind`) is called as it is; only rows of it (`vocab_ids`) are
        taken from a float copy made once (`weights.dequantized`, logged with its size).
        """
        weight = dense_weight(lm_head)  # None: a quantised or hooked (offloaded) head (kernels/weights.py)
        if weight is None and vocab_ids is None:  # the head computes itself, exactly as in the target
            logits = lm_head(hidden_states.to(input_dtype(lm_head))).float()
        else:
            if weight is None:  # rows of a non-dense head: a float copy in the drafter's dtype, made once and logged
                weight = dequantized(lm_head, self, self.dtype)
            bias = bias_of(lm_head)
            narrower = weight.dtype.is_floating_point and self.dtype.itemsize < weight.dtype.itemsize
            # the rows are kept between no-grad calls (inference, evaluation) when gathered or cast
            weight = gathered_rows(self, weight, vocab_ids, self.dtype if narrower else None)
            if bias is not None:
                bias = gathered_rows(self, bias, vocab_ids, weight.dtype)
            logits = packed_linear.linear(hidden_states.to(weight.dtype), weight, bias, owner=self).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def training_logits(self, features, input_ids, blocks, embed_tokens, lm_head, vocab_ids=None, forward=None):
        """Teacher-forced draft logits of the training blocks, computed the way inference drafts them.

        features (B, L, m·d): raw target features of every position; input_ids (B, L); blocks: a `BlockBatch`
        (anchors, prev_ids, positions, mask); `forward`: the callable that runs this model's forward (a data-parallel
        wrapper during training; default `self`). Returns draft logits (B, N, γ, V) (V' over `vocab_ids`) and
        confidence logits (B, N, γ) or None.
        """
        raise NotImplementedError


class DSparkPreTrainedModel(PreTrainedModel):
    config: DSparkConfig
    base_model_prefix = "dspark"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DSparkDecoderLayer", "DSparkGemma4DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False  # the block attends to context it did not produce; masks are custom
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self and getattr(self, "mask_embedding", None) is not None:
            init.normal_(self.mask_embedding, std=self.config.initializer_range)
        if isinstance(getattr(module, "layer_scalar", None), torch.Tensor):  # the Gemma-4 layer's output scale
            init.ones_(module.layer_scalar)
        head = getattr(self, "markov_head", None)
        if head is not None and module is head.markov_w2:
            # The sequential bias starts at zero so that an untrained head leaves the backbone's logits unchanged.
            init.zeros_(module.weight)


class DSparkDraftModel(DrafterMixin, DSparkPreTrainedModel):
    """DSpark drafter: fused target features as extra K/V, a non-causal block pass, sequential and confidence heads.

    Use it as `target.generate(**inputs, assistant_model=drafter)` after `import dspark_hf`.
    """

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        norm_class, layer_class = draft_layer_classes(config)
        self.hidden_norm = norm_class(d, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.norm = norm_class(d, eps=config.rms_norm_eps)
        self.rotary_emb = DSparkRotaryEmbedding(config)
        self.mask_embedding = nn.Parameter(torch.zeros(d)) if config.mask_token_id is None else None
        self.markov_head = None
        if config.sequential_head != "none":
            self.markov_head = SEQUENTIAL_HEAD_CLASSES[config.sequential_head](
                config.vocab_size, d, config.markov_rank
            )
        self.confidence_head = None
        if config.confidence_head:
            rank = config.markov_rank if config.confidence_with_markov else None
            self.confidence_head = DSparkConfidenceHead(d, rank)
        # deviation from DFlash/DeepSpec: an optional draft vocabulary (token ids drafted from, sorted), see
        # `set_draft_vocab`; a buffer, so it travels in model.safetensors
        n = config.draft_vocab_size
        self.register_buffer("draft_vocab_ids", torch.arange(n) if n else None)
        self.post_init()

    def set_draft_vocab(self, token_ids: torch.Tensor | list[int] | None) -> None:
        """Draft only among `token_ids` (e.g. the most frequent tokens of the training data, `vocab_shortlist`), or
        over the whole vocabulary again with None. The LM head and the sequential head then compute these columns
        only; the rest of the draft distribution is 0 (logits -inf), which rejection sampling handles exactly.
        Saved with the checkpoint (`config.draft_vocab_size` and the `draft_vocab_ids` buffer)."""
        if token_ids is None:
            self.draft_vocab_ids, self.config.draft_vocab_size = None, 0
            return
        given = torch.as_tensor(token_ids)
        if given.ndim != 1 or given.numel() == 0 or given.dtype.is_floating_point or given.dtype == torch.bool:
            raise ValueError(f"`token_ids` must be a non-empty 1-D list of token ids, got shape {tuple(given.shape)}.")
        ids = given.long().unique()  # sorted
        if len(ids) != len(given):
            raise ValueError("`token_ids` has duplicates; pass each token id once.")
        if ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"`token_ids` must lie in [0, {self.config.vocab_size}), got {ids[0]}..{ids[-1]}.")
        device = next(self.parameters()).device
        self.draft_vocab_ids, self.config.draft_vocab_size = ids.to(device), len(ids)

    def draft_base_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """`U_k` at inference: (B, K, d) -> (B, K, V) float32. With a draft vocabulary only its columns are computed
        (the LM head's rows gathered once and kept, `few_rows.gathered_rows`; a quantised or hooked head is dequantized
        once for it, `weights.dequantized`) and every other logit is -inf."""
        ids = self.draft_vocab_ids
        if ids is None:
            return self.base_logits(hidden_states, lm_head)
        return self._scatter(self.base_logits(hidden_states, lm_head, ids), float("-inf"), out_features(lm_head))

    def draft_sequential_bias(self, prev_ids, hidden_states, state=None):
        """`sequential_bias` at inference: (B, K, V) over the draft vocabulary's columns (0 elsewhere), or None."""
        ids = self.draft_vocab_ids
        if ids is None or self.markov_head is None:
            return self.sequential_bias(prev_ids, hidden_states, state)
        bias, state = self.sequential_bias(prev_ids, hidden_states, state, vocab_ids=ids)
        return self._scatter(bias, 0.0, self.config.vocab_size), state

    def _scatter(self, values: torch.Tensor, fill: float, vocab_size: int) -> torch.Tensor:
        """(..., V') at the draft vocabulary's columns -> (..., V) with `fill` elsewhere."""
        full = values.new_full((*values.shape[:-1], vocab_size), fill)
        return full.index_copy_(-1, self.draft_vocab_ids, values)

    # Readers of other projects' checkpoint formats, tried first: callables (path, kwargs) -> model or None. The
    # package fills it once (`registration.register`: DeepSpec's format, `integrations/deepspec.py`); the model never
    # imports loading policy itself.
    checkpoint_readers: list = []

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`DrafterMixin.from_pretrained` (safetensors only, strict, optional `target=` / `tokenizer=` check); a
        checkpoint in another project's format (DeepSpec's, after `import dspark_hf`) is converted on the fly."""
        for read in cls.checkpoint_readers:
            model = read(pretrained_model_name_or_path, model_args, kwargs)
            if model is not None:
                return model
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    # -- inputs ---------------------------------------------------------------------------------------------------

    def block_input_embeds(self, anchor_ids: torch.LongTensor, embed_tokens: nn.Module) -> torch.Tensor:
        """Input embeddings of blocks starting at each anchor: anchor + γ-1 mask slots.

        anchor_ids (B, N) -> (B, N * γ, d), blocks laid out one after another.
        """
        bsz, n_blocks = anchor_ids.shape
        gamma = self.config.block_size
        anchor = embed_tokens(anchor_ids)  # (B, N, d)
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(anchor.dtype).expand(bsz, n_blocks, gamma - 1, -1)
        else:
            mask_ids = anchor_ids.new_full((bsz, n_blocks, gamma - 1), self.config.mask_token_id)
            mask = embed_tokens(mask_ids)  # (B, N, γ-1, d)
        return torch.cat([anchor.unsqueeze(2), mask], dim=2).reshape(bsz, n_blocks * gamma, -1)  # (B, N·γ, d)

    # -- backbone -------------------------------------------------------------------------------------------------

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> DSparkModelOutput:
        r"""
        noise_embeds (`torch.Tensor` of shape `(batch_size, block_len, hidden_size)`):
            Input embeddings of the block slots (anchor + mask slots), see `block_input_embeds`.
        context_hidden_states (`torch.Tensor` of shape `(batch_size, ctx_len, len(target_layer_ids) * hidden_size)`):
            Raw target features of the new context positions, concatenated over `target_layer_ids` in that order.
            They are fused, projected by every layer's k/v projections and appended to `cache`.
        position_ids (`torch.LongTensor` of shape `(batch_size, ctx_len + block_len)`):
            Positions of the new context entries followed by the block slots (slot j of a block anchored at
            position a sits at a + j). Default: continue after what `cache` holds.
        attention_mask (`torch.Tensor` of shape `(batch_size, 1, block_len, total_kv_len)`, *optional*):
            Boolean (True = visible) or additive float mask over all keys (cached + new context + block). `None`
            lets every slot see every key, which is the inference pattern (context < anchor, the whole own block).
        cache (`Cache`, *optional*): the drafter's context cache; the caller crops the block entries afterwards.
        """
        ctx = None
        if context_hidden_states is not None:
            ctx = self.hidden_norm(self.fc(context_hidden_states.to(self.fc.weight.dtype)))  # (B, C, d)
        new_len = noise_embeds.shape[1] + (0 if ctx is None else ctx.shape[1])
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + new_len, device=noise_embeds.device)[None]
        if position_ids.shape[-1] != new_len:
            raise ValueError(
                f"`position_ids` must cover context + block ({new_len} positions), got {position_ids.shape}."
            )
        hidden_states = noise_embeds.to(self.fc.weight.dtype)
        attention_mask = additive_attention_mask(attention_mask, hidden_states.dtype)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                context_hidden_states=ctx,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                **kwargs,
            )
        return DSparkModelOutput(last_hidden_state=self.norm(hidden_states), cache=cache)

    # -- training -------------------------------------------------------------------------------------------------

    def block_hidden(self, features, input_ids, blocks, embed_tokens, forward=None) -> torch.Tensor:
        """Backbone output of every training block, all in one pass with the training mask: (B, N, γ, d).

        `forward` runs the backbone (a data-parallel wrapper during training, for gradient sync; default `self`).
        """
        gamma = self.config.block_size
        bsz, n = blocks.anchors.shape
        noise = self.block_input_embeds(torch.gather(input_ids, 1, blocks.anchors), embed_tokens)  # (B, N·γ, d)
        out = (forward or self)(
            noise_embeds=noise,
            context_hidden_states=features,
            position_ids=blocks.position_ids,
            attention_mask=blocks.attention_mask,
        )
        return out.last_hidden_state.view(bsz, n, gamma, -1)  # (B, N, γ, d)

    def training_logits(self, features, input_ids, blocks, embed_tokens, lm_head, vocab_ids=None, forward=None):
        """One parallel pass over all blocks, then `block_logits` (teacher-forced bias) and the confidence head."""
        hidden = self.block_hidden(features, input_ids, blocks, embed_tokens, forward)
        draft_logits = self.block_logits(hidden, blocks.prev_ids, lm_head, vocab_ids)  # (B, N, γ, V)
        conf = self.confidence_logits(hidden.flatten(1, 2), blocks.prev_ids.flatten(1))
        return draft_logits, conf.view_as(blocks.prev_ids) if conf is not None else None

    # -- heads ----------------------------------------------------------------------------------------------------

    def sequential_bias(self, prev_ids, hidden_states, state=None, vocab_ids=None):
        """`B_k`: prev_ids (B, K), hidden_states (B, K, d) -> bias (B, K, V) (or (B, K, V') over `vocab_ids`) or
        None, new state."""
        if self.markov_head is None:
            return None, state
        bias, state = self.markov_head(prev_ids, hidden_states, state, vocab_ids)
        return bias.float(), state

    def confidence_logits(self, hidden_states: torch.Tensor, prev_ids: torch.LongTensor) -> torch.Tensor | None:
        """Raw confidence logits from `[h_k ; W1[x_{k-1}]]`: (B, K, d), (B, K) -> (B, K), or None without the head."""
        if self.confidence_head is None:
            return None
        prev_emb = self.markov_head.token_embedding(prev_ids) if self.config.confidence_with_markov else None
        return self.confidence_head(hidden_states, prev_emb).float()

    def block_logits(self, hidden_states, prev_ids, lm_head, vocab_ids=None):
        """Teacher-forced draft logits `U_k + B_k(x*_{k-1})` for whole blocks (training, evaluation).

        hidden_states (B, N, γ, d), prev_ids (B, N, γ) = [anchor, x*_1 .. x*_{γ-1}] per block -> (B, N, γ, V),
        or (B, N, γ, V') over the shortlist `vocab_ids` (V',).
        """
        bsz, n_blocks, gamma, d = hidden_states.shape
        flat_h = hidden_states.reshape(bsz * n_blocks, gamma, d)  # (B·N, γ, d)
        logits = self.base_logits(flat_h, lm_head, vocab_ids)
        bias, _ = self.sequential_bias(prev_ids.reshape(bsz * n_blocks, gamma), flat_h, vocab_ids=vocab_ids)
        if bias is not None:
            logits = logits + bias
        return logits.reshape(bsz, n_blocks, gamma, -1)

    @property
    def sts_temperatures(self) -> torch.Tensor:
        return torch.tensor(self.config.sts_temperatures, dtype=torch.float32)


__all__ = [
    "DrafterMixin",
    "DSparkBlockDraft",
    "DSparkDraftModel",
    "DSparkModelOutput",
    "DSparkPreTrainedModel",
    "survival_probabilities",
]


# Loaded as remote code (`AutoModel.from_pretrained(..., trust_remote_code=True)` in a process without dspark_hf),
# route `generate(assistant_model=drafter)` as `import dspark_hf` does. Imported as part of the package, nothing
# happens here: the package's one registration is `import dspark_hf`.
if not __name__.startswith("dspark_hf."):
    from ..integrations.generation import install

    install()
