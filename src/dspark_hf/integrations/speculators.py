"""Export a DSpark drafter to the `speculators` format (vllm-project/speculators), the one vLLM loads.

Written from the format as `speculators` 0.9.0 defines it (`DSparkSpeculatorConfig`, `DSparkDraftModel`,
`DraftVocabMixin`); this module writes plain `config.json` + safetensors and never imports `speculators`
(`tools/check_speculators_export.py` loads the result with speculators' own code and compares its outputs).

`config.json`:

* `speculators_model_type="dspark"`, `architectures=["DSparkSpeculator"]`, `speculators_version`, and
  `speculators_config` = {algorithm "dspark", one greedy proposal method of `block_size` speculative tokens,
  `verifier` = the target's name or path and architectures}. vLLM reads the target from there.
* `transformer_layer_config`: a Qwen3 config of the draft layers (the drafter's width, heads, FFN, RoPE, norm eps,
  `num_hidden_layers` = draft layers) whose `vocab_size` is the target's. A bounded context window
  (`context_window` W) is written the way speculators declares one: every layer a "sliding_attention" layer,
  `use_sliding_window`, `sliding_window` = W. speculators' own model then windows exactly as we do (a block anchored
  at a sees the context a - W .. a - 1); the serving engines window per query position (the slot at a + j sees
  context back to a + j - W + 1), so their slot j misses the j + 1 oldest of our W positions: drafts may differ
  there, never the output.
* `sliding_window_non_causal=true`: a block's slots attend to each other both ways (vLLM maps it to a non-causal
  draft layer; in speculators it matters only for sliding layers).
* DSpark fields: `block_size`, `mask_token_id`, `sample_from_anchor=true` (the anchor slot drafts the first token,
  as here and in DeepSpec), `markov_rank` (0 = no sequential head, the DFlash baseline), `markov_head_type`
  (vanilla/gated/rnn for our markov/gated_markov/rnn), `enable_confidence_head`, `confidence_head_with_markov`,
  `draft_vocab_size` (the target's vocabulary size when the drafter drafts over all of it).
* `aux_hidden_state_layer_ids`: speculators numbers target features as transformers' `hidden_states` list does
  (0 = the embedding output), so our `target_layer_ids` (0 = the first decoder layer's output) are written + 1.
* Ours that speculators has no field for, under the extra key `dspark_hf` (speculators keeps unknown keys):
  STS temperatures, verify policy and threshold, target fingerprint (model type, depth, vocabulary, tokenizer and
  chat-template hashes, name and revision), and our own `target_layer_ids`.

`model.safetensors`: our key names already are speculators' (`layers.*` Qwen3 decoder layers, `fc`, `hidden_norm`,
`norm`, `markov_head.{markov_w1,markov_w2,gate_proj,joint_proj}`, `confidence_head.proj`). The embedding and the
full-vocabulary LM head are not stored: speculators reloads them from the verifier. With a draft vocabulary of N
tokens (`draft_vocab_ids`, sorted), the file adds what speculators stores for a reduced vocabulary: `lm_head.weight`
(the target head's N rows), `d2t` (N offsets: target id = draft index + d2t[draft index]) and `t2d` (a boolean mask
over the target vocabulary); `markov_head.markov_w2.weight` keeps only those N rows (its bias lives in draft-vocabulary
space there), while `markov_w1` stays indexed by target token ids.
"""

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.utils import logging

from ..models.modeling_dspark import DSparkDraftModel
from ..utils.devices import below_float16, below_float16_text
from .export import check_exportable, write_folder, write_json


logger = logging.get_logger(__name__)

ENGINE = "vLLM / speculators"
SPECULATORS_VERSION = "0.9.0"  # the speculators release this layout was written for and verified against
ARCHITECTURE = "DSparkSpeculator"
HEAD_TYPES = {"markov": "vanilla", "gated_markov": "gated", "rnn": "rnn"}
EXTRAS_KEY = "dspark_hf"
_EXTRA_FIELDS = (
    "sts_temperatures",
    "verify_policy",
    "confidence_threshold",
    "target_layer_ids",
    "target_model_type",
    "num_target_layers",
    "target_name_or_path",
    "target_revision",
    "target_tokenizer_hash",
    "target_chat_template_hash",
)


def _layer_config(drafter: DSparkDraftModel, target_config) -> dict:
    """The draft layers as a Qwen3 config dict (what `transformer_layer_config` holds)."""
    config = drafter.config
    text = target_config.get_text_config(decoder=True)
    return dict(
        model_type="qwen3",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=config.rope_parameters,
        attention_bias=config.attention_bias,
        attention_dropout=config.attention_dropout,
        **_window_fields(config),
        tie_word_embeddings=False,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
    )


