"""Build a drafter training set for a target (`dspark-hf data`), resumably.

Two kinds of sequences, both stored as `TokenDataset`s (`train.npz`, `heldout.npz`):

(a) **Regenerated responses**: prompts from `sources.build_prompts`, rendered with the tokenizer's chat template,
    answered by the target itself (batched greedy decoding with a KV cache and left padding; optionally sampling
    with the target's recommended settings). Stored as prompt + response with `loss_start` = prompt length.
(b) **Teacher-forced text** (`teacher_forced_tokens > 0`): windows of plain text from the local corpora, no
    generation at all. At training time the target's own next-token distribution is the label, so the sequence is
    stored whole with `loss_start = text_prefix_tokens` (0 by default).

Work is split into chunks of `chunk_size` prompts. Each finished chunk is written as its own shard
(`shards/gen-NNNNN.npz`, temporary file + rename) and recorded in `manifest.json` (also rewritten atomically), so a
killed run continues with the first chunk that is not done. The prompt plan is written once (`prompts.jsonl.gz`;
runs made before plans were compressed keep their `prompts.jsonl`) and reused on resume. When every chunk is done
(or on `finalize=True`), the shards are merged in chunk order into `train.npz` / `heldout.npz` (held-out by a hash
of the prompt text, see `sources.identity.is_heldout`) plus `stats.json`.
"""

import dataclasses
import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig
from transformers.utils import logging

from ..utils.files import read_jsonl
from .dataset import TokenDataset
from .sources import SOURCES, build_prompts, save_jsonl, text_documents
from .sources.identity import EvalGuard, is_heldout, prompt_text


logger = logging.get_logger(__name__)

MANIFEST, PLAN, SHARD_DIR = "manifest.json", "prompts.jsonl.gz", "shards"
LEGACY_PLAN = "prompts.jsonl"  # the plan of runs made before plans were compressed (`plan_sha256` is the same)
# Used when sampling is asked for and the target's generation_config recommends nothing (DeepSpec's Qwen3 settings).
FALLBACK_SAMPLING = dict(temperature=0.7, top_p=0.8, top_k=20)


# With the `longdoc` source: prompts up to this many tokens (an 8k-context target's room for a 192-token answer) and
# characters (the source's documents are at most 30,000)
LONG_PROMPT_TOKENS, LONG_PROMPT_CHARS = 8000, 40_000


@dataclass
class DataConfig:
    """What goes into the data set. Every field is recorded in the manifest; a resume must use the same values."""

    num_prompts: int = 2000
    sources: tuple[str, ...] = SOURCES
    max_new_tokens: int = 256
    batch_size: int = 16
    chunk_size: int = 64  # prompts per resumable chunk (one shard each)
    teacher_forced_tokens: int = 0
    text_chunk_tokens: int = 512  # length of one teacher-forced window
    text_windows_per_document: int = 4  # at most this many windows from one document (diversity)
    text_prefix_tokens: int = 0  # loss_start of teacher-forced sequences
    max_prompt_tokens: int = 1024  # longer prompts are dropped from the plan
    heldout_fraction: float = 0.05
    seed: int = 0
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    exclude_eval: tuple[str, ...] = field(default_factory=tuple)
    target: str = "default"  # identity of the target, for the manifest

    def __post_init__(self):
        self.sources = tuple(self.sources)
        if "longdoc" in self.sources and self.max_prompt_tokens == DataConfig.max_prompt_tokens:
            self.max_prompt_tokens = LONG_PROMPT_TOKENS  # the point of long documents is their length
        self.exclude_eval = tuple(str(f) for f in self.exclude_eval)
        if self.batch_size < 1 or self.chunk_size < 1 or self.max_new_tokens < 1:
            raise ValueError("batch_size, chunk_size and max_new_tokens must be positive.")

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


# --------------------------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def _save_shard(path: Path, sequences: list[list[int]], loss_starts: list[int], meta: dict[str, list]) -> None:
    """A TokenDataset plus per-sequence columns (heldout, source, kind, generated, ended), written atomically."""
    data = TokenDataset.from_sequences(sequences, loss_starts)
    tmp = path.with_name(path.name + ".tmp.npz")
    columns = {k: np.asarray(v) for k, v in meta.items()}
    np.savez(tmp, tokens=data.tokens, offsets=data.offsets, loss_start=data.loss_start, **columns)
    tmp.replace(path)


