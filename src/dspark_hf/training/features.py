"""Offline target features: a sharded safetensors cache of what `target_features` returns, for training without
running the target.

Layout of a cache folder: `manifest.json` (target fingerprint, layer ids, dataset hash, dtype, the shard plan and
which shards are done) and `shard-NNNNN.safetensors`, each holding a contiguous range of the dataset's sequences
as two flat tensors, rows in dataset order:

    context_hidden_states (T_shard, m·d)   the tapped layers' raw outputs, concatenated (the drafter's context)
    last_hidden_state     (T_shard, d)     the final post-norm hidden state (p_t = softmax(lm_head(h)))

p_t is not cached: it is recomputed from `last_hidden_state` through the target's LM head, as online training does,
which costs one (d x V) matmul per supervised slot and keeps the cache at (m + 1)·d values per token instead of
V (49,152 for SmolLM2, 14x more than its (5 + 1)·576). Size: tokens x (m + 1)·d x bytes per value (2 for
fp16/bf16), plus a safetensors header per shard and the manifest (`estimate_features` computes it exactly).

Features are computed on whole sequences, so a window cut from a long sequence sees its full prefix (as the drafter
does at inference); online training runs the target on the window alone. For sequences no longer than `seq_len`
the two are the same computation.
"""

import bisect
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers.utils import logging

from ..utils.devices import module_device
from ..utils.files import atomic_write_json
from .step import target_features


logger = logging.get_logger(__name__)

FORMAT = "dspark-features/1"
MANIFEST = "manifest.json"
DEFAULT_SHARD_TOKENS = 65_536
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SAFETENSORS_DTYPES = {"fp32": "F32", "fp16": "F16", "bf16": "BF16"}


def target_fingerprint(target) -> dict:
    """Shapes of the target plus a hash of the first 1,024 values of every parameter (a different checkpoint of
    the same architecture has different features)."""
    text = target.config.get_text_config(decoder=True)
    digest = hashlib.sha256()
    for name, param in target.named_parameters():
        digest.update(name.encode())
        digest.update(param.detach().flatten()[:1024].float().cpu().numpy().tobytes())
    return {
        "model_type": text.model_type,
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "vocab_size": text.vocab_size,
        "weights_sha256": digest.hexdigest()[:16],
    }


