"""The training loop: forward -> loss -> backward -> clip -> step -> schedule -> log -> checkpoint, on accelerate.

Online: the target stays resident and computes features on the fly, so no multi-TB feature cache is needed.
Offline (`features` set): training steps read the same windows' features from a `FeatureCache` and never run the
target's forward (its embedding and LM head are still used; held-out evaluation stays online). One CPU
process or `accelerate launch` with several. Checkpoints are atomic (a finished folder is renamed into place, then
the `latest` pointer is replaced); `resume=True` continues from the newest one with the same batches it would
have seen, because batch sampling is seeded by (seed, step, rank).
"""

import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModel
from transformers.utils import logging

from ..models.configuration_dspark import DSparkConfig
from ..models.configuration_eagle3 import Eagle3Config
from ..models.modeling_dspark import DSparkDraftModel
from ..utils.files import replace_folder
from .config import DSparkTrainingConfig
from .dataset import TokenDataset
from .features import FeatureCache
from .manifest import MANIFEST, checkpoint_problem, write_manifest
from .step import check_teacher, freeze, special_token_ids, training_loss, vocab_shortlist


logger = logging.get_logger(__name__)
KEEP_CHECKPOINTS = 2
# Settings a checkpoint's weights or optimiser state depend on: `--resume` refuses to change them.
RESUME_FIXED_KEYS = (
    "drafter_kind",
    "drafter_config",
    "init_drafter",
    "distil_from",
    "target",
    "num_hidden_layers",
    "block_size",
    "markov_rank",
    "sequential_head",
    "confidence_head",
    "train_vocab_size",
    "shortlist_draft_vocab",
)
# The learning-rate schedule and the optimiser's settings: `--resume` honours changes (the schedule is rebuilt).
RESUME_SCHEDULE_KEYS = ("learning_rate", "max_steps", "warmup_ratio", "max_time", "weight_decay")


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def build_drafter(config: DSparkTrainingConfig, target, tokenizer=None):
    """The drafter a run starts from: `init_drafter`'s checkpoint, a new one from `drafter_config` (a DSpark or
    EAGLE-3 config file), or a new `drafter_kind` drafter shaped by the training config; `context_window`, when set,
    replaces the drafter's (a fine-tune of a full-context drafter with a bounded window, for long prompts)."""
    drafter = _starting_drafter(config, target, tokenizer)
    if config.context_window is not None:
        if getattr(drafter.config, "model_type", None) != "dspark":
            raise ValueError(f"`context_window` applies to DSpark drafters, not {drafter.config.model_type!r} ones.")
        drafter.config.context_window = config.context_window
    return drafter


def _starting_drafter(config: DSparkTrainingConfig, target, tokenizer=None):
    if config.init_drafter:
        drafter = AutoModel.from_pretrained(config.init_drafter)  # DSpark (ours or DeepSpec's) or EAGLE-3
        drafter.config.check_target(target.config)
        logger.info(f"Starting from the drafter in {config.init_drafter}.")
        return drafter
    if config.drafter_config:
        drafter_config = AutoConfig.from_pretrained(config.drafter_config)
        drafter_config.check_target(target.config)
        drafter_config = apply_shape_overrides(drafter_config, config)
    elif config.drafter_kind == "eagle3":
        layers = {} if config.num_hidden_layers is None else {"num_hidden_layers": config.num_hidden_layers}
        drafter_config = Eagle3Config.for_target(target.config, block_size=config.block_size, **layers)
    else:
        drafter_config = DSparkConfig.for_target(
            target.config,
            num_hidden_layers=config.num_hidden_layers or 2,
            block_size=config.block_size,
            markov_rank=config.markov_rank,
            sequential_head=config.sequential_head,
            confidence_head=config.confidence_head,
            confidence_with_markov=config.confidence_head and config.sequential_head != "none",
        )
    drafter_config.record_target(target, tokenizer)
    torch.manual_seed(config.seed)
    drafter = AutoModel.from_config(drafter_config)
    if config.init_from_target:
        init_from_target(drafter, target)
    return drafter


SHAPE_FIELDS = ("num_hidden_layers", "block_size", "markov_rank", "sequential_head", "confidence_head")


