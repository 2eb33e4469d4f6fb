"""Compact token datasets: every sequence's ids in one flat array plus offsets, stored as `.npz`.

Fields: `tokens` (uint16 when the vocabulary fits, else uint32), `offsets` (int64, n + 1), `loss_start` (int32, n:
the first position of the supervised response; prompts are context only). A few MB hold a million tokens.
"""

import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


_ARRAYS = ("tokens", "offsets", "loss_start")


class TokenDataset:
    """Sequences of token ids with a loss mask that starts at `loss_start[i]`."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, loss_start: np.ndarray):
        if offsets.ndim != 1 or len(offsets) != len(loss_start) + 1 or offsets[-1] != len(tokens):
            raise ValueError("Inconsistent token dataset: offsets must have n + 1 entries ending at len(tokens).")
        self.tokens, self.offsets, self.loss_start = tokens, offsets.astype(np.int64), loss_start.astype(np.int32)

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], loss_starts: list[int]) -> "TokenDataset":
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences]) if sequences else np.zeros(0)
        dtype = np.uint16 if flat.size == 0 or flat.max() < 2**16 else np.uint32
        return cls(flat.astype(dtype), np.concatenate([[0], np.cumsum(lengths)]), np.asarray(loss_starts))

    @classmethod
    def load(cls, path: str | Path | Sequence[str | Path]) -> "TokenDataset":
        """One `.npz`, or several (a list, or one string of comma-separated paths) concatenated in order."""
        paths = path.split(",") if isinstance(path, str) else [path] if isinstance(path, Path) else list(path)
        paths = [Path(str(p).strip()) for p in paths if str(p).strip()]
        if not paths:
            raise ValueError("No token dataset given: pass a .npz path (or several, comma-separated).")
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ValueError(f"Token dataset file(s) not found: {missing}. Build one with `dspark-hf data`.")
        parts = [cls._load_one(p) for p in paths]
        return parts[0] if len(parts) == 1 else cls.concatenate(parts)

    @classmethod
    def _load_one(cls, path: Path) -> "TokenDataset":
        """One `.npz`; a file that is not one, lacks an array or is inconsistent is a ValueError naming it."""
        try:
            with np.load(path, allow_pickle=False) as f:
                missing = [name for name in _ARRAYS if name not in f.files]
                if missing:
                    raise ValueError(
                        f"{path} is not a token dataset: it lacks the array(s) {missing} (it holds {f.files}). "
                        "Build one with `dspark-hf data`."
                    )
                return cls(*(f[name] for name in _ARRAYS))
        except (OSError, EOFError, ValueError, TypeError, AttributeError, zipfile.BadZipFile) as err:
            if str(path) in str(err):
                raise
            reason = "the file is empty" if path.stat().st_size == 0 else str(err)
            raise ValueError(
                f"{path} is not a readable .npz token dataset ({reason}). Build one with `dspark-hf data`."
            ) from None

    @classmethod
    def concatenate(cls, datasets: Sequence["TokenDataset"]) -> "TokenDataset":
        """The sequences of every dataset, in order (token ids widened to the largest dtype among them)."""
        if not datasets:
            raise ValueError("concatenate needs at least one TokenDataset.")
        dtype = np.result_type(*(d.tokens.dtype for d in datasets))
        ends = np.cumsum([0] + [d.num_tokens for d in datasets])
        offsets = np.concatenate([[0]] + [d.offsets[1:] + end for d, end in zip(datasets, ends[:-1])])
        tokens = np.concatenate([d.tokens.astype(dtype, copy=False) for d in datasets])
        return cls(tokens, offsets, np.concatenate([d.loss_start for d in datasets]))

    def save(self, path: str | Path) -> None:
        """Atomic: written to a temporary name, then renamed."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, tokens=self.tokens, offsets=self.offsets, loss_start=self.loss_start)
        tmp.replace(path)

    def __len__(self) -> int:
        return len(self.loss_start)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def supervised_tokens(self) -> np.ndarray:
        """The ids inside the loss mask of every sequence, concatenated (for vocabulary statistics)."""
        starts = self.offsets[:-1] + self.loss_start
        keep = np.zeros(len(self.tokens), dtype=bool)
        for start, end in zip(starts, self.offsets[1:]):
            keep[start:end] = True
        return self.tokens[keep]

    def sequence(self, i: int) -> tuple[np.ndarray, int]:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]].astype(np.int64), int(self.loss_start[i])

    def sample_batch(self, batch_size: int, seq_len: int, seed: int):
        """`batch_size` sequences drawn with replacement, a pure function of `seed`: (input_ids, loss_mask), each
        (B, seq_len), and the generator, which continues the same random stream (e.g. for anchor sampling)."""
        indices, offsets, generator = self.sample_windows(batch_size, seq_len, seed)
        ids, mask = self.batch(indices, seq_len, offsets=offsets)
        return ids, mask, generator

    def sample_windows(self, batch_size: int, seq_len: int, seed: int):
        """What `sample_batch(batch_size, seq_len, seed)` draws: (indices, window offsets, generator), so that cached
        per-sequence data (offline target features) can be cut to the same windows."""
        generator = torch.Generator().manual_seed(seed)
        indices = torch.randint(0, len(self), (batch_size,), generator=generator).tolist()
        return indices, self.window_offsets(indices, seq_len, generator), generator

    def window_offsets(self, indices, seq_len: int, generator: torch.Generator | None = None) -> list[int]:
        """The first position of each sequence's `seq_len` window: random for longer sequences, else 0."""
        offsets = []
        for i in indices:
            n = int(self.offsets[int(i) + 1] - self.offsets[int(i)])
            offsets.append(int(torch.randint(0, n - seq_len + 1, (1,), generator=generator)) if n > seq_len else 0)
        return offsets

    def seeded_batches(self, num_batches: int, batch_size: int, seq_len: int, first_seed: int):
        """The same `num_batches` batches on every call (held-out evaluation, calibration): `sample_batch` with
        seeds `first_seed`, `first_seed + 1`, ...; yields (input_ids, loss_mask, generator)."""
        for b in range(num_batches):
            yield self.sample_batch(batch_size, seq_len, first_seed + b)

    def batch(self, indices, seq_len: int, generator: torch.Generator | None = None, offsets=None):
        """(input_ids, loss_mask), each (B, seq_len). Long sequences are cropped to a random window (so long
        responses are trained to the end; `offsets` fixes the windows); short ones are right-padded (padding is
        outside the loss mask)."""
        ids = torch.zeros(len(indices), seq_len, dtype=torch.long)
        mask = torch.zeros(len(indices), seq_len, dtype=torch.bool)
        if offsets is None:
            offsets = self.window_offsets(indices, seq_len, generator)
        for row, (i, offset) in enumerate(zip(indices, offsets)):
            seq, start = self.sequence(int(i))
            piece = seq[offset : offset + seq_len]
            ids[row, : len(piece)] = torch.from_numpy(piece)
            mask[row, max(start - offset, 0) : len(piece)] = True
        return ids, mask