def _window_fields(config) -> dict:
    """The bounded context window (`context_window` W) as speculators declares one: every draft layer a
    "sliding_attention" layer of `sliding_window` W. speculators' DFlash mask then lets a block anchored at a see the
    context positions a - W .. a - 1, as ours does (`models/dflash/attention.py`, `kv_base_pos >= q_anchor - W`)."""
    window = getattr(config, "context_window", None)
    if window is None:
        return dict(use_sliding_window=False, layer_types=list(config.layer_types))
    return dict(
        use_sliding_window=True, sliding_window=window, layer_types=["sliding_attention"] * config.num_hidden_layers
    )


def speculators_config_dict(drafter: DSparkDraftModel, target, verifier: str | None = None) -> dict:
    """The speculators `config.json` of `drafter` (see the module docstring). `verifier`: the target's Hub id or
    path written for vLLM (default: the one the drafter recorded, else the target's `_name_or_path`)."""
    config = drafter.config
    head = config.sequential_head
    rank = config.markov_rank if head != "none" else 0
    verifier = verifier or config.target_name_or_path or getattr(target.config, "_name_or_path", None) or None
    draft_vocab = config.draft_vocab_size or config.vocab_size
    architectures = list(getattr(target.config, "architectures", None) or [])
    out = dict(
        speculators_model_type="dspark",
        speculators_version=SPECULATORS_VERSION,
        architectures=[ARCHITECTURE],
        transformer_layer_config=_layer_config(drafter, target.config),
        draft_vocab_size=draft_vocab,
        block_size=config.block_size,
        target_hidden_size=None,
        aux_hidden_state_layer_ids=[i + 1 for i in config.target_layer_ids],
        mask_token_id=config.mask_token_id,
        sliding_window_non_causal=True,  # a block's slots see each other both ways, windowed or not
        sample_from_anchor=True,
        markov_rank=rank,
        markov_head_type=HEAD_TYPES.get(head, "vanilla"),
        enable_confidence_head=config.confidence_head,
        confidence_head_with_markov=bool(config.confidence_head and config.confidence_with_markov),
        dtype=str(drafter.dtype).removeprefix("torch."),
        speculators_config=dict(
            algorithm="dspark",
            proposal_methods=[dict(proposal_type="greedy", speculative_tokens=config.block_size, verifier_accept_k=1)],
            default_proposal_method="greedy",
            verifier=dict(name_or_path=verifier, architectures=architectures),
        ),
    )
    out[EXTRAS_KEY] = {k: getattr(config, k) for k in _EXTRA_FIELDS}
    return out


def speculators_state_dict(drafter: DSparkDraftModel, target) -> dict[str, torch.Tensor]:
    """The tensors of `model.safetensors` (see the module docstring), on the CPU in the drafter's dtype."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
    ids = state.pop("draft_vocab_ids", None)
    if ids is None:
        return state
    ids = ids.long()
    vocab = drafter.config.vocab_size
    head = target.get_output_embeddings().weight.detach().to(device="cpu", dtype=drafter.dtype)
    state["lm_head.weight"] = head[ids].contiguous()
    if "markov_head.markov_w2.weight" in state:
        state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][ids].contiguous()
    state["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    state["t2d"] = t2d
    return state


def export_speculators(
    drafter: DSparkDraftModel,
    target,
    out_dir: str | os.PathLike,
    verifier: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` as a speculators `dspark` checkpoint folder (`config.json` + `model.safetensors`).

    `target` is the model the drafter drafts for (checked against the drafter's fingerprint; its LM head supplies
    the reduced `lm_head` of a draft vocabulary). `verifier` is the target's Hub id or path recorded for vLLM
    (default: the drafter's `target_name_or_path`). `ValueError` names what the format cannot carry (see
    `integrations.export.export_blockers`); the folder is written under a temporary name and renamed into place.
    """
    drafter.config.check_target(target.config)
    check_exportable(drafter.config, ENGINE)
    if drafter.config.sequential_head in ("gated_markov", "rnn"):
        logger.warning(
            f"Exporting a {drafter.config.sequential_head!r} sequential head: speculators loads it, but check that "
            "your vLLM version runs it (vLLM's DSpark drafter long implemented only the vanilla Markov head)."
        )
    tiny = below_float16(drafter)
    if tiny:
        logger.warning(
            f"Serve this drafter in bfloat16 or float32 (vLLM: --dtype bfloat16): {below_float16_text(tiny)}."
        )
    config = speculators_config_dict(drafter, target, verifier)
    if not config["speculators_config"]["verifier"]["name_or_path"]:
        logger.warning(
            "The target has no name or path to record as the speculators verifier; pass `verifier=` (--verifier) so "
            "that vLLM knows which model to load."
        )
    state = speculators_state_dict(drafter, target)

    def write(tmp: Path) -> None:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        write_json(tmp / "config.json", config)

    return write_folder(out_dir, overwrite, write)


__all__ = ["export_speculators", "speculators_config_dict", "speculators_state_dict"]
