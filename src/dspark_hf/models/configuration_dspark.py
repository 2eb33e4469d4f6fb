"""Configuration of a DSpark drafter.

A DSpark drafter is a small stack of decoder layers with the *target's* width that reads target hidden states
(fused from a few target layers) as extra keys/values, drafts a whole block in one non-causal pass, and then
samples the block token by token through a cheap sequential head (Markov bias or RNN). A confidence head predicts
each draft token's survival probability. See `docs` in the repository and the DSpark paper (DeepSeek, 2026).

The config records a *fingerprint* of the target it was made for (model type, width, depth, vocabulary, special
tokens) so that pairing a drafter with the wrong target fails loudly instead of producing garbage drafts.
`DrafterConfig` holds what every drafter of this package shares (fingerprint, backbone shapes, tapped target layers,
block size, `for_target` / `check_target`); `DSparkConfig` adds the DSpark fields, `Eagle3Config` the EAGLE-3 ones.
"""

import hashlib
import json
from pathlib import Path
from typing import Any

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassError
from transformers.configuration_utils import PreTrainedConfig
from transformers.utils import logging

from .settings import LONGEST_LOOKUP, MAX_TREE_BUDGET, VERIFY_POLICIES, check_dspark_settings, check_int


logger = logging.get_logger(__name__)

SEQUENTIAL_HEADS = ("markov", "gated_markov", "rnn", "none")
# Block positions whose base logits drafting computes first under a policy that can stop early ("threshold",
# "scheduler": they mostly verify 1-2 drafts); the rest of the block only if sampling gets there.
EARLY_DRAFT_POSITIONS = 2

# Known mask tokens of target families whose released drafters use a vocabulary token as the mask.
# Everything else gets a learned mask embedding (mask_token_id=None).
_KNOWN_MASK_TOKENS = {
    "qwen3": 151669,
    "qwen3_moe": 151669,
    "gemma4": 4,
    "gemma4_text": 4,
    "gemma4_unified": 4,
    "gemma4_unified_text": 4,
}
# Families whose attention applies RMSNorm to queries and keys per head (QK-norm).
_QK_NORM_FAMILIES = (
    "qwen3",
    "qwen3_moe",
    "gemma3",
    "gemma3_text",
    "gemma4",
    "gemma4_text",
    "gemma4_unified",
    "gemma4_unified_text",
    "olmo2",
)
# Target families whose drafters get DeepSpec's Gemma-4 draft layer (`draft_layer="gemma4"`) by default.
_GEMMA4_FAMILIES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
DRAFT_LAYERS = ("llama", "gemma4")


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Up to `num_features` target layers spread uniformly from layer 1 to layer L-3, as DFlash does.

    The final layer is never chosen: transformers' last `hidden_states` entry is already final-normed.
    """
    if num_target_layers < 2:
        raise ValueError(f"A target needs at least 2 decoder layers to feed a drafter, got {num_target_layers}.")
    start, end = 1, max(num_target_layers - 3, 1)
    if num_target_layers <= 4:
        start, end = 0, num_target_layers - 2
    count = min(num_features, end - start + 1)
    if count == 1:
        return [start]
    span = end - start
    return sorted({start + round(i * span / (count - 1)) for i in range(count)})


def full_attention_value(text_config: PreTrainedConfig, name: str, default: Any = None) -> Any:
    """`text_config.<name>` as a full-attention layer sees it (draft layers are all full attention).

    Gemma-4 configs keep the full-attention layers' head size and KV heads as per-layer overrides (transformers
    5.2x `per_layer_config`), and reading the global attribute then raises; other configs answer directly.
    """
    layer_types = getattr(text_config, "layer_types", None) or []
    per_layer = getattr(text_config, "per_layer_config", None)
    if per_layer is not None and "full_attention" in layer_types:
        return getattr(per_layer[layer_types.index("full_attention")], name, default)
    return getattr(text_config, name, default)


def tokenizer_hashes(tokenizer) -> tuple[str, str | None]:
    """SHA-256 of the vocabulary (token -> id, sorted) and of the chat template (None if it has none)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(vocab).hexdigest(), hashlib.sha256(template.encode()).hexdigest() if template else None