def _load_shard(path: Path) -> tuple[list[np.ndarray], list[int], dict[str, np.ndarray]]:
    with np.load(path, allow_pickle=False) as f:
        data = TokenDataset(f["tokens"], f["offsets"], f["loss_start"])
        meta = {k: f[k] for k in f.files if k not in ("tokens", "offsets", "loss_start")}
    seqs = [data.tokens[data.offsets[i] : data.offsets[i + 1]].astype(np.int64) for i in range(len(data))]
    return seqs, data.loss_start.tolist(), meta


def eos_token_ids(target, tokenizer) -> list[int]:
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def pad_token_id(target, tokenizer) -> int:
    candidates = (target.generation_config.pad_token_id, tokenizer.pad_token_id, *eos_token_ids(target, tokenizer))
    for candidate in candidates:
        if candidate is not None:
            return int(candidate)
    return 0


def sampling_settings(target, config: DataConfig) -> dict:
    """Generation keyword arguments: greedy, or sampling with the target's recommended settings (its
    generation_config, when it samples by default), else FALLBACK_SAMPLING; explicit config values win."""
    if not config.do_sample:
        return dict(do_sample=False)
    gc = target.generation_config
    settings = dict(FALLBACK_SAMPLING)
    if getattr(gc, "do_sample", False):
        settings = {k: getattr(gc, k) for k in ("temperature", "top_p", "top_k", "min_p") if getattr(gc, k, None)}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(config, key) is not None:
            settings[key] = getattr(config, key)
    return dict(do_sample=True, **settings)


def encode_prompt(tokenizer, record: dict) -> list[int]:
    """Token ids of a chat record with the generation prompt (the tokenizer's chat template)."""
    out = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, return_dict=True)
    ids = out["input_ids"]
    return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]


