"""DeepSpec interop: load DeepSeek's released DSpark checkpoints and export ours to their layout.

DeepSpec (github.com/deepseek-ai/DeepSpec, the code behind the DSpark paper's Table 1) saves a drafter as
`config.json` + safetensors:

* `config.json` is the *target's* config deep-copied, plus DSpark fields: `architectures=["Qwen3DSparkModel"]`
  (or `"Gemma4DSparkModel"`), `num_hidden_layers` (= draft layers), `num_target_layers`, `block_size`,
  `target_layer_ids`, `mask_token_id`, `num_anchors`, `enable_confidence_head`, `confidence_head_with_markov`,
  `markov_rank` (0 = no sequential head, the DFlash baseline), `markov_head_type` (`vanilla`, `gated`, `rnn`),
  `tie_word_embeddings=false`, `layer_types`. Its `model_type` is the target's (e.g. `"qwen3"`), so the format is
  recognised by `architectures`, never by `model_type`.
* The safetensors hold the full draft state dict: frozen copies `embed_tokens.weight` / `lm_head.weight` of the
  target's, then exactly our key names (`layers.*` Qwen3 decoder layers, `fc`, `hidden_norm`, `norm`,
  `markov_head.{markov_w1,markov_w2,gate_proj,joint_proj}`, `confidence_head.proj`). A top-level `model.` or
  `_orig_mod.` (torch.compile) prefix is accepted and stripped.

Conventions shared by both codebases (DSpark paper §3.1; DeepSpec `create_position_ids`,
`create_dspark_attention_mask`), so weights transfer without any re-indexing:

* Anchor-predicts-first: a block is γ = `block_size` input slots, the anchor token followed by γ-1 copies of
  `mask_token_id`. Slot j (0-based) sits at position `anchor + j` and predicts the token at `anchor + j + 1`, so γ
  slots give γ drafts and the target verifies γ + 1 positions.
* Context: a block anchored at position a sees target features of positions `< a` only (the anchor's own target
  hidden state does not exist yet at inference), plus every slot of its own block, bidirectionally.
* Target features are raw decoder-layer outputs: layer i is transformers' `hidden_states[i + 1]`.
* The sequential head's previous token for slot 0 is the anchor; the confidence head reads `[h_k ; W1[x_{k-1}]]`
  on the post-norm backbone output.

Which drafters map onto which layout (DeepSpec at afdfa7c; vLLM `qwen3_dspark.py` / `gemma4_dspark.py`, the two
DSpark draft architectures vLLM registers for this format):

* `Qwen3DSparkModel` checkpoints load into dspark-hf exactly. Its draft layer is a Llama block with per-head
  QK-norm, so dspark-hf drafters for Qwen3 *and* Llama-family targets (Llama, Mistral, Qwen2, SmolLM2, ...) export
  to it when they were built with `use_qk_norm=True` and a vocabulary `mask_token_id`. For a non-Qwen3 target the
  exported `config.json` has `model_type="qwen3"` (the draft layers are Qwen3 layers, as in other Qwen3DSparkModel
  drafters for non-Qwen targets) and records the target family in `target_model_type`. vLLM's Qwen3DSparkModel
  builds only the vanilla Markov head, so `gated_markov` / `rnn` exports load in DeepSpec but not in vLLM.
* `Gemma4DSparkModel` checkpoints (DeepSeek's `dspark_gemma4_12b_block7`) load exactly into a drafter with
  `draft_layer="gemma4"` (`modeling_dspark_gemma4`: sandwich norms, a scale-free value norm, optional shared K=V
  projections, a `layer_scalar`, attention scale 1.0; the sqrt(d) embedding scale is the Gemma-4 target's own
  embedding module). DeepSpec's config.json is the target's Gemma-4 *text* config: the draft layers use its
  `global_head_dim` and, with `attention_k_eq_v`, `num_global_key_value_heads`, read from the raw file (transformers
  5.2x turns them into per-layer overrides). dspark-hf drafters of that layout for Gemma-4 targets export back to it;
  other Gemma-family drafters (Llama layout, or Gemma 2/3 targets) are not exported (Qwen3DSparkModel would drop
  their sqrt(d) embedding scale and logit soft-capping).

`import dspark_hf` makes `AutoModel.from_pretrained` return a `DSparkDraftModel` for DeepSpec folders and repos
(see `registration.py`); without that import transformers reads `model_type` and builds a plain target-family model.
"""

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PreTrainedConfig
from transformers.utils import logging