def dataset_hash(dataset) -> str:
    """sha256 of a `TokenDataset`'s token ids and offsets (the loss mask does not change features)."""
    digest = hashlib.sha256(np.ascontiguousarray(dataset.tokens, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(dataset.offsets, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def _dtype_name(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"Feature cache dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    return dtype


def plan_shards(dataset, shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sequence ranges [first, end) of about `shard_tokens` tokens each (a longer sequence gets a shard
    of its own)."""
    if shard_tokens < 1:
        raise ValueError(f"`shard_tokens` must be >= 1, got {shard_tokens}.")
    ranges, first, size = [], 0, 0
    lengths = np.diff(dataset.offsets)
    for i, n in enumerate(lengths):
        if size and size + n > shard_tokens:
            ranges.append((first, i))
            first, size = i, 0
        size += int(n)
    if first < len(lengths):
        ranges.append((first, len(lengths)))
    return ranges


def shard_file_bytes(num_tokens: int, feature_dim: int, hidden_size: int, dtype: str) -> int:
    """Exact size of one shard file: the 8-byte header length, the JSON header (padded to 8 bytes), the data."""
    code, itemsize = _SAFETENSORS_DTYPES[dtype], DTYPES[dtype].itemsize
    a, b = num_tokens * feature_dim * itemsize, num_tokens * hidden_size * itemsize
    header = {
        "context_hidden_states": {"dtype": code, "shape": [num_tokens, feature_dim], "data_offsets": [0, a]},
        "last_hidden_state": {"dtype": code, "shape": [num_tokens, hidden_size], "data_offsets": [a, a + b]},
    }
    n = len(json.dumps(header, separators=(",", ":")))
    return 8 + n + (-n % 8) + a + b


def _manifest(target, dataset, layer_ids, dtype: str, shard_tokens: int) -> dict:
    if len(dataset) == 0:
        raise ValueError("The token dataset is empty: there are no features to cache.")
    hidden = target.config.get_text_config(decoder=True).hidden_size
    offsets = dataset.offsets
    shards = [
        {
            "file": f"shard-{k:05d}.safetensors",
            "sequences": [first, end],
            "num_tokens": int(offsets[end] - offsets[first]),
            "done": False,
        }
        for k, (first, end) in enumerate(plan_shards(dataset, shard_tokens))
    ]
    return {
        "format": FORMAT,
        "target": target_fingerprint(target),
        "target_name_or_path": getattr(target.config, "_name_or_path", None) or None,
        "layer_ids": [int(i) for i in layer_ids],
        "dataset": {"sha256": dataset_hash(dataset), "num_sequences": len(dataset), "num_tokens": dataset.num_tokens},
        "dtype": dtype,
        "feature_dim": hidden * len(layer_ids),
        "hidden_size": hidden,
        "shard_tokens": shard_tokens,
        "shards": shards,
    }


def _batches(dataset, first: int, end: int, batch_size: int) -> list[list[int]]:
    """Sequences [first, end) sorted by length (little padding), `batch_size` per target forward."""
    order = sorted(range(first, end), key=lambda i: (int(dataset.offsets[i + 1] - dataset.offsets[i]), i))
    return [order[k : k + batch_size] for k in range(0, len(order), batch_size)]


def _forward(target, dataset, indices: list[int], layer_ids):
    """target_features of right-padded whole sequences: ((B, L, m·d), (B, L, d)) and their lengths."""
    pieces = [dataset.sequence(i)[0] for i in indices]
    lengths = [len(p) for p in pieces]
    ids = torch.zeros(len(pieces), max(lengths), dtype=torch.long)
    for row, piece in enumerate(pieces):
        ids[row, : len(piece)] = torch.from_numpy(piece)
    device = module_device(target.get_input_embeddings())
    context, last = target_features(target, ids.to(device), layer_ids)
    return context, last, lengths


def _shard_tensors(target, dataset, first: int, end: int, layer_ids, dtype: str, batch_size: int, bar):
    base = int(dataset.offsets[first])
    num_tokens = int(dataset.offsets[end]) - base
    hidden = target.config.get_text_config(decoder=True).hidden_size
    context = torch.empty(num_tokens, hidden * len(layer_ids), dtype=DTYPES[dtype])
    last = torch.empty(num_tokens, hidden, dtype=DTYPES[dtype])
    for indices in _batches(dataset, first, end, batch_size):
        batch_context, batch_last, lengths = _forward(target, dataset, indices, layer_ids)
        for row, (i, n) in enumerate(zip(indices, lengths)):
            start = int(dataset.offsets[i]) - base
            context[start : start + n] = batch_context[row, :n].cpu()
            last[start : start + n] = batch_last[row, :n].cpu()
        bar.update(sum(lengths))
    return {"context_hidden_states": context, "last_hidden_state": last}


def _shard_done(folder: Path, shard: dict, manifest: dict) -> bool:
    path = folder / shard["file"]
    dims = manifest["feature_dim"], manifest["hidden_size"]
    expected = shard_file_bytes(shard["num_tokens"], *dims, manifest["dtype"])
    return shard["done"] and path.is_file() and path.stat().st_size == expected


def _differences(found: dict, expected: dict) -> list[str]:
    """The manifest fields in which two caches differ, ignoring shard progress and where the target was loaded from."""

    def settings(manifest):
        shards = [{k: v for k, v in s.items() if k != "done"} for s in manifest["shards"]]
        return {**manifest, "shards": shards, "target_name_or_path": None}

    found, expected = settings(found), settings(expected)
    return [k for k in sorted(set(found) | set(expected)) if found.get(k) != expected.get(k)]


@dataclass
class FeatureCacheEstimate:
    """What `build_features` would write and how long it would take (from a short timed sample)."""

    num_sequences: int
    num_tokens: int
    num_shards: int
    values_per_token: int
    dtype: str
    total_bytes: int
    sample_tokens: int
    tokens_per_second: float

    @property
    def seconds(self) -> float:
        return self.num_tokens / self.tokens_per_second

    def summary(self) -> str:
        itemsize = DTYPES[self.dtype].itemsize
        data = self.num_tokens * self.values_per_token * itemsize
        return (
            f"{self.num_sequences} sequences, {self.num_tokens} tokens x {self.values_per_token} values "
            f"((m + 1)·d) x {itemsize} bytes ({self.dtype}) = {data / 1e9:.3f} GB of features; "
            f"{self.num_shards} shards + manifest = {self.total_bytes} bytes ({self.total_bytes / 1e9:.3f} GB). "
            f"Sample: {self.sample_tokens} tokens at {self.tokens_per_second:.0f} tok/s -> about "
            f"{self.seconds / 60:.1f} min to build."
        )


@torch.no_grad()
def estimate_features(
    target,
    dataset,
    layer_ids,
    dtype: str = "bf16",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    batch_size: int = 8,
    sample_batches: int = 3,
) -> FeatureCacheEstimate:
    """The exact size `build_features` would write and its time from `sample_batches` timed target forwards,
    spread over the dataset's batches. Writes nothing."""
    dtype = _dtype_name(dtype)
    manifest = _manifest(target, dataset, layer_ids, dtype, shard_tokens)
    for shard in manifest["shards"]:
        shard["done"] = True
    total = len(json.dumps(manifest, indent=2)) + 1  # as atomic_write_json writes it
    for shard in manifest["shards"]:
        total += shard_file_bytes(shard["num_tokens"], manifest["feature_dim"], manifest["hidden_size"], dtype)
    ranges = plan_shards(dataset, shard_tokens)
    batches = [b for first, end in ranges for b in _batches(dataset, first, end, batch_size)]
    k = max(1, min(sample_batches, len(batches)))
    sample = [batches[(2 * j + 1) * len(batches) // (2 * k)] for j in range(k)]
    tokens, start = 0, time.perf_counter()
    for indices in sample:
        tokens += sum(_forward(target, dataset, indices, layer_ids)[2])
    seconds = time.perf_counter() - start
    return FeatureCacheEstimate(
        num_sequences=len(dataset),
        num_tokens=dataset.num_tokens,
        num_shards=len(manifest["shards"]),
        values_per_token=manifest["feature_dim"] + manifest["hidden_size"],
        dtype=dtype,
        total_bytes=total,
        sample_tokens=tokens,
        tokens_per_second=tokens / max(seconds, 1e-9),
    )


@torch.no_grad()
def build_features(
    target,
    dataset,
    out,
    layer_ids,
    dtype: str = "bf16",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    batch_size: int = 8,
) -> Path:
    """Write (or finish) the feature cache of `dataset` in `out`: shard by shard, each written to a temporary name
    and renamed, then marked done in the manifest; a rerun skips finished shards. Refuses a folder that holds a
    cache of another target, layer ids, dataset, dtype or shard size."""
    dtype, out = _dtype_name(dtype), Path(out)
    manifest = _manifest(target, dataset, layer_ids, dtype, shard_tokens)
    path = out / MANIFEST
    if path.is_file():
        found = json.loads(path.read_text(encoding="utf-8"))
        wrong = _differences(found, manifest)
        if wrong:
            raise ValueError(
                f"{out} holds a feature cache built with other {', '.join(wrong)}; choose another output folder "
                "or delete this one."
            )
        manifest = found
    atomic_write_json(manifest, path)
    done = [_shard_done(out, s, manifest) for s in manifest["shards"]]
    initial = sum(s["num_tokens"] for s, d in zip(manifest["shards"], done) if d)
    bar = tqdm(total=dataset.num_tokens, initial=initial, unit="tok", desc="features")
    for shard, finished in zip(manifest["shards"], done):
        if finished:
            continue
        first, end = shard["sequences"]
        tensors = _shard_tensors(target, dataset, first, end, layer_ids, dtype, batch_size, bar)
        tmp = out / f".{shard['file']}.tmp"
        save_file(tensors, tmp)
        os.replace(tmp, out / shard["file"])
        shard["done"] = True
        atomic_write_json(manifest, path)
    bar.close()
    logger.info(f"Feature cache complete in {out} ({len(manifest['shards'])} shards).")
    return out


class FeatureCache:
    """A finished feature cache of one dataset, read lazily: each shard is memory-mapped by `safe_open` and only
    the rows of the requested windows are read, so the cache never has to fit in RAM."""

    def __init__(self, path, dataset):
        self.path, self.dataset = Path(path), dataset
        manifest = self.path / MANIFEST
        build = f"build it with `dspark-hf features --config ... --out {self.path}`"
        if not manifest.is_file():
            raise ValueError(f"No feature cache in {self.path} (no {MANIFEST}): {build}.")
        self.manifest = json.loads(manifest.read_text(encoding="utf-8"))
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest} is not a {FORMAT} feature cache manifest: {build}.")
        shards = self.manifest["shards"]
        finished = sum(_shard_done(self.path, s, self.manifest) for s in shards)
        if finished < len(shards):
            raise ValueError(
                f"The feature cache in {self.path} is incomplete ({finished}/{len(shards)} shards): rerun "
                "`dspark-hf features` with the same arguments to finish it."
            )
        found = self.manifest["dataset"]["sha256"]
        if found != dataset_hash(dataset):
            raise ValueError(
                f"The feature cache in {self.path} was built for another dataset (hash {found}, "
                f"{self.manifest['dataset']['num_tokens']} tokens; this one has {dataset.num_tokens}). Build a "
                "cache for this dataset or set `data` to the dataset the cache was built from."
            )
        self._firsts = [s["sequences"][0] for s in shards]
        self._files = {}

    @classmethod
    def open(cls, path, dataset, target, layer_ids) -> "FeatureCache":
        """The cache in `path`, checked against the dataset, the target and the drafter's `target_layer_ids`."""
        cache = cls(path, dataset)
        cache.check(target, layer_ids)
        return cache

    def check(self, target, layer_ids) -> None:
        """ValueError unless the cache was built by this target (shapes and weights) for these layer ids."""
        found, own = self.manifest["target"], target_fingerprint(target)
        if found != own:
            wrong = "; ".join(f"{k}: cache {found.get(k)}, target {v}" for k, v in own.items() if found.get(k) != v)
            raise ValueError(
                f"The feature cache in {self.path} was built by another target ({wrong}); rebuild it with this target "
                "(`dspark-hf features`)."
            )
        if self.manifest["layer_ids"] != [int(i) for i in layer_ids]:
            raise ValueError(
                f"The feature cache in {self.path} holds target layers {self.manifest['layer_ids']}, but the drafter "
                f"reads layers {list(layer_ids)}; rebuild the cache with the drafter's config."
            )

    def _shard(self, k: int):
        if k not in self._files:
            self._files[k] = safe_open(str(self.path / self.manifest["shards"][k]["file"]), framework="pt")
        return self._files[k]

    def window(self, indices, offsets, seq_len: int, dtype=torch.float32, device=None):
        """The cached features of the windows `TokenDataset.sample_windows` drew: ((B, seq_len, m·d),
        (B, seq_len, d)) in `dtype`, zero past each sequence's end (positions no block can see)."""
        m_d, d = self.manifest["feature_dim"], self.manifest["hidden_size"]
        context = torch.zeros(len(indices), seq_len, m_d, dtype=dtype)
        last = torch.zeros(len(indices), seq_len, d, dtype=dtype)
        for row, (i, offset) in enumerate(zip(indices, offsets)):
            k = bisect.bisect_right(self._firsts, int(i)) - 1
            first = self.manifest["shards"][k]["sequences"][0]
            start = int(self.dataset.offsets[i] - self.dataset.offsets[first]) + offset
            n = min(seq_len, int(self.dataset.offsets[i + 1] - self.dataset.offsets[i]) - offset)
            shard = self._shard(k)
            context[row, :n] = shard.get_slice("context_hidden_states")[start : start + n].to(dtype)
            last[row, :n] = shard.get_slice("last_hidden_state")[start : start + n].to(dtype)
        return context.to(device), last.to(device)
