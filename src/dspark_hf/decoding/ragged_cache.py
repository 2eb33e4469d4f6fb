"""`RaggedCache`: one batched KV cache whose rows hold different numbers of valid tokens.

Every row of a batched forward writes the same number of slots along the shared time axis, but rows need different
numbers (each request verifies its own ℓ_r drafts and accepts its own prefix). Slots a row does not use, or whose
drafts were rejected, become *holes*: they stay in the tensors and are hidden forever by a 2-D attention mask
(B, T) (True = valid). Positions count valid slots only, so RoPE sees every request exactly as if it ran alone.

Holes are dropped by `compact()`, which right-aligns every row (holes first, then its valid tokens in order), and by
`trim()`, which crops trailing slots that are holes in every row. Right-aligned rows keep sliding-window attention
exact: the window, counted in slots, then covers exactly the last valid tokens.

Works for attention models whose layers keep keys/values in a `DynamicCache` (Llama, Qwen, Mistral, Gemma text
models; sliding windows given right-aligned rows). The cache is an `AppendCache`: a `DynamicCache` whose layers keep
their keys and values in buffers with spare slots, so that a forward writes its new slots in place where
`DynamicCache` concatenates (a copy of the whole cache, every layer, every forward: 0.75 GB moved per verify at 8k
positions on SmolLM2-135M).
"""

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..kernels.options import OPTIONS


SPARE_SLOTS = 256  # an AppendLayer's buffer holds at least this many slots, and a quarter more, beyond its tokens


class AppendLayer(DynamicLayer):
    """A `DynamicLayer` whose `keys` and `values` (B, H, T, hd) are views of buffers (B, H, capacity, hd).

    `update` writes the new slots after the current ones when the buffer has room and the views still are its
    slots (`crop` slices the views, so rejected slots are overwritten by the next forward); otherwise (a first
    update, a full buffer, or views that `batch_select_indices` or a rebuild replaced) it moves the current slots
    into a new buffer with `SPARE_SLOTS` and a quarter more to spare. The values are those `DynamicLayer` holds.
    """

    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.key_buffer, self.keys = _append(self.key_buffer, self.keys, key_states)
        self.value_buffer, self.values = _append(self.value_buffer, self.values, value_states)
        return self.keys, self.values

    def drop_first(self, slots: int) -> None:
        """Forget the first `slots` slots (a view: the buffer's room after the last slot is kept)."""
        self.keys, self.values = self.keys[:, :, slots:], self.values[:, :, slots:]


class AppendCache(DynamicCache):
    """A `DynamicCache` of `AppendLayer`s, from (keys, values) per layer or empty (layers made on first use)."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        super().__init__()
        self.layer_class_to_replicate = AppendLayer if OPTIONS.in_place_cache else DynamicLayer
        for key, value in layers or ():
            layer = self.layer_class_to_replicate()
            layer.update(key, value)
            self.layers.append(layer)


def _append(buffer: torch.Tensor | None, current: torch.Tensor, new: torch.Tensor):
    """(buffer, view of its slots holding `current` then `new`), writing `new` in place where there is room."""
    old = current.shape[2] if current.dim() == 4 else 0
    start = _first_slot(buffer, current) if old else 0
    if buffer is None or start is None or start + old + new.shape[2] > buffer.shape[2] or not _fits(buffer, new):
        slots = old + new.shape[2]
        batch, heads, _, dim = new.shape
        fresh = new.new_empty(batch, heads, slots + SPARE_SLOTS + slots // 4, dim)
        if old:
            fresh[:, :, :old] = current
        buffer, start = fresh, 0
    buffer[:, :, start + old : start + old + new.shape[2]] = new
    return buffer, buffer[:, :, start : start + old + new.shape[2]]


def _fits(buffer: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether `new`'s slots can be written into `buffer`: the same batch, heads, head size, dtype and device."""
    return (
        buffer.shape[:2] == new.shape[:2]
        and buffer.shape[3] == new.shape[3]
        and buffer.dtype == new.dtype
        and buffer.device == new.device
    )


def _first_slot(buffer: torch.Tensor | None, view: torch.Tensor) -> int | None:
    """The buffer slot where `view` begins, if `view` is a run of `buffer`'s slots (as `update` and `crop` leave
    it); None otherwise."""
    if buffer is None or view.dtype != buffer.dtype or view.device != buffer.device:
        return None
    if view.shape[:2] != buffer.shape[:2] or view.shape[3] != buffer.shape[3] or view.stride() != buffer.stride():
        return None
    if view.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
        return None
    step = buffer.stride(2) * buffer.element_size()
    offset = view.data_ptr() - buffer.data_ptr()
    if offset < 0 or offset % step:
        return None
    start = offset // step
    return start if start + view.shape[2] <= buffer.shape[2] else None


class RaggedCache:
    """A `DynamicCache` plus `valid` (B, T) bool: which slots of each row hold real tokens."""

    def __init__(self, device, batch_size: int = 0):
        self.cache = AppendCache()
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

        A side without K/V yet (a new request's empty drafter context) contributes all-hole rows. Joining an empty
        cache takes `other`'s tensors as they are (no copy): `other` must not be used afterwards.
        """
        if not self.batch_size and OPTIONS.in_place_cache:
            self.cache, self.valid = other.cache, other.valid
            return
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
        self.cache = AppendCache(layers)

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
            for layer in self.cache.layers:
                if isinstance(layer, AppendLayer):
                    layer.drop_first(first)
                elif layer.is_initialized and layer.keys.dim() == 4:
                    layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
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
        self.cache = AppendCache(layers)
        self.valid = torch.arange(slots, device=self.valid.device)[None] >= (slots - lengths)[:, None]
        self._drop_empty_layers()

    def _drop_empty_layers(self) -> None:
        """With no slots left, forget the layers: transformers' `batch_select_indices` skips a layer holding no
        tokens, so its batch axis would go stale on the next retirement (a drafter cache the gate left empty)."""
        if self.num_slots == 0:
            self.cache = AppendCache()

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


__all__ = ["AppendCache", "AppendLayer", "RaggedCache"]