def snapshot_revision(name_or_path: str | None) -> str | None:
    """The commit hash of a Hub snapshot: read from a `.../snapshots/<sha>/...` path, or, for a repo id, from the
    local HF cache (no network). None when unknown (e.g. a plain local folder)."""
    if not name_or_path:
        return None
    parts = Path(name_or_path).parts
    if "snapshots" in parts[:-1]:
        return parts[parts.index("snapshots") + 1]
    if Path(name_or_path).exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return snapshot_revision(cached) if isinstance(cached, str) else None


@strict
class DrafterConfig(PreTrainedConfig):
    r"""
    What every drafter of this package shares: a target fingerprint, Llama-style backbone shapes, the tapped target
    layers and the block size. Subclasses set `model_type`, add their own fields and extend `validate_architecture`.

    Target fingerprint (copied from the target's config; checked when the drafter is paired with a target):
        target_model_type (`str`): `model_type` of the target (e.g. `"llama"`, `"qwen3"`).
        hidden_size (`int`): the target's hidden size; the drafter has the same width (it borrows the embedding).
        num_target_layers (`int`): number of decoder layers of the target.
        vocab_size (`int`): the target's vocabulary size.
        bos_token_id / eos_token_id / pad_token_id: the target's special tokens (pipelines compare them).
        target_name_or_path, target_revision, target_tokenizer_hash, target_chat_template_hash: where the target
            came from (Hub id or path, and the Hub commit when known) and SHA-256 hashes of its vocabulary and chat
            template (`record_target`); `None` skips that check.

    Drafter backbone (defaults follow the target's own block shapes):
        num_hidden_layers (`int`): number of draft layers.
        intermediate_size, num_attention_heads, num_key_value_heads, head_dim, hidden_act, rms_norm_eps,
        rope_parameters, max_position_embeddings, attention_bias, mlp_bias, attention_dropout: as in `LlamaConfig`.
        use_qk_norm (`bool`): per-head RMSNorm on queries and keys (Qwen3 / Gemma families).
        final_logit_softcapping (`float`, *optional*): tanh soft-capping of the base logits (Gemma families).

    Drafting:
        target_layer_ids (`list[int]`): target decoder layers whose raw outputs are fused into the context.
            Default: up to `default_num_target_features` layers spread from 1 to L-3. The final layer is rejected
            (its HF hidden state is normed).
        block_size (`int`): γ, draft tokens per round; the target verifies γ + 1 positions.
    """

    keys_to_ignore_at_inference = ["cache"]
    default_num_target_features = 5  # class attribute, not a field

    # target fingerprint
    target_model_type: str = "llama"
    hidden_size: int = 576
    num_target_layers: int = 30
    vocab_size: int = 49152
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    target_name_or_path: str | None = None
    target_revision: str | None = None
    target_tokenizer_hash: str | None = None
    target_chat_template_hash: str | None = None

    # drafter backbone
    num_hidden_layers: int = 2
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float | int = 1e-5
    rope_parameters: dict | None = None
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float | int = 0.0
    use_qk_norm: bool = False
    final_logit_softcapping: float | int | None = None
    initializer_range: float | int = 0.02
    tie_word_embeddings: bool = False

    # drafting
    target_layer_ids: list[int] | None = None
    block_size: int = 7

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.default_num_target_features)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        # Checked here, not only by @strict's validators, so that users get a plain ValueError.
        self.validate_architecture()
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        """`PreTrainedConfig.from_dict` (what `from_pretrained` reads a config.json with); a field of the wrong type
        (`"block_size": "4"`) is a `ValueError` naming the field and the type it needs."""
        try:
            return super().from_dict(config_dict, **kwargs)
        except StrictDataclassError as err:
            cause = err.__cause__ if err.__cause__ is not None else err
            raise ValueError(
                f"Invalid {cls.__name__} (config.json): {' '.join(str(cause).split())}; correct that field."
            ) from None

    def check_runtime_settings(self, drafter=None) -> None:
        """Checks every setting decoding reads when it runs, and raises a one-line `ValueError` naming the field, what
        it allows and the value given.

        These settings can be changed on a live drafter (`drafter.config.tree_budget = 16`, the documented way to turn
        features on), where `@strict` checks only their types, so `generate()` and the `Engine` (at construction and
        for each request) call this before any forward; building or loading a config calls it too
        (`validate_architecture`). With `drafter`, the settings fixed by its weights must also describe it.
        """
        check_int("block_size", self.block_size, 1, meaning="γ, draft tokens per round")

    def validate_architecture(self):
        """Checks the shared fields and raises `ValueError` naming the bad value and the fix."""
        self.check_runtime_settings()
        if self.num_hidden_layers < 1:
            raise ValueError(f"`num_hidden_layers` must be >= 1, got {self.num_hidden_layers}.")
        if not self.target_layer_ids:
            raise ValueError("`target_layer_ids` must name at least one target layer.")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers - 1]
        if bad:
            raise ValueError(
                f"`target_layer_ids` {self.target_layer_ids} contains {bad}, outside 0..{self.num_target_layers - 2} "
                f"for a {self.num_target_layers}-layer target. The final layer ({self.num_target_layers - 1}) is not "
                "allowed: transformers returns it already final-normed."
            )
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"`target_layer_ids` has duplicates: {self.target_layer_ids}.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )

    @classmethod
    def target_defaults(cls, text_config: PreTrainedConfig) -> dict[str, Any]:
        """Fields a subclass derives from the target's (text) config beyond the shared ones; see `for_target`."""
        return {}

    @classmethod
    def for_target(cls, target_config: PreTrainedConfig, **overrides: Any) -> "DrafterConfig":
        """Builds a valid drafter config for a target (Llama, Qwen2/3, Mistral and Gemma families).

        The drafter copies the target's block shapes (width, heads, FFN, activation, RoPE) and fingerprint;
        `overrides` set any field of the class, e.g. `num_hidden_layers=2, block_size=7, sequential_head="markov"`
        for a `DSparkConfig`.
        """
        if not isinstance(target_config, PreTrainedConfig):
            raise TypeError(f"`target_config` must be a transformers PreTrainedConfig, got {type(target_config)}.")
        text = target_config.get_text_config(decoder=True)
        model_type = text.model_type
        num_heads = text.num_attention_heads
        hidden_act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"
        rope = getattr(text, "rope_parameters", None)
        if isinstance(rope, dict) and "full_attention" in rope:  # Gemma-style per-layer-type RoPE
            rope = rope["full_attention"]
        fields = dict(
            target_model_type=model_type,
            hidden_size=text.hidden_size,
            num_target_layers=text.num_hidden_layers,
            vocab_size=text.vocab_size,
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
            intermediate_size=text.intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=full_attention_value(text, "num_key_value_heads") or num_heads,
            head_dim=full_attention_value(text, "head_dim") or text.hidden_size // num_heads,
            hidden_act=hidden_act,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_parameters=dict(rope) if rope else None,
            max_position_embeddings=getattr(text, "max_position_embeddings", 8192),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            use_qk_norm=model_type in _QK_NORM_FAMILIES,
            final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
        )
        fields.update(cls.target_defaults(text))
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"Unknown {cls.__name__} field(s) {sorted(unknown)}.")
        fields.update(overrides)
        return cls(**fields)

    def record_target(self, target, tokenizer=None, revision: str | None = None) -> None:
        """Store where the target came from and hashes of its tokenizer (checked at load and generate time).

        `revision` defaults to the Hub commit of the target's snapshot when it was loaded from the HF cache.
        """
        self.target_name_or_path = getattr(target.config, "_name_or_path", None) or None
        self.target_revision = revision or snapshot_revision(self.target_name_or_path)
        if tokenizer is not None:
            self.target_tokenizer_hash, self.target_chat_template_hash = tokenizer_hashes(tokenizer)

    def check_target(self, target_config: PreTrainedConfig, tokenizer=None) -> None:
        """Raise `ValueError` if the target (and tokenizer, when given) is not what this drafter was made for.

        A different chat template only warns: the drafter still matches the vocabulary, but acceptance may drop.
        """
        text = target_config.get_text_config(decoder=True)
        found = {
            "model_type": text.model_type,
            "hidden_size": text.hidden_size,
            "num_hidden_layers": text.num_hidden_layers,
            "vocab_size": text.vocab_size,
        }
        wrong = {k: (v, found[k]) for k, v in self.target_fingerprint().items() if found[k] != v}
        # A drafter works with any target of the same shapes; a different family is only worth a warning.
        family = wrong.pop("model_type", None)
        if tokenizer is not None and self.target_tokenizer_hash is not None:
            vocab_hash, template_hash = tokenizer_hashes(tokenizer)
            if vocab_hash != self.target_tokenizer_hash:
                wrong["tokenizer vocabulary"] = (self.target_tokenizer_hash[:12], vocab_hash[:12])
            elif self.target_chat_template_hash is not None and template_hash != self.target_chat_template_hash:
                logger.warning_once(
                    "The tokenizer's chat template differs from the one this drafter was trained with; "
                    "outputs stay lossless, but acceptance may be lower."
                )
        if wrong:
            detail = ", ".join(f"{k}: drafter expects {a}, target has {b}" for k, (a, b) in wrong.items())
            raise ValueError(
                f"This {self.model_type} drafter was made for another target ({detail}). Load the drafter trained "
                f"for this target, or build one with {type(self).__name__}.for_target(target.config)."
            )
        if family is not None:
            logger.warning_once(
                f"A {self.model_type} drafter made for a {family[0]!r} target is used with a {family[1]!r} target."
            )

    def target_fingerprint(self) -> dict[str, Any]:
        """The target properties this drafter was built for."""
        return {
            "model_type": self.target_model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_target_layers,
            "vocab_size": self.vocab_size,
        }