from ..models.configuration_dspark import _GEMMA4_FAMILIES, DSparkConfig
from ..models.modeling_dspark import DSparkDraftModel
from ..utils.checkpoints import check_checkpoint_files, read_config_file
from ..utils.files import check_folder_free
from .export import window_blockers, window_refusal, write_folder


logger = logging.get_logger(__name__)

QWEN3_ARCHITECTURE = "Qwen3DSparkModel"
GEMMA4_ARCHITECTURE = "Gemma4DSparkModel"
# DeepSpec `markov_head_type` <-> our `sequential_head`; `markov_rank == 0` is DeepSpec's "no head" (DFlash).
HEAD_TYPES = {"vanilla": "markov", "gated": "gated_markov", "rnn": "rnn"}
BORROWED_KEYS = ("embed_tokens.weight", "lm_head.weight")
# DeepSpec's training default; only its trainer reads it, but its model constructor requires the field.
DEFAULT_NUM_ANCHORS = 512
# Fields DeepSpec adds to the copied target config (plus `layer_types`, `num_hidden_layers`, re-set on export).
_DSPARK_FIELDS = (
    "num_target_layers",
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "num_anchors",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "markov_rank",
    "markov_head_type",
    "target_model_type",
    "target_text_model_type",
)
# dspark-hf fields DeepSpec has no place for; exported under this key (DeepSpec ignores it) and read back.
EXTRAS_KEY = "dspark_hf"
_EXTRA_FIELDS = (
    "sts_temperatures",
    "verify_policy",
    "confidence_threshold",
    "target_name_or_path",
    "target_revision",
    "target_tokenizer_hash",
    "target_chat_template_hash",
)
_PREFIXES = ("_orig_mod.", "model.")
# target fields a DeepSpec config.json must carry: without them the rebuilt target config takes its family's defaults
_TARGET_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "intermediate_size")
# `revision`, `local_files_only`, `cache_dir` and `token` only matter while resolving a Hub id
# (`resolve_deepspec_folder`).
_LOAD_KWARGS = (
    "dtype",
    "attn_implementation",
    "target",
    "tokenizer",
    "subfolder",
    "revision",
    "local_files_only",
    "cache_dir",
    "token",
    "use_safetensors",
)
# What a DeepSpec repo needs downloaded (DeepSpec also uploads `train_config.py`, which loading never reads).
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors"]


def is_deepspec_config(config: dict) -> bool:
    """True for a DeepSpec draft `config.json`: an architecture ending in "DSparkModel" and not our model_type."""
    architectures = config.get("architectures") or []
    return any(str(a).endswith("DSparkModel") for a in architectures) and config.get("model_type") != "dspark"


def _require(config: dict, *names: str) -> None:
    missing = [n for n in names if n not in config]
    if missing:
        raise ValueError(f"DeepSpec config lacks the DSpark field(s) {missing}; is it a DeepSpec draft config.json?")


def _target_config(config: dict) -> PreTrainedConfig:
    """Rebuild the target's config from the deep-copied fields (with the target's depth, not the drafter's)."""
    fields = {k: v for k, v in config.items() if k not in _DSPARK_FIELDS and k not in (EXTRAS_KEY, "architectures")}
    # per_layer_config (a config.json saved by transformers 5.2x) is keyed by draft layers, not the target's
    for key in ("model_type", "transformers_version", "layer_types", "tie_word_embeddings", "per_layer_config"):
        fields.pop(key, None)  # layer_types describes the draft layers, not the target's
    fields["num_hidden_layers"] = int(config["num_target_layers"])
    model_type = config.get("model_type") or ""
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError:  # a model type this transformers does not know: keep the fields as plain attributes
        target = PreTrainedConfig(**fields)
        target.model_type = model_type
        return target


