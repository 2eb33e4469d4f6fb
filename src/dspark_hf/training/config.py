"""`DSparkTrainingConfig`: one typed config for `dspark-hf train`, from JSON/YAML files plus CLI overrides."""

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


DRAFTER_KINDS = ("dspark", "eagle3")
DRAFTER_MODEL_TYPES = ("dspark", "dspark_eagle3")  # `model_type` of their configs


@dataclass
class DSparkTrainingConfig:
    """Settings of one training run, grouped by concern.

    Data: `data` (a token dataset written by `dspark-hf data`, `.npz`), `seq_len`, `batch_size`, `num_anchors`;
        `features` (offline mode: the target features of `data`, cached by `dspark-hf features`).
    Drafter: `init_drafter` (continue from a trained checkpoint: a curriculum's next stage, fine-tuning),
        `drafter_config` (a hub_configs JSON, optional) or `drafter_kind` ("dspark", or "eagle3" for the EAGLE-3
        baseline) with the shape fields `num_hidden_layers`, `block_size`, and for DSpark `markov_rank`,
        `sequential_head`, `confidence_head`.
    Optimisation: AdamW (`learning_rate`, `weight_decay`), `warmup_ratio` then cosine decay to 0 over `max_steps`
        (or over the steps that fit in `max_time` seconds), `grad_clip`, `mixed_precision` ("no" or "bf16").
    Speed: `train_vocab_size` restricts the training-time output to a shortlist of frequent tokens, which
        `shortlist_draft_vocab` also saves as the checkpoint's draft vocabulary.
    Loss: `alpha_ce`, `alpha_tv`, `alpha_conf`, `loss_decay` (DeepSpec: 0.1 / 0.9 / 1.0, decay 4.0); `alpha_kl`
        adds the forward KL to the target's distribution (0 in the paper's recipe). `distil_from` distils another
        drafter instead: the L1 and KL terms then match its block distributions.
    Run: `output_dir`, `save_every`, `log_every`, `seed`, `target` (a model path; None = the embedded default).
    """

    data: str = field(
        default="", metadata={"help": "token dataset (.npz) from `dspark-hf data`; several: comma-separated"}
    )
    features: str | None = field(
        default=None,
        metadata={"help": "offline mode: a feature cache from `dspark-hf features` (training never runs the target)"},
    )
    heldout: str | None = field(
        default=None, metadata={"help": "held-out token dataset(s) (.npz, comma-separated) for evaluation"}
    )
    eval_every: int = field(default=100, metadata={"help": "evaluate on held-out data every N steps"})
    eval_batches: int = field(default=4, metadata={"help": "held-out batches per evaluation (fixed, seeded)"})
    output_dir: str = field(default="runs/dspark", metadata={"help": "checkpoints and logs go here"})
    target: str | None = field(default=None, metadata={"help": "target model path (default: embedded SmolLM2)"})
    drafter_config: str | None = field(default=None, metadata={"help": "DSparkConfig JSON (e.g. hub_configs/*.json)"})
    init_drafter: str | None = field(
        default=None,
        metadata={
            "help": "start from this drafter checkpoint (its config and weights), e.g. an earlier stage's best/"
        },
    )
    distil_from: str | None = field(
        default=None,
        metadata={
            "help": "distil from this drafter checkpoint: the L1/KL terms match its block distributions instead of "
            "the target's (labels and the confidence target stay the target's); e.g. to make an exportable successor "
            "of a drafter"
        },
    )
    drafter_kind: str = field(
        default="dspark", metadata={"help": "dspark | eagle3 (the autoregressive EAGLE-3 baseline, same pipeline)"}
    )
    num_hidden_layers: int | None = field(
        default=None, metadata={"help": "draft layers (default: DSpark 2, EAGLE-3 1)"}
    )
    block_size: int = field(default=7, metadata={"help": "γ: draft tokens per block"})
    markov_rank: int = field(default=64, metadata={"help": "rank of the sequential head"})
    sequential_head: str = field(default="markov", metadata={"help": "markov | gated_markov | rnn | none (DFlash)"})
    confidence_head: bool = field(default=True, metadata={"help": "train a confidence head"})
    init_from_target: bool = field(
        default=True, metadata={"help": "start draft layers from the target's last layers, fc passing the deepest tap"}
    )
    train_vocab_size: int = field(
        default=0,
        metadata={
            "help": "train on the N most frequent supervised tokens (0: the full vocabulary); see vocab_shortlist"
        },
    )
    shortlist_draft_vocab: bool = field(
        default=True,
        metadata={
            "help": "checkpoints draft over the vocabulary they were trained on (set_draft_vocab): the "
            "train_vocab_size shortlist (faster, still lossless), or all tokens when it is 0; false: left as built"
        },
    )
    seq_len: int = field(default=512, metadata={"help": "training sequence length (longer ones are cropped)"})
    context_window: int | None = field(
        default=None,
        metadata={
            "help": "DSpark: each block attends to the W target features before its anchor (DSparkConfig."
            "context_window, saved with the drafter); unset: the drafter's own setting"
        },
    )
    batch_size: int = field(default=4, metadata={"help": "sequences per step and process"})
    num_anchors: int = field(default=64, metadata={"help": "blocks per sequence"})
    learning_rate: float = field(default=6e-4, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = field(default=0.04, metadata={"help": "linear warm-up share of max_steps"})
    max_steps: int = field(default=1000, metadata={"help": "optimiser steps"})
    max_time: float = field(
        default=0.0,
        metadata={
            "help": "seconds this invocation may train (0: no limit); the warm-up and cosine schedule are fitted to "
            "the steps that fit, measured as it runs (e.g. a timed GPU lease)"
        },
    )
    grad_clip: float = field(default=1.0, metadata={"help": "gradient-norm clipping"})
    mixed_precision: str = field(default="no", metadata={"help": "no | bf16"})
    alpha_ce: float = field(default=0.1, metadata={"help": "weight of the cross-entropy term"})
    alpha_tv: float = field(default=0.9, metadata={"help": "weight of the L1 (2·TV) term"})
    alpha_kl: float = field(default=0.0, metadata={"help": "weight of the forward KL(p_t || p_d) term"})
    alpha_conf: float = field(default=1.0, metadata={"help": "weight of the confidence BCE term"})
    loss_decay: float = field(default=4.0, metadata={"help": "position weights exp(-(k-1)/decay)"})
    save_every: int = field(default=100, metadata={"help": "checkpoint every N steps"})
    log_every: int = field(default=10, metadata={"help": "log every N steps"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation and batch sampling"})

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, _checked(f.name, getattr(self, f.name), f.type))
        names = (
            "block_size",
            "batch_size",
            "num_anchors",
            "max_steps",
            "seq_len",
            "save_every",
            "log_every",
            "eval_every",
            "eval_batches",
        )
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.drafter_kind not in DRAFTER_KINDS:
            raise ValueError(f"`drafter_kind` must be one of {list(DRAFTER_KINDS)}, got {self.drafter_kind!r}.")
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"`mixed_precision` must be 'no' or 'bf16', got {self.mixed_precision!r}.")
        if self.max_time < 0:
            raise ValueError(f"`max_time` must be >= 0 seconds (0: no limit), got {self.max_time}.")
        if self.context_window is not None and self.context_window < 1:
            raise ValueError(
                f"`context_window` must be >= 1 (or null for the drafter's own), got {self.context_window}."
            )
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"`warmup_ratio` must lie in [0, 1), got {self.warmup_ratio}.")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DSparkTrainingConfig":
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"Unknown training option(s) {unknown}; valid options: {sorted(known)}.")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> "DSparkTrainingConfig":
        """Load JSON or YAML (`.yaml`/`.yml`), then apply `key=value` overrides (values parsed as JSON if possible).

        A drafter config (`hub_configs/NAME.json`) is accepted too and becomes `drafter_config`.
        """
        values: dict[str, Any] = {}
        if path is not None:
            if not Path(path).is_file():
                raise FileNotFoundError(f"Training config {path}: no such file.")
            text = Path(path).read_text(encoding="utf-8")
            if str(path).endswith((".yaml", ".yml")):
                import yaml

                try:
                    values = yaml.safe_load(text) or {}
                except yaml.YAMLError as err:
                    raise ValueError(f"Training config {path} is not valid YAML: {err}") from None
            else:
                try:
                    values = json.loads(text)
                except json.JSONDecodeError as err:
                    raise ValueError(f"Training config {path} is not valid JSON ({err}).") from None
            if not isinstance(values, dict):
                raise ValueError(
                    f"Training config {path} must hold a mapping of options, not a {type(values).__name__}."
                )
            if values.get("model_type") in DRAFTER_MODEL_TYPES or "target_layer_ids" in values:
                # a drafter config (e.g. hub_configs/NAME.json): train that drafter with default settings
                values = {"drafter_config": str(path)}
        for item in overrides or []:
            if "=" not in item:
                raise ValueError(f"Override {item!r} must look like key=value.")
            key, raw = item.split("=", 1)
            try:
                values[key] = json.loads(raw)
            except json.JSONDecodeError:
                values[key] = raw
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _checked(name: str, value: Any, annotation: Any) -> Any:
    """`value` if it has the field's type (an int is a valid float; a numeric string such as YAML's `6e-4` becomes a
    float; a path becomes a string), else a ValueError naming the option, e.g. `max_steps=abc`."""
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for kind in allowed:
        if kind is str and isinstance(value, os.PathLike):
            return os.fspath(value)
        if kind is type(None) and value is None:
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is float and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        if kind in (int, str, bool) and isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
    names = " or ".join("null" if k is type(None) else k.__name__ for k in allowed)
    raise ValueError(f"`{name}` must be {names}, got {value!r} ({type(value).__name__}).")