@strict
class DSparkConfig(DrafterConfig):
    r"""
    Configuration for [`DSparkDraftModel`]: the fields of [`DrafterConfig`] plus

    DSpark:
        block_size (`int`): γ. The anchor slot predicts the first draft token, so γ input slots give γ draft
            tokens and the target verifies γ + 1 positions.
        mask_token_id (`int`, *optional*): vocabulary token used for the γ-1 mask slots; `None` learns a mask
            embedding instead.
        sequential_head (`str`): `"markov"` (low-rank bias `W1[x_{k-1}] W2`), `"gated_markov"`, `"rnn"`, or `"none"`
            (the DFlash baseline).
        markov_rank (`int`): rank r of the sequential head.
        confidence_head (`bool`): whether the drafter predicts per-position acceptance.
        confidence_with_markov (`bool`): feed `W1[x_{k-1}]` to the confidence head next to `h_k`.
        sts_temperatures (`list[float]`): per-position Sequential Temperature Scaling temperatures (default 1.0).
        verify_policy (`str`): how many drafts to verify each round inside `generate()`: `"threshold"` (stop at
            the first position whose calibrated cumulative survival falls below `confidence_threshold`), `"fixed"`
            (always the whole block) or `"scheduler"` (Algorithm 1 with a profiled cost curve).
        confidence_threshold (`float`): survival threshold of the `"threshold"` policy.
        draft_gate (`bool`): under `"scheduler"`, skip a round's draft pass when it is not expected to pay for itself
            (`gate.DraftGate`: the round is then a plain decoding step); False drafts every round.
        draft_layer (`str`): the draft layer's layout. `"llama"`: Llama blocks, with per-head QK-norm when
            `use_qk_norm` (DeepSpec's `Qwen3DSparkModel` layer). `"gemma4"`: DeepSpec's `Gemma4DSparkModel` layer
            (sandwich norms, Gemma-4 RMSNorm, a scale-free value norm, attention scale 1.0, a `layer_scalar`), the
            default for Gemma-4 targets; `head_dim` / `num_key_value_heads` are then the target's full-attention
            (global) ones.
        attention_k_eq_v (`bool`): Gemma-4 layout only: values are the raw key projection (no `v_proj`), as in
            Gemma-4 targets with `attention_k_eq_v`.
        draft_vocab_size (`int`): 0 drafts over the whole vocabulary; N > 0 drafts only among N token ids (the
            `draft_vocab_ids` buffer of the checkpoint, set with `DSparkDraftModel.set_draft_vocab`), so the LM head
            and the sequential head compute N columns. Verification stays exact: a token outside them is simply
            never drafted.
        tree_budget (`int` or `"auto"`): 0 drafts a chain (the block, one token per position); N > 0 drafts a
            token tree of at most N nodes per row, grown best-first by estimated path acceptance and verified in one
            target forward (greedy and seeded sampling rows; see docs/trees.md). The verify policy then chooses how
            many of the tree's best nodes to verify. At most `MAX_TREE_BUDGET` (128): each node is one more verified
            position. `"auto"` (the shipped drafter's setting): a tree of `AUTO_TREE_BUDGET` (16) nodes in rounds
            that can price and verify one (the "scheduler" policy, no sliding-window layers in the target, no row
            sampling with `sampling="standard"`) on a target whose profile makes width cheap enough
            (`AUTO_TREE_WIDTH_COST`), a chain otherwise; the tokens are the same either way.
        tree_calibration (`list`, *optional*): how a tree prices its nodes. None: a node's estimate is its draft
            probability. Otherwise, per draft depth k (block_size lists), one [scale, shift] pair per child rank j
            (by draft probability; ranks past the last use the last pair): the estimate that the target's greedy
            token is that child, given its parent accepted, is sigmoid(scale · logit(p) + shift) of its draft
            probability p. Fitted by `dspark-hf calibrate` (docs/trees.md); greedy rows only, not exported.
        context_window (`int`, *optional*): a block anchored at position a attends to the target features of the
            `context_window` positions before it (a - W .. a - 1) and no further, in training and in decoding, so
            the draft pass's cost and behaviour stop depending on the prompt's length (the drafter cache keeps only
            that many entries). None: the whole context, as DeepSpec and DFlash train and the engines serve.
            Deviation from DeepSpec: the engines' draft layer has no such window, so export refuses it.
        context_lookup (`int`): decoding only. When the last `context_lookup` or more tokens of a row occurred
            earlier in its sequence (prompt included), the tokens that followed them there are a second chain; the
            round drafts whichever chain is expected to be accepted further (`decoding/lookup.py`: copying from a
            long document or code the drafter's window cannot see). 1..8; 0: the drafter's chains only. With
            `tree_budget`, the continuation is grafted into the tree as one more path; not exported (the engines
            run their own n-gram drafting).
    """

    model_type = "dspark"

    # DSpark
    mask_token_id: int | None = None
    sequential_head: str = "markov"
    markov_rank: int = 256
    confidence_head: bool = True
    confidence_with_markov: bool = True
    sts_temperatures: list[float | int] | None = None
    verify_policy: str = "threshold"
    confidence_threshold: float | int = 0.1
    draft_gate: bool = True
    draft_vocab_size: int = 0
    tree_budget: int | str = 0
    tree_calibration: list | None = None
    draft_layer: str = "llama"
    attention_k_eq_v: bool = False
    context_window: int | None = None
    context_lookup: int = 3

    def __post_init__(self, **kwargs):
        if self.sts_temperatures is None:
            self.sts_temperatures = [1.0] * self.block_size
        self.sts_temperatures = [float(t) for t in self.sts_temperatures]
        super().__post_init__(**kwargs)

    @property
    def layer_types(self) -> list[str]:
        # diff with Llama: every draft layer is full, non-causal attention over context + block
        return ["full_attention"] * self.num_hidden_layers

    def validate_architecture(self):
        """Checks every DSpark field and raises `ValueError` naming the bad value and the fix."""
        super().validate_architecture()
        if self.sequential_head not in SEQUENTIAL_HEADS:
            raise ValueError(
                f"Unknown `sequential_head={self.sequential_head!r}`; choose one of {list(SEQUENTIAL_HEADS)} "
                '("none" is the DFlash baseline).'
            )
        if self.draft_layer not in DRAFT_LAYERS:
            raise ValueError(f"Unknown `draft_layer={self.draft_layer!r}`; choose one of {list(DRAFT_LAYERS)}.")
        if self.attention_k_eq_v and self.draft_layer != "gemma4":
            raise ValueError(
                f"`attention_k_eq_v=True` needs `draft_layer='gemma4'` (got {self.draft_layer!r}); the Llama layout "
                "always has a `v_proj`."
            )
        if self.sequential_head != "none" and self.markov_rank < 1:
            raise ValueError(
                f"`markov_rank` must be >= 1 with sequential_head={self.sequential_head!r}, got {self.markov_rank}."
            )
        if self.confidence_head and self.confidence_with_markov and self.sequential_head == "none":
            raise ValueError(
                "`confidence_with_markov=True` needs a sequential head's token embedding, but sequential_head='none'. "
                "Set confidence_with_markov=False or choose a sequential head."
            )

    def check_runtime_settings(self, drafter=None) -> None:
        """`DrafterConfig.check_runtime_settings` for every DSpark setting decoding reads: the verify policy and
        its threshold, the draft gate, trees, lookup drafts, the context window, the STS temperatures (one per block
        position), the draft vocabulary and the mask token. With `drafter`, the settings its weights fix (draft
        vocabulary, mask token, sequential and confidence heads) must describe it: they are changed by building or
        loading another drafter (or `set_draft_vocab`), never on the config of a live one."""
        super().check_runtime_settings(drafter)
        check_dspark_settings(self, drafter)

    @classmethod
    def target_defaults(cls, text_config: PreTrainedConfig) -> dict[str, Any]:
        """The family's mask token, when the vocabulary has it (tiny test models of the family may not), and for
        Gemma-4 targets DeepSpec's Gemma-4 draft layer (the released `Gemma4DSparkModel` layout)."""
        mask_id = _KNOWN_MASK_TOKENS.get(text_config.model_type)
        defaults = {"mask_token_id": mask_id if mask_id is not None and mask_id < text_config.vocab_size else None}
        if text_config.model_type in _GEMMA4_FAMILIES:
            k_eq_v = bool(getattr(text_config, "attention_k_eq_v", False))
            defaults.update(draft_layer="gemma4", attention_k_eq_v=k_eq_v, use_qk_norm=True)
        return defaults

    @classmethod
    def for_target(cls, target_config: PreTrainedConfig, exportable: bool = True, **overrides: Any) -> "DSparkConfig":
        """`DrafterConfig.for_target`, by default for a drafter that every export format can carry.

        With `exportable=True` (the default) a drafter for a non-Gemma target gets the engines' Qwen3 draft layer:
        per-head QK-norm (`use_qk_norm=True`) and a vocabulary mask token (the family's known one, else
        `default_mask_token_id`), which `dspark-hf export` needs for DeepSpec (SGLang), speculators (vLLM) and
        GGUF (llama.cpp). `exportable=False` keeps the target family's own attention (QK-norm only where the family
        has it) and learns a mask embedding where the family has no known mask token. Gemma-family drafters are
        not exportable either way (see `integrations.export.export_blockers`). Explicit `overrides` always win. With
        `sequential_head="none"` (the DFlash mode) the confidence head reads h_k alone, so `confidence_with_markov`
        defaults to False there; `draft_layer="llama"` for a Gemma-4 target also drops its K = V default.
        """
        if overrides.get("sequential_head") == "none":
            overrides.setdefault("confidence_with_markov", False)
        if overrides.get("draft_layer") == "llama":
            overrides.setdefault("attention_k_eq_v", False)
        if exportable and isinstance(target_config, PreTrainedConfig):
            text = target_config.get_text_config(decoder=True)
            if not text.model_type.startswith("gemma") and getattr(text, "final_logit_softcapping", None) is None:
                defaults: dict[str, Any] = {"use_qk_norm": True}
                if cls.target_defaults(text)["mask_token_id"] is None:
                    defaults["mask_token_id"] = default_mask_token_id(text)
                overrides = {**defaults, **overrides}
        return super().for_target(target_config, **overrides)


def default_mask_token_id(text_config: PreTrainedConfig) -> int:
    """The mask token of an exportable drafter whose target family has none: the last vocabulary id that is not the
    bos/eos/pad token (an unused padding row or reserved token in many vocabularies, else a rare late BPE merge)."""
    special = set()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(text_config, name, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])
    token = text_config.vocab_size - 1
    while token in special:
        token -= 1
    return token


__all__ = [
    "LONGEST_LOOKUP",
    "MAX_TREE_BUDGET",
    "VERIFY_POLICIES",
    "DSparkConfig",
    "DrafterConfig",
    "default_mask_token_id",
    "default_target_layer_ids",
    "full_attention_value",
    "tokenizer_hashes",
]