def _gemma4_global_attention(config: dict) -> tuple[int, int | None]:
    """(head size, KV heads) of a DeepSpec Gemma-4 draft layer, from the raw config.json: `global_head_dim` and
    `num_global_key_value_heads` (transformers <= 5.1x), or the per-layer overrides transformers 5.2x saves
    instead (every draft layer is a full-attention layer, so any entry)."""
    override = next(iter((config.get("per_layer_config") or {}).values()), {})
    head_dim = config.get("global_head_dim", override.get("head_dim"))
    kv_heads = config.get("num_global_key_value_heads", override.get("num_key_value_heads"))
    if head_dim is None:
        raise ValueError("DeepSpec Gemma4 config lacks `global_head_dim`, the head size of its draft layers.")
    return int(head_dim), None if kv_heads is None else int(kv_heads)


def _gemma4_fields(config: dict) -> dict[str, Any]:
    """The `draft_layer="gemma4"` fields of a DeepSpec `Gemma4DSparkModel` config (DeepSpec gemma4/modeling.py)."""
    if int(config.get("hidden_size_per_layer_input") or 0) or config.get("enable_moe_block"):
        raise ValueError(
            "This Gemma4DSparkModel config asks for per-layer inputs or MoE blocks, which DeepSpec's Gemma-4 draft "
            "layer does not have; was config.json edited?"
        )
    if config.get("use_double_wide_mlp") and int(config.get("num_kv_shared_layers") or 0):
        raise ValueError(
            "Gemma4DSparkModel configs with KV-shared layers and double-wide MLPs (`use_double_wide_mlp`, "
            "`num_kv_shared_layers`) are not supported: dspark-hf's Gemma-4 draft layers have one MLP width."
        )
    head_dim, global_kv = _gemma4_global_attention(config)
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    kv_heads = global_kv if k_eq_v else config.get("num_key_value_heads")
    if kv_heads is None:
        raise ValueError("DeepSpec Gemma4 config lacks the KV head count of its draft layers.")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    return dict(
        draft_layer="gemma4",
        attention_k_eq_v=k_eq_v,
        head_dim=head_dim,
        num_key_value_heads=int(kv_heads),
        hidden_act=act,
    )


