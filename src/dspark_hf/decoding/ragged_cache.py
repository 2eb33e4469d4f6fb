"""`RaggedCache`: one batched KV cache whose rows hold different numbers of valid tokens.

Every row of a batched forward writes the same number of slots along the shared time axis, but rows need different
numbers (each request verifies its own ℓ_r drafts and accepts its own prefix). Slots a row does not use, or whose
drafts were rejected, become *holes*: they stay in the tensors and are hidden forever by a 2-D attention mask
(B, T) (True = valid). Positions count valid slots only, so RoPE sees every request exactly as if it ran alone.

Holes are dropped by `compact()`, which right-aligns every row (holes first, then its valid tokens in order), and by
`trim()`, which crops trailing slots that are holes in every row. Right-aligned rows keep sliding-window attention
exact: the window, counted in slots, then covers exactly the last valid tokens.

Works for attention models whose layers keep keys/values in a `DynamicCache` (Llama, Qwen, Mistral, Gemma text
models; sliding windows given right-aligned rows); only public `DynamicCache` API is used (`update` via the model,
`crop`, `batch_select_indices`, iteration, construction from tensors).
"""

import torch
from transformers.cache_utils import DynamicCache


class RaggedCache:
    """A `DynamicCache` plus `valid` (B, T) bool: which slots of each row hold real tokens."""

    def __init__(self, device, batch_size: int = 0):
        self.cache = DynamicCache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # (B, T)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def lengths(self) -> torch.LongTensor:
        """Valid tokens per row (B,): the position the row's next token takes."""
        return self.valid.sum(dim=1)

    def hole_fraction(self) -> float:
        total = self.valid.numel()
        return 0.0 if total == 0 else 1.0 - self.valid.sum().item() / total

    def attention_mask(self, new_valid: torch.BoolTensor) -> torch.BoolTensor:
        """The 2-D mask (B, T + n) of a forward writing n new slots whose validity is `new_valid` (B, n)."""
        return torch.cat([self.valid, new_valid.to(self.valid.device)], dim=1)

    def commit(self, new_valid: torch.BoolTensor) -> None:
        """Record the validity (B, n) of the n slots the last forward appended to `cache`."""
        self.valid = self.attention_mask(new_valid)
        stored = self.cache.get_seq_length()
        if stored not in (0, self.num_slots):  # 0: a cache without layers yet (an empty drafter context)
            raise RuntimeError(f"RaggedCache out of sync: {stored} cached slots, {self.num_slots} recorded.")

    # -- batch axis ---------------------------------------------------------------------------------------------

    def select(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order (retirement)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.valid.device)
        if self._layers():
            self.cache.batch_select_indices(index)
        self.valid = self.valid[index]
        if not rows:  # nothing left: start over with an empty time axis
            self.__init__(self.valid.device)

    def extend(self, other: "RaggedCache") -> None:
        """Append the rows of `other` after ours (admission). Both sides are left-padded with holes to a common T.

        A side without K/V yet (a new request's empty drafter context) contributes all-hole rows.
        """
        slots = max(self.num_slots, other.num_slots)
        sides = [side for side in (self, other) if side.batch_size]
        per_side = [side._layers() for side in sides]
        template = next((layers for layers in per_side if layers), [])
        layers = []
        for i, (key, _) in enumerate(template):
            keys, values = [], []
            for side, side_layers in zip(sides, per_side):
                if side_layers:
                    k, v = side_layers[i]
                else:
                    k = v = key.new_zeros(side.batch_size, key.shape[1], 0, key.shape[3])
                keys.append(_left_pad(k, slots))
                values.append(_left_pad(v, slots))
            layers.append((torch.cat(keys), torch.cat(values)))
        self.valid = torch.cat([_left_pad(side.valid, slots) for side in sides]) if sides else self.valid
        self.cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()

    # -- time axis ----------------------------------------------------------------------------------------------

    def trim(self) -> None:
        """Crop trailing slots that are holes in every row."""
        if not self.num_slots:
            return
        used = self.valid.any(dim=0)  # (T,)
        last = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
        drop = self.num_slots - last
        if drop:
            self.cache.crop(-drop)
            self.valid = self.valid[:, :last]
            self._drop_empty_layers()

    def keep_last(self, counts: torch.LongTensor) -> None:
        """Keep only the last `counts[r]` valid slots of row r (older ones become holes), then drop the leading slots
        that are holes in every row: a bounded window over the most recent entries (slices; no copy)."""
        if not self.num_slots:
            return
        newer = self.valid.flip(1).cumsum(1).flip(1)  # (B, T): valid slots from here to the end
        self.valid = self.valid & (newer <= counts.to(self.valid.device)[:, None])
        used = self.valid.any(dim=0)
        first = int(used.nonzero().min()) if bool(used.any()) else self.num_slots
        if first:
            layers = [(k[:, :, first:], v[:, :, first:]) for k, v in self._layers()]
            self.cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()
            self.valid = self.valid[:, first:]
            self._drop_empty_layers()

    def is_right_aligned(self) -> bool:
        """True when every row is holes first, then valid tokens (no hole between two valid slots)."""
        return bool((self.valid[:, 1:] >= self.valid[:, :-1]).all())

    def compact(self) -> None:
        """Gather every row's valid slots to the right end; T becomes the longest row."""
        lengths = self.lengths()  # (B,)
        slots = int(lengths.max()) if self.batch_size else 0
        # Stable sort on validity moves holes before valid slots and keeps both in their original order.
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.num_slots - slots :]
        layers = []
        for key, value in self._layers():
            index = order[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])  # (B, H, T', hd)
            layers.append((key.gather(2, index), value.gather(2, index)))
        self.cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()
        self.valid = torch.arange(slots, device=self.valid.device)[None] >= (slots - lengths)[:, None]
        self._drop_empty_layers()

    def _drop_empty_layers(self) -> None:
        """With no slots left, forget the layers: transformers' `batch_select_indices` skips a layer holding no
        tokens, so its batch axis would go stale on the next retirement (a drafter cache the gate left empty)."""
        if self.num_slots == 0:
            self.cache = DynamicCache()

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(keys, values) per layer, each (B, H, T, hd); empty before the first forward."""
        return [(k, v) for k, v, *_ in self.cache if k is not None and k.dim() == 4]


def _left_pad(tensor: torch.Tensor, slots: int) -> torch.Tensor:
    """Pad the time axis on the left with zeros (holes) up to `slots`: (B, T) or (B, H, T, hd)."""
    dim = 1 if tensor.dim() == 2 else 2
    missing = slots - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


__all__ = ["RaggedCache"]