@torch.no_grad()
def generate_batch(
    target,
    prompts: list[list[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_ids: list[int],
    sampling: dict | None = None,
) -> list[list[int]]:
    """Responses of `target` to token-id prompts in one left-padded batch (KV cache on). Each response is cut after its
    first EOS (kept, so the drafter learns to end) and carries no padding."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos_ids or None,
        use_cache=True,
        **(sampling or dict(do_sample=False)),
    )
    device = target.device
    out = target.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=gen_config
    )
    responses = []
    eos = set(eos_ids)
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


# --------------------------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------------------------


def plan_prompts(tokenizer, config: DataConfig, guard: EvalGuard | None = None) -> list[dict]:
    """The prompt plan: records with `input_ids` (chat template applied) and a `heldout` flag; prompts longer than
    `max_prompt_tokens` are dropped (and replaced by extra draws, so the plan keeps about `num_prompts`)."""
    plan, extra = [], 0
    while True:
        # long documents (the `longdoc` source) are bounded by `max_prompt_tokens` alone
        long = {"max_chars": LONG_PROMPT_CHARS} if "longdoc" in config.sources else {}
        records = build_prompts(config.num_prompts + extra, config.sources, config.seed, guard, **long)
        plan = []
        for record in records:
            ids = encode_prompt(tokenizer, record)
            if len(ids) <= config.max_prompt_tokens:
                plan.append({**record, "heldout": is_heldout(prompt_text(record), config.heldout_fraction),
                             "input_ids": ids})  # fmt: skip
        dropped = len(records) - len(plan)
        exhausted = len(records) < config.num_prompts + extra  # the sources have no more prompts to draw
        if len(plan) >= config.num_prompts or dropped == 0 or exhausted or extra > config.num_prompts:
            break
        extra += dropped + 8
    if guard is not None and guard.rejected:
        logger.warning(f"eval guard rejected {guard.rejected} candidate prompts that overlap {guard.files}")
    return plan[: config.num_prompts]


def teacher_forced_sequences(tokenizer, config: DataConfig, guard: EvalGuard | None = None):
    """(sequences, loss_starts, meta) of plain-text windows from the local corpora, `teacher_forced_tokens` in all."""
    seqs, meta = [], {"heldout": [], "source": [], "kind": [], "generated": [], "ended": []}
    total, n = 0, config.text_chunk_tokens
    for corpus, text in text_documents(config.seed):
        if total >= config.teacher_forced_tokens:
            break
        if guard is not None and not guard.allows(text):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), n)[: config.text_windows_per_document]:
            window = ids[start : start + n]
            if len(window) < max(32, config.text_prefix_tokens + 2) or total >= config.teacher_forced_tokens:
                break
            seqs.append(window)
            meta["heldout"].append(is_heldout(tokenizer.decode(window), config.heldout_fraction))
            meta["source"].append("teacher-forced")
            meta["kind"].append(corpus)
            meta["generated"].append(0)
            meta["ended"].append(False)
            total += len(window)
    return seqs, [config.text_prefix_tokens] * len(seqs), meta


def _eval_guard(config: DataConfig) -> EvalGuard | None:
    if not config.exclude_eval:
        return None
    guard = EvalGuard(config.exclude_eval)
    logger.info(f"eval guard: {len(guard)} evaluation prompts from {len(config.exclude_eval)} file(s)")
    return guard


def _open_run(out: Path, config: DataConfig, tokenizer, guard) -> tuple[dict, list[dict]]:
    """The manifest and the plan: loaded (and checked against `config`) when `out` holds a run, else created (with
    the eval guard `guard()`)."""
    manifest_path, plan_path = out / MANIFEST, out / PLAN
    if not plan_path.exists() and (out / LEGACY_PLAN).exists():
        plan_path = out / LEGACY_PLAN
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        old, new = manifest["config"], config.to_dict()
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if changed:
            raise ValueError(
                f"{out} holds a run with different settings ({', '.join(f'{k}: {old.get(k)!r} -> {new.get(k)!r}' for k in changed)}). "  # noqa: E501
                "Resume with the same arguments, use --finalize to merge what is done, or choose another --out."
            )
        plan = [record for _, record in read_jsonl(plan_path)]
        logger.info(f"resuming {out}: {len(manifest['done'])}/{manifest['num_chunks']} chunks done")
        return manifest, plan
    plan = plan_prompts(tokenizer, config, guard())
    manifest = {
        "version": 1,
        "config": config.to_dict(),
        "plan_sha256": save_jsonl(plan, out / PLAN),  # of the JSONL text, uncompressed
        "num_prompts": len(plan),
        "num_chunks": (len(plan) + config.chunk_size - 1) // config.chunk_size,
        "done": {},
        "teacher_forced": None,
        "finalized": False,
    }
    _write_json(manifest_path, manifest)
    return manifest, plan


def build_dataset(
    target,
    tokenizer,
    out: str | os.PathLike,
    config: DataConfig | None = None,
    max_chunks: int | None = None,
    progress: bool = True,
) -> dict:
    """Run (or continue) the pipeline in `out`; returns the manifest. With `max_chunks`, stop after that many new
    chunks (an interruption on purpose); the run finalises itself once every chunk is done."""
    config = config or DataConfig()
    out = Path(out)
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    # The eval guard filters the plan and the teacher-forced text; it is read only when one of them is made, so a
    # resume reads no eval file (a run planned here can be finished on a machine that lacks them).
    guard = functools.cache(lambda: _eval_guard(config))
    manifest, plan = _open_run(out, config, tokenizer, guard)
    manifest_path = out / MANIFEST

    if config.teacher_forced_tokens > 0 and manifest["teacher_forced"] is None:
        start = time.perf_counter()
        seqs, starts, meta = teacher_forced_sequences(tokenizer, config, guard())
        _save_shard(out / SHARD_DIR / "text.npz", seqs, starts, meta)
        manifest["teacher_forced"] = {"sequences": len(seqs), "tokens": int(sum(map(len, seqs))),
                                      "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip
        _write_json(manifest_path, manifest)
        logger.info(f"teacher-forced text: {len(seqs)} windows, {manifest['teacher_forced']['tokens']} tokens")

    pad_id, eos_ids = pad_token_id(target, tokenizer), eos_token_ids(target, tokenizer)
    sampling = sampling_settings(target, config)
    todo = [c for c in range(manifest["num_chunks"]) if str(c) not in manifest["done"]]
    done_prompts = sum(v["sequences"] for v in manifest["done"].values())
    bar = tqdm(total=len(plan), initial=done_prompts, unit="prompt", desc="generating", disable=not progress)
    tokens_run, seconds_run = 0, 0.0
    for chunk in todo[:max_chunks] if max_chunks is not None else todo:
        records = plan[chunk * config.chunk_size : (chunk + 1) * config.chunk_size]
        start = time.perf_counter()
        responses: list[list[int] | None] = [None] * len(records)
        order = sorted(range(len(records)), key=lambda i: -len(records[i]["input_ids"]))  # similar lengths together
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed * 1_000_003 + chunk)  # sampling: the same draws on resume
            for b in range(0, len(order), config.batch_size):
                batch = order[b : b + config.batch_size]
                outs = generate_batch(
                    target, [records[i]["input_ids"] for i in batch], config.max_new_tokens, pad_id, eos_ids, sampling
                )
                for i, response in zip(batch, outs):
                    responses[i] = response
                bar.update(len(batch))
        seconds = time.perf_counter() - start
        generated = [len(r) for r in responses]
        _save_shard(
            out / SHARD_DIR / f"gen-{chunk:05d}.npz",
            [r["input_ids"] + resp for r, resp in zip(records, responses)],
            [len(r["input_ids"]) for r in records],
            {
                "heldout": [r["heldout"] for r in records],
                "source": [r["source"] for r in records],
                "kind": [r["kind"] for r in records],
                "generated": generated,
                "ended": [bool(resp) and resp[-1] in eos_ids for resp in responses],
            },
        )
        manifest["done"][str(chunk)] = {"sequences": len(records), "generated_tokens": int(sum(generated)),
                                        "seconds": round(seconds, 3)}  # fmt: skip
        _write_json(manifest_path, manifest)
        tokens_run, seconds_run = tokens_run + sum(generated), seconds_run + seconds
        bar.set_postfix(tok_s=f"{tokens_run / max(seconds_run, 1e-9):.0f}")
    bar.close()
    if len(manifest["done"]) == manifest["num_chunks"]:
        return finalize_dataset(out)
    logger.info(f"{len(manifest['done'])}/{manifest['num_chunks']} chunks done; run again to continue")
    return manifest


def finalize_dataset(out: str | os.PathLike) -> dict:
    """Merge the finished shards (chunk order, then teacher-forced text) into train.npz / heldout.npz and write
    stats.json; works on a partial run too (it merges what is done). Returns the updated manifest."""
    out = Path(out)
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    shards = [out / SHARD_DIR / f"gen-{int(c):05d}.npz" for c in sorted(manifest["done"], key=int)]
    if manifest.get("teacher_forced"):
        shards.append(out / SHARD_DIR / "text.npz")
    split = {"train": ([], []), "heldout": ([], [])}
    stats: dict[str, dict] = {}
    for shard in shards:
        seqs, starts, meta = _load_shard(shard)
        for i, (seq, loss_start) in enumerate(zip(seqs, starts)):
            name = "heldout" if bool(meta["heldout"][i]) else "train"
            split[name][0].append(seq)
            split[name][1].append(loss_start)
            entry = stats.setdefault(str(meta["source"][i]), dict(sequences=0, tokens=0, loss_tokens=0, heldout=0,
                                                                   ended=0, kinds={}))  # fmt: skip
            entry["sequences"] += 1
            entry["tokens"] += len(seq)
            entry["loss_tokens"] += len(seq) - loss_start
            entry["heldout"] += name == "heldout"
            entry["ended"] += bool(meta["ended"][i])
            kind = str(meta["kind"][i])
            entry["kinds"][kind] = entry["kinds"].get(kind, 0) + 1
    for name, (seqs, starts) in split.items():
        TokenDataset.from_sequences(seqs, starts).save(out / f"{name}.npz")
    gen_tokens = sum(v["generated_tokens"] for v in manifest["done"].values())
    gen_seconds = sum(v["seconds"] for v in manifest["done"].values())
    summary = {
        "complete": len(manifest["done"]) == manifest["num_chunks"],
        "chunks_done": len(manifest["done"]),
        "num_chunks": manifest["num_chunks"],
        "train_sequences": len(split["train"][0]),
        "heldout_sequences": len(split["heldout"][0]),
        "train_tokens": int(sum(len(s) for s in split["train"][0])),
        "heldout_tokens": int(sum(len(s) for s in split["heldout"][0])),
        "generated_tokens": gen_tokens,
        "generation_seconds": round(gen_seconds, 1),
        "generated_tokens_per_second": round(gen_tokens / gen_seconds, 1) if gen_seconds else None,
        "by_source": stats,
    }
    _write_json(out / "stats.json", summary)
    manifest["finalized"] = summary["complete"]
    _write_json(out / MANIFEST, manifest)
    logger.info(
        f"wrote {out / 'train.npz'} ({summary['train_sequences']} sequences, {summary['train_tokens']} tokens) and "
        f"{out / 'heldout.npz'} ({summary['heldout_sequences']} sequences)"
    )
    return manifest