def dspark_config_from_deepspec(config: dict) -> DSparkConfig:
    """Map a DeepSpec draft `config.json` (a dict) onto a `DSparkConfig`.

    Target fingerprint and backbone shapes (hidden size, vocabulary, bos/eos/pad, heads, FFN, RoPE, soft-capping)
    come from the copied target fields through `DSparkConfig.for_target`; the DSpark fields are mapped one to one
    (`markov_head_type` vanilla/gated/rnn -> markov/gated_markov/rnn, `markov_rank=0` -> "none"). DeepSpec's
    Qwen3 attention always applies per-head QK-norm, so `use_qk_norm=True` whatever the target family.
    `Gemma4DSparkModel` configs get `draft_layer="gemma4"` and the global head size / KV heads of the raw file.
    """
    if not is_deepspec_config(config):
        raise ValueError(
            f"Not a DeepSpec DSpark config (architectures={config.get('architectures')}, "
            f"model_type={config.get('model_type')!r})."
        )
    _require(config, "num_target_layers", "num_hidden_layers", "block_size", "target_layer_ids", "mask_token_id")
    missing = [name for name in _TARGET_FIELDS if name not in config]
    if missing:
        raise ValueError(
            f"DeepSpec config lacks the target field(s) {missing}, which size the draft layers and the vocabulary; "
            "DeepSpec copies them from the target's config.json: copy them back."
        )
    _require(config, "markov_rank", "enable_confidence_head")
    rank = int(config["markov_rank"])
    if rank > 0:
        _require(config, "markov_head_type")
        head_type = str(config["markov_head_type"]).lower()
        if head_type not in HEAD_TYPES:
            raise ValueError(f"Unknown DeepSpec `markov_head_type={head_type!r}`; expected one of {list(HEAD_TYPES)}.")
    confidence = bool(config["enable_confidence_head"])
    if confidence:
        _require(config, "confidence_head_with_markov")
    layer_ids = [int(i) for i in config["target_layer_ids"]]
    if -1 in layer_ids:
        raise ValueError(
            f"`target_layer_ids={layer_ids}` taps the embedding output (-1), which dspark-hf's feature tap does not "
            "support."
        )
    fields = dict(
        num_hidden_layers=int(config["num_hidden_layers"]),
        block_size=int(config["block_size"]),
        target_layer_ids=layer_ids,
        mask_token_id=int(config["mask_token_id"]),
        sequential_head=HEAD_TYPES[str(config["markov_head_type"]).lower()] if rank > 0 else "none",
        markov_rank=rank,
        confidence_head=confidence,
        # DeepSpec writes this field only when the confidence head exists
        confidence_with_markov=bool(config.get("confidence_head_with_markov", False)),
        use_qk_norm=True,  # diff with for_target: DeepSpec's attention always has q_norm/k_norm, whatever the target
        tie_word_embeddings=False,
    )
    if GEMMA4_ARCHITECTURE in config["architectures"]:
        fields.update(_gemma4_fields(config))
    fields.update({k: v for k, v in (config.get(EXTRAS_KEY) or {}).items() if k in _EXTRA_FIELDS})
    family = config.get("target_text_model_type") or config.get("target_model_type")
    if family:  # exported for a non-Qwen3 target: config.json says "qwen3" (its draft layers), the target is this
        fields["target_model_type"] = str(family)
    return DSparkConfig.for_target(_target_config(config), **fields)