def apply_shape_overrides(drafter_config, config: DSparkTrainingConfig):
    """The drafter config of a `drafter_config` file with the training config's shape fields applied where they
    differ from their defaults (e.g. `--set num_hidden_layers=4 sequential_head=none` on a hub_configs file), so
    that no setting is silently ignored. Fields the drafter kind does not have are an error."""
    defaults = {f.name: f.default for f in dataclasses.fields(DSparkTrainingConfig)}
    kind = "eagle3" if drafter_config.model_type == "dspark_eagle3" else "dspark"
    if config.drafter_kind != defaults["drafter_kind"] and config.drafter_kind != kind:
        raise ValueError(
            f"`drafter_kind={config.drafter_kind!r}` contradicts `drafter_config` ({config.drafter_config} is a "
            f"{kind} config). Drop one of the two."
        )
    changed = {name: getattr(config, name) for name in SHAPE_FIELDS if getattr(config, name) != defaults[name]}
    if not changed:
        return drafter_config
    values = drafter_config.to_dict()
    unknown = [name for name in changed if name not in values]
    if unknown:
        raise ValueError(f"{', '.join(unknown)} cannot be set on a {kind} drafter ({config.drafter_config}).")
    values.update(changed)
    if "block_size" in changed:
        values["sts_temperatures"] = None  # one per position: the file's no longer fit
        if "tree_calibration" in values:
            values["tree_calibration"] = None  # one per depth, as the temperatures
    if values.get("sequential_head") == "none":
        values["confidence_with_markov"] = False  # no sequential head: the confidence head reads h_k alone
    logger.info(f"Overriding {sorted(changed)} of {config.drafter_config}.")
    return type(drafter_config).from_dict(values)


@torch.no_grad()
def init_from_target(drafter, target) -> None:
    """Sample-efficient start: draft layer i copies target layer L - n + i (same block shapes), and `fc` passes the
    deepest tapped layer through unchanged, so the untrained drafter already behaves like the target's top layers
    reading its own features."""
    target_layers = target.base_model.layers
    n = len(drafter.layers)
    for i, layer in enumerate(drafter.layers):
        source = target_layers[len(target_layers) - n + i].state_dict()
        own = layer.state_dict()
        shared = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
        if len(shared) < len(own):
            logger.warning_once("init_from_target: draft and target layers differ in shape; copied what matches.")
        layer.load_state_dict(shared, strict=False)
    d = drafter.config.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -d:] = torch.eye(d, dtype=drafter.fc.weight.dtype)


# -- resume checks (a checkpoint's integrity: manifest.py) ------------------------------------------------------------