def _strip_prefix(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
    return key


def convert_deepspec_state_dict(state_dict: dict[str, torch.Tensor]):
    """Split a DeepSpec draft state dict into `(ours, borrowed)`.

    Prefixes `_orig_mod.` and `model.` are stripped; `borrowed` holds the frozen target copies
    (`embed_tokens.weight`, `lm_head.weight`), which dspark-hf takes from the live target instead. The other keys
    already carry our names and are returned unchanged.
    """
    ours, borrowed = {}, {}
    for key, tensor in state_dict.items():
        name = _strip_prefix(key)
        out = borrowed if name in BORROWED_KEYS else ours
        if name in out:
            raise ValueError(f"DeepSpec state dict has {name!r} twice (with and without a prefix, e.g. {key!r}).")
        out[name] = tensor
    return ours, borrowed


def _read_config(folder: Path) -> dict:
    """`folder/config.json` as a dict; a missing, non-JSON or non-object file is an error naming it."""
    if not (folder / "config.json").is_file():
        raise OSError(f"No config.json in {folder}; it is not a DeepSpec checkpoint folder.")
    return read_config_file(folder / "config.json")


def _read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` shard (safetensors only; pickle folders are refused)."""
    check_checkpoint_files(folder, {})
    state_dict = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        repeated = sorted(set(tensors) & set(state_dict))
        if repeated:
            raise ValueError(f"{shard.name} repeats tensors of another shard: {repeated[:5]}.")
        state_dict.update(tensors)
    return state_dict


def _check_keys(model: DSparkDraftModel, ours: dict, borrowed: dict, folder: Path) -> None:
    """Strict: every drafter weight present with the right shape, nothing unknown."""
    expected = model.state_dict()
    unknown, missing = sorted(set(ours) - set(expected)), sorted(set(expected) - set(ours))
    if unknown or missing:
        raise ValueError(
            f"The DeepSpec checkpoint at {folder} does not match its config.json: unknown weight(s) {unknown}, "
            f"missing weight(s) {missing}. Was config.json edited, or the checkpoint saved by another DeepSpec "
            "version?"
        )
    wrong = [
        f"{k}: {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in ours.items() if v.shape != expected[k].shape
    ]
    config = model.config
    for key, shape in zip(BORROWED_KEYS, [(config.vocab_size, config.hidden_size)] * 2):
        if key in borrowed and tuple(borrowed[key].shape) != shape:
            wrong.append(f"{key}: {tuple(borrowed[key].shape)} vs {shape}")
    if wrong:
        raise ValueError(f"The DeepSpec checkpoint at {folder} has weights of the wrong shape: {wrong[:5]}.")


def _check_borrowed(borrowed: dict, target) -> None:
    """The frozen copies should equal the target's: a mismatch means another target (e.g. a fine-tune)."""
    pairs = zip(BORROWED_KEYS, (target.get_input_embeddings(), target.get_output_embeddings()))
    for key, module in pairs:
        if key in borrowed and module is not None:
            theirs = module.weight.detach().to(device="cpu", dtype=borrowed[key].dtype)
            if theirs.shape != borrowed[key].shape or not torch.equal(theirs, borrowed[key]):
                logger.warning_once(
                    f"The DeepSpec drafter's copy of `{key}` differs from the target's: it was trained with another "
                    "target. Outputs stay lossless, but acceptance may be lower."
                )


def load_deepspec_checkpoint(path: str | os.PathLike, **kwargs: Any) -> DSparkDraftModel:
    """Load a local DeepSpec DSpark checkpoint folder as a `DSparkDraftModel` (in eval mode).

    Keyword arguments: `dtype` (default: the checkpoint's dtype), `attn_implementation`, `subfolder`, and
    `target=` / `tokenizer=` to check the pairing at load time (as `DSparkDraftModel.from_pretrained` does). The
    frozen `embed_tokens` / `lm_head` copies are checked for shape (and against `target`, if given) and dropped.
    """
    unsupported = sorted(set(kwargs) - set(_LOAD_KWARGS))
    if unsupported:
        raise TypeError(f"Loading a DeepSpec checkpoint supports only {list(_LOAD_KWARGS)}; got {unsupported}.")
    if kwargs.get("use_safetensors") is False:
        raise ValueError("DeepSpec checkpoints load from safetensors only; drop `use_safetensors=False`.")
    folder = Path(path) / (kwargs.get("subfolder") or "")
    config = dspark_config_from_deepspec(_read_config(folder))
    if kwargs.get("attn_implementation"):
        config._attn_implementation = kwargs["attn_implementation"]
    ours, borrowed = convert_deepspec_state_dict(_read_state_dict(folder))
    model = DSparkDraftModel(config)
    _check_keys(model, ours, borrowed, folder)
    model.load_state_dict(ours, strict=True)
    dtype = kwargs.get("dtype")
    if dtype is None or dtype == "auto":  # like transformers' default: keep the dtype the weights were saved in
        dtype = next(iter(ours.values())).dtype
    model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    model.config.name_or_path = str(path)
    target = kwargs.get("target")
    if target is not None:
        model.config.check_target(target.config, kwargs.get("tokenizer"))
        _check_borrowed(borrowed, target)
    return model.eval()


def resolve_deepspec_folder(path: str | os.PathLike, kwargs: dict) -> Path | None:
    """The local folder of a DeepSpec checkpoint at `path`: a folder, or a Hub repo id (from the local cache, else
    downloaded unless `local_files_only` / `HF_HUB_OFFLINE`; only `*.json` and `*.safetensors` files).

    Reads `subfolder`, `revision`, `cache_dir`, `token` and `local_files_only` from `kwargs`. Returns None when `path`
    is not a DeepSpec checkpoint or cannot be resolved, so that the caller falls back to its ordinary loading path
    (which then reports a missing repo or a network error itself).
    """
    sub = kwargs.get("subfolder") or ""
    local = Path(path)
    if local.is_dir():
        config_path = local / sub / "config.json"
        return local if config_path.is_file() and is_deepspec_config(_read_config(local / sub)) else None
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo, hub = str(path), {k: kwargs.get(k) for k in ("revision", "cache_dir", "token")}
    try:
        try:
            config_file = hf_hub_download(repo, "config.json", subfolder=sub or None, local_files_only=True, **hub)
            cached = True
        except LocalEntryNotFoundError:
            if kwargs.get("local_files_only"):
                return None
            # the file transformers would fetch first anyway; raises (caught below) when offline
            config_file = hf_hub_download(repo, "config.json", subfolder=sub or None, **hub)
            cached = False
        if not is_deepspec_config(json.loads(Path(config_file).read_text(encoding="utf-8"))):
            return None
        return Path(snapshot_download(repo, allow_patterns=_DOWNLOAD_PATTERNS, local_files_only=cached, **hub))
    except (HFValidationError, OSError):  # not a repo id, no such repo, no network: not ours to report
        return None


def _window_reasons(config: DSparkConfig) -> list[str]:
    """The context window among the reasons a drafter's weights do not export (it alone would not stop them)."""
    blockers = window_blockers(config)
    return [f"`{field}` = {reason} (drop_context_window=True exports without it)" for field, reason in blockers]


def _check_exportable_gemma4(config: DSparkConfig) -> None:
    """Raise `ValueError` for `draft_layer="gemma4"` drafters that Gemma4DSparkModel cannot represent exactly."""
    reasons = []
    if config.target_model_type not in _GEMMA4_FAMILIES:
        reasons.append(f"it was made for a {config.target_model_type!r} target; Gemma4DSparkModel is for Gemma-4")
    if config.mask_token_id is None:
        reasons.append("it learns a mask embedding (`mask_token_id=None`); DeepSpec needs a vocabulary mask token")
    if config.mlp_bias:
        reasons.append("its MLP has biases (`mlp_bias=True`); Gemma-4's has none")
    if reasons:
        reasons += _window_reasons(config)
        raise ValueError(
            "This drafter has no DeepSpec (Gemma4DSparkModel) equivalent: " + "; ".join(reasons) + ". Build it with "
            "DSparkConfig.for_target(<the Gemma-4 target's config>) (mask token 4) and train it, then export it."
        )


def _check_exportable(drafter: DSparkDraftModel, target, drop_context_window: bool = False) -> None:
    """Raise `ValueError` for drafters that DeepSpec's Qwen3DSparkModel / Gemma4DSparkModel cannot represent: weights
    of another layout (to be rebuilt and trained again), or, unless `drop_context_window`, a context window."""
    config = drafter.config
    config.check_target(target.config)
    if config.draft_layer == "gemma4":
        _check_exportable_gemma4(config)
    else:
        _check_exportable_qwen3(config)
    if window_blockers(config) and not drop_context_window:
        raise ValueError(window_refusal(config))


def _check_exportable_qwen3(config: DSparkConfig) -> None:
    """Raise `ValueError` for drafters whose weights Qwen3DSparkModel cannot represent."""
    if config.target_model_type.startswith("gemma") or config.final_logit_softcapping is not None:
        raise ValueError(
            f"This drafter was made for a {config.target_model_type!r} (Gemma-family) target and has no DeepSpec "
            "equivalent in its Llama-style layout. The one Gemma layout of DeepSpec and vLLM, Gemma4DSparkModel "
            "(Gemma-4 targets), has another draft layer (sandwich norms, scale-free value norm, shared K=V "
            "projections, layer_scalar, attention scale 1.0), and Qwen3DSparkModel applies neither Gemma's sqrt(d) "
            "embedding scale nor logit soft-capping, so an engine would draft from another distribution. Serve this "
            "drafter with dspark-hf (`target.generate(..., assistant_model=drafter)`), or, for a Gemma-4 target, "
            "train one with `draft_layer='gemma4'` (DSparkConfig.for_target's default for Gemma-4), which exports."
        )
    reasons = []
    if not config.use_qk_norm:
        reasons.append("it has no QK-norm (`use_qk_norm=False`), which Qwen3DSparkModel always applies")
    if config.mask_token_id is None:
        reasons.append("it learns a mask embedding (`mask_token_id=None`); DeepSpec needs a vocabulary mask token")
    if config.mlp_bias:
        reasons.append("its MLP has biases (`mlp_bias=True`); Qwen3's has none")
    if reasons:
        reasons += _window_reasons(config)
        raise ValueError(
            "This drafter has no DeepSpec (Qwen3DSparkModel) equivalent: " + "; ".join(reasons) + ". Weights cannot "
            "be converted afterwards: build the drafter with DSparkConfig.for_target(target.config, use_qk_norm=True, "
            "mask_token_id=<an unused vocabulary token id>, ...) and train it, then export it."
        )


def _gemma4_layer_fields(config: DSparkConfig, target_fields: dict) -> dict[str, Any]:
    """The Gemma-4 text-config fields DeepSpec's Gemma4DSparkModel reads, for a `draft_layer="gemma4"` drafter.

    The draft layers' head size / KV heads go to `global_head_dim` / `num_global_key_value_heads` (or
    `num_key_value_heads` without K = V), as transformers 5.1x writes them; their RoPE to
    `rope_parameters["full_attention"]`. Per-layer inputs, MoE, KV sharing and double-wide MLPs are switched off: they
    describe the target's layers, and DeepSpec's draft layer has none of them.
    """
    rope = dict(target_fields.get("rope_parameters") or {})
    rope["full_attention"] = dict(config.rope_parameters)
    target_fields.pop("per_layer_config", None)  # keyed by the target's layers; the global fields replace it
    target_fields.pop("hidden_act", None)
    fields = dict(
        architectures=[GEMMA4_ARCHITECTURE],
        target_model_type=config.target_model_type.removesuffix("_text"),  # DeepSpec: the top-level model type
        target_text_model_type=config.target_model_type,
        global_head_dim=config.head_dim,
        num_global_key_value_heads=config.num_key_value_heads,
        attention_k_eq_v=config.attention_k_eq_v,
        hidden_activation=config.hidden_act,
        rope_parameters=rope,
        final_logit_softcapping=config.final_logit_softcapping,
        hidden_size_per_layer_input=0,
        enable_moe_block=False,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
    )
    if not config.attention_k_eq_v:
        fields["num_key_value_heads"] = config.num_key_value_heads
    return fields


def deepspec_config_dict(drafter: DSparkDraftModel, target, num_anchors: int = DEFAULT_NUM_ANCHORS) -> dict:
    """DeepSpec's `config.json` for `drafter`: the target's config dict + the drafter's shapes + DSpark fields."""
    config = drafter.config
    out = target.config.get_text_config(decoder=True).to_dict()
    if config.draft_layer == "gemma4":
        out.update(_gemma4_layer_fields(config, out))
    else:
        if out.get("model_type") != "qwen3":  # a Llama-family target: the draft layers are Qwen3's, see docstring
            out.update(model_type="qwen3", target_model_type=config.target_model_type)
        out.update(
            architectures=[QWEN3_ARCHITECTURE],  # our draft layer is Qwen3's (Llama blocks + QK-norm), see docstring
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            hidden_act=config.hidden_act,
            rope_parameters=config.rope_parameters,
        )
    rank = config.markov_rank if config.sequential_head != "none" else 0
    out.update(
        # the drafter's own backbone shapes (equal to the target's unless overridden at training time)
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
        # DSpark fields, as DeepSpec's build_draft_config writes them
        num_hidden_layers=config.num_hidden_layers,
        num_target_layers=config.num_target_layers,
        block_size=config.block_size,
        target_layer_ids=list(config.target_layer_ids),
        mask_token_id=config.mask_token_id,
        num_anchors=int(num_anchors),
        enable_confidence_head=config.confidence_head,
        confidence_head_with_markov=config.confidence_with_markov,
        markov_rank=rank,
        tie_word_embeddings=False,
        layer_types=list(config.layer_types),
        dtype=str(drafter.dtype).removeprefix("torch."),
    )
    if rank > 0:
        out["markov_head_type"] = {v: k for k, v in HEAD_TYPES.items()}[config.sequential_head]
    out[EXTRAS_KEY] = {k: getattr(config, k) for k in _EXTRA_FIELDS}
    return out


def export_deepspec(
    drafter: DSparkDraftModel,
    target,
    out_dir: str | os.PathLike,
    num_anchors: int = DEFAULT_NUM_ANCHORS,
    overwrite: bool = False,
    drop_context_window: bool = False,
) -> Path:
    """Write `drafter` as a DeepSpec `Qwen3DSparkModel` or `Gemma4DSparkModel` checkpoint (`config.json` +
    `model.safetensors`).

    The state dict is ours plus `embed_tokens.weight` / `lm_head.weight` copied from `target` (in the drafter's
    dtype), as DeepSpec stores them. `draft_layer="gemma4"` drafters of Gemma-4 targets become Gemma4DSparkModel.
    Qwen3DSparkModel is used for every other exportable target (Qwen3, Llama, Mistral, Qwen2, ...): its decoder layer
    is exactly ours with QK-norm, so the drafter needs `use_qk_norm=True`; both need a vocabulary `mask_token_id`;
    other Gemma-family drafters are refused (see the module docstring). `ValueError` says which condition fails.

    A drafter with a `context_window` is refused too, as the format has no sliding window, unless
    `drop_context_window`: then the same weights are written without the window (the drafter itself is unchanged),
    and an engine's drafter attends to the whole context, so on prompts longer than the window its drafts may differ
    from this drafter's (the acceptance with them; never the output).

    A non-empty `out_dir` is refused unless `overwrite`; the folder is written under a temporary name next to
    `out_dir` and renamed into place once complete (`utils.files.write_folder`).
    """
    _check_exportable(drafter, target, drop_context_window)
    check_folder_free(out_dir, overwrite)  # before any conversion work
    if drafter.config.sequential_head in ("gated_markov", "rnn"):
        logger.warning(
            f"Exporting a {drafter.config.sequential_head!r} sequential head: DeepSpec loads it, but vLLM's "
            "Qwen3DSparkModel implements only the vanilla Markov head (`sequential_head='markov'`)."
        )
    if window_blockers(drafter.config):
        window = drafter.config.context_window
        logger.warning(
            f"Exporting without the drafter's context_window ({window}): the DeepSpec format has no sliding window, "
            f"so an engine's drafter attends to the whole context, and on prompts longer than {window} tokens its "
            "drafts may differ from this drafter's (acceptance may drop; the output is the target's either way)."
        )
    dtype = drafter.dtype
    state_dict = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    if state_dict.pop("draft_vocab_ids", None) is not None:
        logger.info("DeepSpec drafts over the whole vocabulary: the draft vocabulary is not exported.")
    borrowed = zip(BORROWED_KEYS, (target.get_input_embeddings(), target.get_output_embeddings()))
    for key, module in borrowed:
        # clone: a tied target shares one tensor between both, which safetensors refuses to store twice
        state_dict[key] = module.weight.detach().to(device="cpu", dtype=dtype).clone().contiguous()
    config = deepspec_config_dict(drafter, target, num_anchors)

    def write(folder: Path) -> None:
        save_file(state_dict, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    return write_folder(out_dir, overwrite, write)


__all__ = [
    "convert_deepspec_state_dict",
    "deepspec_config_dict",
    "dspark_config_from_deepspec",
    "export_deepspec",
    "is_deepspec_config",
    "load_deepspec_checkpoint",
    "resolve_deepspec_folder",
]