def _checkpoints(output_dir: Path) -> list[Path]:
    """`checkpoint-<step>` folders of `output_dir`, newest first."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]), reverse=True)


def find_resume_checkpoint(output_dir: str | Path) -> Path | None:
    """The checkpoint `--resume` continues from: the one `latest` names when it is intact, else the newest intact one
    (with a warning naming what was wrong). None when `output_dir` holds no checkpoint (a fresh start); ValueError
    when there are checkpoints but none is intact. Checkpoints written before manifests existed (no checkpoint of the
    run has one) are used unverified, with a warning."""
    output_dir = Path(output_dir)
    pointer = output_dir / "latest"
    candidates = _checkpoints(output_dir)
    named = None
    if pointer.is_file():
        try:
            named = output_dir / pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            logger.warning(f"{pointer} is unreadable ({err}); looking for the newest intact checkpoint instead.")
    if named is None and not candidates:
        return None
    if not any((c / MANIFEST).is_file() for c in candidates):  # a run from before checksums
        folder = named if named is not None and named.is_dir() else (candidates[0] if candidates else None)
        if folder is None:
            raise ValueError(
                f"{pointer} names {named.name}, which does not exist (deleted?), and {output_dir} holds no other "
                "checkpoint. Restore it, or train from scratch: drop --resume or choose a new output_dir."
            )
        logger.warning(f"{folder} has no {MANIFEST} (written by an older version): resuming from it unverified.")
        return folder
    problems = []
    for folder in ([named] if named is not None else []) + [c for c in candidates if c != named]:
        problem = checkpoint_problem(folder)
        if problem is None:
            if problems:
                damaged = "; ".join(problems)
                logger.warning(f"Not resuming from a damaged checkpoint: {damaged}. Resuming from {folder} instead.")
            return folder
        problems.append(problem)
    raise ValueError(
        f"No intact checkpoint to resume from in {output_dir}: {'; '.join(problems)}. Restore the files, or train "
        "from scratch: drop --resume or choose a new output_dir."
    )


def read_trainer_state(folder: Path) -> dict:
    """`folder/trainer_state.json`, or a ValueError naming the file when it is not a JSON object with a step."""
    path = Path(folder) / "trainer_state.json"
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: {folder} is not a complete training checkpoint.") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is corrupt ({err}); restore it or resume from another checkpoint.") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{path} is corrupt (no integer `step`); restore it or resume from another checkpoint.")
    return state


def check_resume(config: DSparkTrainingConfig) -> tuple[Path, dict] | None:
    """Before anything loads: the checkpoint `--resume` would continue from and its trainer state, or None (nothing
    to resume). Refuses (ValueError naming the keys) a config that changes a setting the checkpoint's weights depend
    on (`RESUME_FIXED_KEYS`); schedule changes (`RESUME_SCHEDULE_KEYS`) are honoured by `DSparkTrainer.resume`."""
    folder = find_resume_checkpoint(config.output_dir)
    if folder is None:
        return None
    state = read_trainer_state(folder)
    saved = state.get("config")
    if not isinstance(saved, dict):
        logger.warning(f"{folder / 'trainer_state.json'} records no training config; its settings are not checked.")
        return folder, state
    current = config.to_dict()
    changed = [key for key in RESUME_FIXED_KEYS if key in saved and saved[key] != current[key]]
    if changed:
        diffs = ", ".join(f"{key} {saved[key]!r} -> {current[key]!r}" for key in changed)
        raise ValueError(
            f"Cannot resume {folder} with a changed {', '.join(changed)} ({diffs}): its weights were trained with the "
            "old value. Set it back, or train from scratch (drop --resume or choose a new output_dir)."
        )
    return folder, state


def check_output_dir(output_dir: str | Path, resume: bool = False, overwrite: bool = False) -> None:
    """A fresh run (not `resume`) needs an absent or empty `output_dir`, or `overwrite`: `FileExistsError` in one line
    otherwise, naming the folder and both ways on (`--resume` continues the run there). A file there is refused."""
    output_dir = Path(output_dir).expanduser()
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"output_dir {output_dir} is a file, not a folder; choose another output_dir.")
    if resume or overwrite or not output_dir.is_dir():
        return
    entries = sorted(p.name for p in output_dir.iterdir())
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise FileExistsError(
            f"output_dir {output_dir} is not empty (it holds {shown}); pass resume=True (--resume) to continue the "
            "run in it, or overwrite=True (--overwrite) to replace it with a new run, or choose another output_dir."
        )


class DSparkTrainer:
    """Trains a DSpark drafter for `target` on a `TokenDataset`; see `DSparkTrainingConfig` for the knobs."""

    def __init__(self, config: DSparkTrainingConfig, target, dataset=None, drafter=None, tokenizer=None):
        self.config = config
        self.accelerator = Accelerator(mixed_precision=config.mixed_precision)
        self.dataset = dataset if dataset is not None else TokenDataset.load(config.data)
        self.target = freeze(target).to(self.accelerator.device)
        drafter = drafter if drafter is not None else build_drafter(config, target, tokenizer)
        self.features = None  # offline mode: the cached target features of `self.dataset`
        if config.features:
            self.features = FeatureCache.open(config.features, self.dataset, target, drafter.config.target_layer_ids)
        self.teacher = None  # `distil_from`: the frozen drafter whose block distributions the loss matches
        if config.distil_from:
            self.teacher = AutoModel.from_pretrained(config.distil_from)
            self.teacher.config.check_target(target.config)
            check_teacher(self.teacher, drafter)
            self.teacher = freeze(self.teacher).to(self.accelerator.device)
            logger.info(f"Distilling the drafter in {config.distil_from}.")
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
        self.total_steps = config.max_steps  # the schedule's length; `max_time` fits it to the measured speed
        self.drafter, self.optimizer = self.accelerator.prepare(drafter.train(), optimizer)
        self.scheduler = self._build_scheduler()
        self.step = 0
        self.output_dir = Path(config.output_dir)
        self._replaces = None  # an overwriting run: the output_dir its staging folder replaces at its first checkpoint
        self.heldout = TokenDataset.load(config.heldout) if config.heldout else None
        self.best_tau = 0.0
        self.vocab_ids = vocab_shortlist(
            self.dataset, config.train_vocab_size, always=special_token_ids(target.config)
        )
        if self.vocab_ids is not None:
            self.vocab_ids = self.vocab_ids.to(self.accelerator.device)
            logger.info(f"Training on a shortlist of {len(self.vocab_ids)} tokens.")
        module = self.accelerator.unwrap_model(self.drafter)
        if config.shortlist_draft_vocab and hasattr(module, "set_draft_vocab"):
            module.set_draft_vocab(self.vocab_ids)  # inference only (None: all); saved with every checkpoint

    def _build_scheduler(self, step: int = 0):
        """Warm-up then cosine over `self.total_steps` from `learning_rate`, positioned at `step`: the learning rate is
        a pure function of (step, learning_rate, warmup_ratio, total steps), so a resumed run rebuilds it."""
        warmup_ratio = self.config.warmup_ratio
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # the torch optimizer accelerate wraps
        for group in optimizer.param_groups:
            group["initial_lr"] = self.config.learning_rate
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(s, max(1, int(warmup_ratio * self.total_steps)), self.total_steps),
            last_epoch=step - 1,
        )

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """Atomically write `checkpoint-<step>/` (safetensors weights, optimizer, scheduler, state) and `latest`."""
        final = self.output_dir / f"checkpoint-{self.step}"
        if self.accelerator.is_main_process:
            tmp = self.output_dir / f".checkpoint-{self.step}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            self.accelerator.unwrap_model(self.drafter).save_pretrained(tmp)
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            (tmp / "trainer_state.json").write_text(
                json.dumps(
                    {
                        "step": self.step,
                        "total_steps": self.total_steps,
                        "best_tau": self.best_tau,
                        "config": self.config.to_dict(),
                    }
                )
            )
            write_manifest(tmp)  # last: a checkpoint whose files all match it is complete and intact
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer = self.output_dir / ".latest.tmp"
            pointer.write_text(final.name)
            os.replace(pointer, self.output_dir / "latest")
            self._prune_checkpoints()
        self.accelerator.wait_for_everyone()
        if self._replaces is not None:  # an overwriting run's first checkpoint: the new run replaces the old one now
            if self.accelerator.is_main_process:
                replace_folder(self.output_dir, self._replaces)
            self.output_dir, self._replaces = self._replaces, None
            self.accelerator.wait_for_everyone()
            logger.info(f"Replaced the earlier run in {self.output_dir} (overwrite).")
        return self.output_dir / final.name

    def _prune_checkpoints(self) -> None:
        done = sorted(self.output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in done[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)

    def resume(self) -> bool:
        """Load the newest intact checkpoint (`find_resume_checkpoint`), if any; returns whether one was found.

        A changed weight-shaping setting is refused (`check_resume`). Changed schedule settings are honoured: the
        optimiser takes the new `learning_rate` and `weight_decay`, the schedule runs over the new `max_steps`, and the
        learning rate is recomputed for the resumed step (logged)."""
        found = check_resume(self.config)
        if found is None:
            logger.info(f"No checkpoint in {self.output_dir}: training from scratch.")
            return False
        folder, state = found
        loaded = type(self.accelerator.unwrap_model(self.drafter)).from_pretrained(folder)
        self.accelerator.unwrap_model(self.drafter).load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
        self.step, self.best_tau = state["step"], state.get("best_tau", 0.0)
        saved = state.get("config") if isinstance(state.get("config"), dict) else {}
        current = self.config.to_dict()
        changed = {k: (saved[k], current[k]) for k in RESUME_SCHEDULE_KEYS if k in saved and saved[k] != current[k]}
        # unchanged: the saved schedule length (`max_time` may have fitted it); a new max_steps or budget: refit
        refit = "max_steps" in changed or "max_time" in changed
        self.total_steps = self.config.max_steps if refit else state.get("total_steps", self.config.max_steps)
        for group in self.optimizer.param_groups:
            group["weight_decay"] = self.config.weight_decay
        self.scheduler = self._build_scheduler(self.step)
        if changed:
            diffs = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
            logger.warning(
                f"Resuming with a changed schedule ({diffs}): rebuilt over {self.total_steps} steps; the learning "
                f"rate at step {self.step} is now {self.scheduler.get_last_lr()[0]:.3g}."
            )
        others = [k for k in current if k in saved and saved[k] != current[k] and k not in changed]
        if others:
            logger.warning(f"Resuming with changed {', '.join(others)}: the new values apply from step {self.step}.")
        logger.info(f"Resumed from {folder} at step {self.step}.")
        return True

    # -- the loop -------------------------------------------------------------------------------------------------

    def _batch_seed(self, step: int) -> int:
        return self.config.seed * 1_000_003 + step * 131 + self.accelerator.process_index

    def batch_for(self, step: int):
        """The batch of `step` on this rank: a pure function of (seed, step, rank), so resuming replays nothing."""
        cfg = self.config
        ids, mask, gen = self.dataset.sample_batch(cfg.batch_size, cfg.seq_len, self._batch_seed(step))
        return ids.to(self.accelerator.device), mask.to(self.accelerator.device), gen

    def features_for(self, step: int):
        """Offline mode: the cached target features of `batch_for(step)`'s windows, ((B, L, m·d), (B, L, d));
        None online."""
        if self.features is None:
            return None
        cfg = self.config
        indices, offsets, _ = self.dataset.sample_windows(cfg.batch_size, cfg.seq_len, self._batch_seed(step))
        return self.features.window(indices, offsets, cfg.seq_len, device=self.accelerator.device)

    def _loss(self, drafter, ids, mask, gen, vocab_ids=None, features=None):
        cfg = self.config
        return training_loss(
            drafter,
            self.target,
            ids,
            mask,
            cfg.num_anchors,
            gen,
            vocab_ids,
            features,
            self.teacher,
            decay=cfg.loss_decay,
            alpha_ce=cfg.alpha_ce,
            alpha_tv=cfg.alpha_tv,
            alpha_kl=cfg.alpha_kl,
            alpha_conf=cfg.alpha_conf,
        )

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss, per-position accuracy and teacher-forced greedy τ on fixed, seeded batches."""
        cfg, module = self.config, self.accelerator.unwrap_model(self.drafter)
        module.eval()
        totals, taus, accs = 0.0, [], []
        batches = self.heldout.seeded_batches(cfg.eval_batches, cfg.batch_size, cfg.seq_len, first_seed=10_000)
        for ids, mask, gen in batches:
            out = self._loss(module, ids.to(self.accelerator.device), mask.to(self.accelerator.device), gen)
            totals += out.loss.item()
            taus.append(out.greedy_tau.item())
            accs.append(out.accuracy)
        module.train()
        return {
            "eval_loss": totals / cfg.eval_batches,
            "eval_greedy_tau": sum(taus) / len(taus),
            "eval_accuracy": [round(a, 4) for a in torch.stack(accs).mean(0).tolist()],
        }

    def _save_best(self, tau: float) -> None:
        """Keep the drafter with the best held-out τ in `best/` (early stopping without losing the last state)."""
        if tau <= self.best_tau or not self.accelerator.is_main_process:
            return
        self.best_tau = tau
        tmp = self.output_dir / ".best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.accelerator.unwrap_model(self.drafter).save_pretrained(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": self.step, "eval_greedy_tau": tau}))
        shutil.rmtree(self.output_dir / "best", ignore_errors=True)
        os.replace(tmp, self.output_dir / "best")

    def train_step(self) -> dict:
        cfg = self.config
        ids, mask, gen = self.batch_for(self.step)
        features = self.features_for(self.step)
        with self.accelerator.autocast():
            # held-out evaluation: full vocabulary
            out = self._loss(self.drafter, ids, mask, gen, self.vocab_ids, features)
        self.optimizer.zero_grad(set_to_none=True)
        self.accelerator.backward(out.loss)
        grad_norm = self.accelerator.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        return {
            "step": self.step,
            "loss": out.loss.item(),
            "ce": out.ce.item(),
            "tv": out.tv.item(),
            "kl": out.kl.item(),
            "conf": out.conf.item(),
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "accuracy": [round(a, 4) for a in out.accuracy.tolist()],
            "accept_rate": [round(a, 4) for a in out.accept_rate.tolist()],
            "greedy_tau": round(out.greedy_tau.item(), 4),
        }

    def _steps_in_time(self, budget_start: float, timed_from: tuple[float, int] | None, limit: int) -> int:
        """`max_time`: the last step that fits the budget since `budget_start`, at the speed measured since
        `timed_from` (time, step: after the first step, which warms caches and kernels; evaluations and checkpoints
        included); the schedule is stretched or shrunk to end there. 0 time left: stop now."""
        now = time.perf_counter()
        elapsed = now - budget_start
        if elapsed >= self.config.max_time:
            fit = self.step
        elif timed_from is None or self.step == timed_from[1] or now <= timed_from[0]:
            fit = self.total_steps  # nothing timed yet
        else:
            rate = (self.step - timed_from[1]) / (now - timed_from[0])
            fit = self.step + int((self.config.max_time - elapsed) * rate)
        # every rank must stop at the same step: the slowest clock decides
        fit = int(self.accelerator.gather(torch.tensor([fit], device=self.accelerator.device)).min())
        self.total_steps = min(self.config.max_steps, max(fit, self.step))
        return min(limit, fit)

    def _prepare_output_dir(self, resume: bool, overwrite: bool) -> None:
        """`check_output_dir`, then: an overwriting fresh run writes into a hidden folder beside `output_dir`, which
        replaces it at the run's first checkpoint (`save_checkpoint`), so a run killed before that leaves the earlier
        one as it was. A trainer past step 0 (resumed with `resume()`, or trained before) continues its own run."""
        resume = resume or self.step > 0
        check_output_dir(self.output_dir, resume, overwrite)
        used = self.output_dir.is_dir() and any(self.output_dir.iterdir())
        if resume or not used:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            return
        final = self.output_dir.resolve()  # a link: its folder is replaced, the link stays
        staging = final.with_name(f".{final.name}.overwrite")  # one name on every rank; a leftover is a dead run's
        if self.accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
        self.accelerator.wait_for_everyone()
        self.output_dir, self._replaces = staging, final
        logger.warning(f"overwrite: this run replaces the one in {final} once it has its first checkpoint.")

    def train(self, resume: bool = False, stop_after: int | None = None, overwrite: bool = False) -> DSparkDraftModel:
        """Run to `max_steps`, or for `max_time` seconds, or stop after `stop_after` more steps; each ends with a
        checkpoint.

        `resume` continues from the newest intact checkpoint in `output_dir` (a fresh start when it holds none). A
        fresh run into a non-empty `output_dir` is refused unless `overwrite`, which replaces the earlier run once
        this one has its first checkpoint (until then the earlier run stays as it was)."""
        cfg = self.config
        self._prepare_output_dir(resume, overwrite)
        if resume:
            self.resume()
        log_path = self.output_dir / "log.jsonl"
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", disable=not self.accelerator.is_main_process)
        limit = cfg.max_steps if stop_after is None else min(cfg.max_steps, self.step + stop_after)
        last, start, timed_from = limit, time.perf_counter(), None
        while self.step < last:
            record = self.train_step()
            bar.update(1)
            if cfg.max_time:
                last = self._steps_in_time(start, timed_from, limit)
                timed_from = timed_from or (time.perf_counter(), self.step)
                bar.total = last
                record["total_steps"] = self.total_steps
            if self.heldout is not None and (self.step % cfg.eval_every == 0 or self.step == last):
                record.update(self.evaluate())
                self._save_best(record["eval_greedy_tau"])
                bar.write(f"step {self.step}: held-out greedy τ {record['eval_greedy_tau']:.3f}")
            if self.step % cfg.log_every == 0 or self.step == last or "eval_loss" in record:
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=record["accuracy"][0])
                if self.accelerator.is_main_process:
                    with open(log_path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(record) + "\n")
            if self.step % cfg.save_every == 0 or self.step == last:
                self.save_checkpoint()
        bar.close()
        return self.accelerator.unwrap_model(self.drafter).eval()
