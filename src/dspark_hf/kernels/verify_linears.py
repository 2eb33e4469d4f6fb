"""The target's linears in verify passes and plain steps, chosen per machine by measurement: oneDNN's packed weights
(siblings fused, rows padded to the cheapest count), the few-row products, or transformers' own `F.linear`.

A decoding step reads every weight of the target once, whatever its width: SmolLM2-135M reads 538 MB of float32
weights a step, 16 ms at the 33 GB/s a 2-core AMD EPYC streams. How close a step of 1–16 tokens comes to that floor
depends on the CPU's BLAS: torch's float32 `F.linear` took 61 ms for one token there, 90–100 ms for 2–8. oneDNN's
prepacked weights (the layout `torch.ops.mkldnn._reorder_linear_weight` makes, what inductor uses for CPU linears)
run 1–16 rows at 1.1–1.6x the floor, and siblings fed the same input (q/k/v, gate/up) as one product save a call each.
Some row counts run faster padded to a wider one (oneDNN picks its kernel by row count: 2 rows cost more than 4 on
that CPU), so a product of n rows runs as the cheapest measured count at or above n, zero rows added.

Nothing is assumed about the machine: `measure(target)` times one pass over the target's linears per row count and
way, and `KernelTable.choose` keeps, per row count, the fastest of "linear" (transformers' own), "few rows"
(`verify_head`) and "packed". `VerifyKernels` (one per target, beside it: `kernel_choice(target)`) holds the table,
measured on first use or read from a matching SPS profile (`profiling.py` stores it there), and scopes each verify
pass: `with kernels.verify(target, rows):`.

Memory: the packed copies (`TargetPacks`) are a second copy of every packed weight (538 MB for SmolLM2-135M in float32,
`TargetPacks.nbytes`), made on the first packed verify and kept beside the target for as long as it lives (never on
it: a packed tensor has no storage, the model must stay picklable), rebuilt when a weight changes, and freed by
`free_packs(target)` or with the target. Set `OPTIONS.packs = False` to never pack. The user's modules are
class-swapped only inside a verify pass and restored on exit, also after an exception.

Which linears: `verify_head.eligible_linears` (plain float32 CPU `nn.Linear`s), the one eligibility check.
"""

import contextlib
import threading
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn
from transformers.utils import logging

from . import verify_head
from .few_rows import version_counter
from .fingerprint import read_once, same
from .options import OPTIONS
from .packed_linear import _check_available
from .runtime import runtime_for
from .verify_attention import routed
from .verify_head import eligible_linears, step_scopes, swapped_linears, verify_kernels


logger = logging.get_logger(__name__)

BATCH_HINT = 8  # the row count oneDNN tunes the packed layout for (1–16 rows measured alike with 4, 8 and 16)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)  # row counts `measure` times; others take the next one above
WAYS = ("linear", "few rows", "packed")
REPEATS = 2  # timed passes per (row count, way) after one untimed; the fastest counts


# -- packed copies ------------------------------------------------------------------------------------------------


class _Group:
    """Linears of one parent fed the same input (q/k/v, gate/up, or one linear alone): one packed product for all,
    split back per member. A member called with another input than the group's last computes the group again."""

    def __init__(self, members: list[nn.Linear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.key: tuple | None = None
        self.made: tuple | None = None  # the members' weights' fingerprints when packed (`fingerprint.py`)
        self.stash: tuple | None = None  # (input, its version, {member index: output}) for the other members

    def _key(self) -> tuple:
        weights = [m._parameters["weight"] for m in self.members]
        return tuple((w, w.data_ptr(), version_counter(w)) for w in weights)

    def fresh(self) -> bool:
        """Whether every member's weight is still the tensor packed, at the same address and version (checked before
        every packed pass: a loop, not tuples, since it runs for every group of the target)."""
        if self.key is None:
            return False
        for (packed_weight, address, version), member in zip(self.key, self.members):
            weight = member._parameters.get("weight")
            if weight is not packed_weight or weight.data_ptr() != address or version_counter(weight) != version:
                return False
        return True

    def pack(self) -> None:
        weights = [m.weight.detach() for m in self.members]
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        biases = [m.bias for m in self.members]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.key = self._key()
        self.made = self._fingerprints({})

    def _fingerprints(self, fingerprints: dict) -> tuple:
        return tuple(read_once(t, fingerprints) for m in self.members for t in (m.weight, m.bias) if t is not None)

    def drop_if_changed(self, fingerprints: dict) -> bool:
        """Drop the packed copy if the members' weights' values changed since it was made (edits that leave the
        tensor, its address and its version counter as they were: through `.data`, of an inference tensor)."""
        if self.key is None or same(self.made, self._fingerprints(fingerprints)):
            return False
        self.packed = self.bias = self.key = self.made = None
        return True

    def product(self, x: torch.Tensor, pad_to: int) -> torch.Tensor:
        """(rows, in) -> (rows, sum of outs), through the packed weight, run as `pad_to` rows where that is more."""
        rows = x.shape[0]
        if pad_to > rows:
            x = torch.cat([x, x.new_zeros(pad_to - rows, x.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out[:rows] if pad_to > rows else out

    def output(self, index: int, x: torch.Tensor, pad_to: int) -> torch.Tensor:
        stash = self.stash
        if stash is not None and stash[0] is x and stash[1] == version_counter(x) and index in stash[2]:
            return stash[2].pop(index)
        rows = x.numel() // x.shape[-1]
        out = self.product(x.reshape(rows, x.shape[-1]), pad_to)
        if len(self.members) == 1:
            self.stash = None
            return out.reshape(*x.shape[:-1], -1)
        parts = [p.contiguous().reshape(*x.shape[:-1], -1) for p in out.split(self.sizes, dim=-1)]
        self.stash = (x, version_counter(x), {i: p for i, p in enumerate(parts) if i != index})
        return parts[index]


# Sibling linears that models feed the same input (by attribute name): packed as one product. A guess that is wrong
# for some model only costs time: a member called with another input than its group's last computes the group again.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"), ("w1", "w3"))


class TargetPacks:
    """The packed weight copies of one target's linears (see the module docstring for their memory cost)."""

    def __init__(self, groups: list[list[nn.Linear]]):
        self.groups = [_Group(members) for members in groups]
        self.index = {id(m): (g, i) for g in self.groups for i, m in enumerate(g.members)}

    @classmethod
    def of(cls, model: nn.Module, linears: list[nn.Linear] | None = None) -> "TargetPacks":
        """Every linear of `linears` (default: `eligible_linears(model)`) in a group: its `SIBLINGS` under the same
        parent with the same input width and bias presence, else alone."""
        linears = eligible_linears(model) if linears is None else linears
        wanted, grouped, groups = {id(m) for m in linears}, set(), []
        for parent in model.modules():
            children = dict(parent.named_children())
            for names in SIBLINGS:
                members = [children.get(name) for name in names]
                if all(m is not None and id(m) in wanted and id(m) not in grouped for m in members):
                    if len({(m.in_features, m.bias is None) for m in members}) == 1:
                        groups.append(members)
                        grouped.update(id(m) for m in members)
        groups += [[m] for m in linears if id(m) not in grouped]
        return cls(groups)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copies made so far (each the size of its weights)."""
        return sum(sum(m.weight.numel() * m.weight.element_size() for m in g.members) for g in self.groups if g.key)

    def refresh(self) -> None:
        """Pack what is not packed yet or whose weights changed (another tensor, an in-place update)."""
        for group in self.groups:
            if not group.fresh():
                group.packed = None  # drop the stale copy before making the new one
                group.pack()

    def drop_stale(self, fingerprints: dict | None = None) -> int:
        """Drop every packed copy whose weights' values changed since it was packed; returns how many. It reads
        every packed weight (`fingerprint.py`: 66-72 ms for SmolLM2-135M on 2 cores), so it runs once per
        `generate()` call, not per verify (`freshness.drop_stale`)."""
        fingerprints = {} if fingerprints is None else fingerprints
        return sum(group.drop_if_changed(fingerprints) for group in self.groups)

    def members(self) -> list[nn.Module]:
        return [m for g in self.groups for m in g.members]

    def clear(self) -> None:
        for group in self.groups:
            group.stash = None

    @contextlib.contextmanager
    def scope(self, model: nn.Module, pad_to: int = 0):
        """Within the block the linears compute through the packed copies, each product run as at least `pad_to`
        rows, and an "sdpa" model attends on its unrepeated cache (`verify_attention`); undone on exit."""
        self.refresh()
        modules = [m for g in self.groups for m in g.members if type(m) is nn.Linear]
        active = _scopes()
        for module in modules:
            active[id(module)] = (self, pad_to)
        try:
            with swapped_linears(model, modules, lambda module: PackedVerifyLinear):
                yield
        finally:
            for module in modules:
                active.pop(id(module), None)
            self.clear()


# per thread: id(module) -> (its packs, rows to pad to), inside that thread's scope only. Another thread decoding on
# the same target never reads this thread's scope: where it meets a linear this scope re-classed, the linear computes
# as `nn.Linear` does (`PackedVerifyLinear.forward`), the same values.
_THREAD = threading.local()


def _scopes() -> dict[int, tuple["TargetPacks", int]]:
    active = getattr(_THREAD, "active", None)
    if active is None:
        active = _THREAD.active = {}
    return active


class PackedVerifyLinear(nn.Linear):
    """An `nn.Linear` inside `TargetPacks.scope`: its product comes from its group's packed weight."""

    computes_as_linear = True  # the same product as `nn.Linear` (modeling_dspark's `_plain_linear` reads this)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        active = _active(self, x)
        if active is None:
            return nn.functional.linear(x, self.weight, self.bias)
        packs, pad_to = active
        group, index = packs.index[id(self)]
        return group.output(index, x, pad_to)


def _active(module: nn.Module, x: torch.Tensor) -> tuple["TargetPacks", int] | None:
    """(packs, rows to pad to) where `module`'s product of `x` runs packed: inside a scope, same dtype, no grad."""
    active = _scopes().get(id(module))
    if active is None or x.dtype != module.weight.dtype or torch.is_grad_enabled():
        return None
    return active


def fused_product(members: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor | None:
    """`members`' outputs on the same input `x` (..., in) concatenated along the last dim (..., sum of outs), as one
    packed product, where inside a `TargetPacks.scope` they are exactly one group, in that order; else None (call
    the modules). The same values the modules return one by one (their group computes them as this product). The
    modules are not called: the caller makes sure none has a hook (`compat.only_capturing_hooks`)."""
    active = _active(members[0], x)
    if active is None:
        return None
    packs, pad_to = active
    group, index = packs.index[id(members[0])]
    if index or len(group.members) != len(members) or any(a is not b for a, b in zip(group.members, members)):
        return None
    if any(type(m) is not PackedVerifyLinear for m in members):
        return None
    rows = x.numel() // x.shape[-1]
    return group.product(x.reshape(rows, x.shape[-1]), pad_to).reshape(*x.shape[:-1], -1)


def packs_for(model: nn.Module, linears: list[nn.Linear] | None = None) -> TargetPacks:
    """The `TargetPacks` of `model`, in its `TargetRuntime` (copies are made on first use). Packs for linears the
    model no longer holds are dropped once per call by `stale_packs`, not here: this runs at every verify."""
    runtime = runtime_for(model)
    if runtime.packs is None:
        runtime.packs = TargetPacks.of(model, linears)
    return runtime.packs


def _same_modules(a: list[nn.Module], b: list[nn.Module]) -> bool:
    return len(a) == len(b) and {id(m) for m in a} == {id(m) for m in b}


def stale_packs(model: nn.Module, fingerprints: dict) -> int:
    """Drop `model`'s packs for linears it no longer holds as packed (swapped, wrapped, another dtype) and the
    packed copies whose weights' values changed; returns how many copies were dropped."""
    runtime = runtime_for(model)
    packs = runtime.packs
    if packs is None:
        return 0
    if not _same_modules(packs.members(), eligible_linears(model)):
        runtime.packs = None
        return len(packs.groups)
    return packs.drop_stale(fingerprints)


def free_packs(model: nn.Module) -> int:
    """Drop `model`'s packed copies; returns the bytes freed. The next packed verify makes them again."""
    runtime = runtime_for(model)
    packs, runtime.packs = runtime.packs, None
    return packs.nbytes if packs is not None else 0


def packable(model: nn.Module, linears: list[nn.Linear] | None = None) -> bool:
    """Whether packed verifies can run here: enabled, oneDNN's operators present, float32 CPU linears to pack."""
    linears = eligible_linears(model) if linears is None else linears
    return OPTIONS.packs and bool(linears) and _check_available()


# -- the measured choice ------------------------------------------------------------------------------------------


class KernelTable:
    """Per row count: how the target's linears run (`WAYS`) and, for "packed", the row count to pad to.

    `ms[way][rows]`: one pass over the target's linears, measured; `choose` keeps the fastest way per row count,
    "packed" priced at the cheapest measured row count at or above (it can be padded to it).
    """

    def __init__(self, choice: dict[int, tuple[str, int]], ms: dict[str, dict[int, float]] | None = None):
        self.choice = dict(sorted(choice.items()))
        self.ms = ms or {}

    @classmethod
    def choose(cls, ms: dict[str, dict[int, float]]) -> "KernelTable":
        rows_measured = sorted({r for table in ms.values() for r in table})
        packed = ms.get("packed", {})
        choice = {}
        for rows in rows_measured:
            options = [(ms[way][rows], way, rows) for way in ("linear", "few rows") if rows in ms.get(way, {})]
            wider = [(t, r) for r, t in packed.items() if r >= rows]
            if wider:
                seconds, pad = min(wider)
                options.append((seconds, "packed", pad))
            if options:
                _, way, pad = min(options, key=lambda o: (o[0], WAYS.index(o[1])))
                choice[rows] = (way, pad)
        return cls(choice, ms)

    def way(self, rows: int) -> tuple[str, int]:
        """(way, rows to pad to) for a pass of `rows` rows; unmeasured counts take the next measured one's way
        unpadded; beyond the widest measured, transformers' own linears."""
        if rows in self.choice:
            return self.choice[rows]
        above = [r for r in self.choice if r > rows]
        if not above:
            return ("linear", rows)
        return (self.choice[min(above)][0], rows)

    def pad(self, way: str, rows: int) -> int:
        """The row count a pass of `rows` rows the `way` way runs at: "packed" at its cheapest measured count at or
        above `rows` (as `choose` prices it), the others unpadded."""
        packed = [(t, r) for r, t in self.ms.get("packed", {}).items() if r >= rows]
        return min(packed)[1] if way == "packed" and packed else rows

    def to_json(self) -> dict:
        return {
            "choice": {str(r): [way, pad] for r, (way, pad) in self.choice.items()},
            "ms": {way: {str(r): round(t, 3) for r, t in table.items()} for way, table in self.ms.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> "KernelTable":
        choice = {}
        for rows, (way, pad) in data["choice"].items():
            if way not in WAYS or int(pad) < int(rows):
                raise ValueError(f"kernel choice {rows}: {[way, pad]} is not one of {WAYS} padded to >= rows")
            choice[int(rows)] = (way, int(pad))
        ms = {way: {int(r): float(t) for r, t in table.items()} for way, table in data.get("ms", {}).items()}
        return cls(choice, ms)


@torch.no_grad()
def measure(
    model: nn.Module,
    linears: list[nn.Linear] | None = None,
    rows: Iterable[int] = ROWS,
    repeats: int = REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> KernelTable:
    """Time one pass over the model's linears (random rows, own generator) per row count and way; the fastest of
    `repeats` after an untimed one counts. "few rows" is timed where its products act (`verify_head`), "packed"
    where the operators exist (the copies are made here, once)."""
    linears = eligible_linears(model) if linears is None else linears
    if not linears:
        return KernelTable({})
    generator = torch.Generator().manual_seed(0)
    widths = sorted({m.in_features for m in linears})
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    packs = packs_for(model, linears) if packable(model, linears) else None
    if packs is not None:
        packs.refresh()
    ms: dict[str, dict[int, float]] = {way: {} for way in WAYS}
    for n in sorted(set(rows)):
        inputs = {w: torch.randn(n, w, generator=generator) for w in widths}
        ways = ["linear"]
        if OPTIONS.verify_head and verify_head.MIN_ROWS <= n <= verify_head.MAX_ROWS_HEAD:
            ways.append("few rows")
        if packs is not None:
            ways.append("packed")
        for way in ways:
            times = []
            for i in range(repeats + 1):
                start = clock()
                _one_pass(way, inputs, linears, head, packs)
                if i:
                    times.append(clock() - start)
            ms[way][n] = 1e3 * min(times)
    return KernelTable.choose({way: table for way, table in ms.items() if table})


def _one_pass(way: str, inputs: dict, linears: list[nn.Linear], head, packs: TargetPacks | None) -> None:
    """Every linear of the target called once on `inputs[in_features]`, through the module call a verify makes in
    the `way`'s scope (so the measurement includes each way's per-call overhead, and fused siblings share a call)."""
    model = _Linears(linears, head)
    if way == "packed":
        scope = packs.scope(model)
    elif way == "few rows":
        scope = verify_kernels(model, linears)
    else:
        scope = contextlib.nullcontext()
    with scope:
        for m in linears:
            m(inputs[m.in_features])


class _Linears(nn.Module):
    """A stand-in model for `_one_pass`'s scopes: no config (nothing to route), the LM head as its output layer."""

    def __init__(self, linears, head):
        super().__init__()
        object.__setattr__(self, "_head", head)  # not registered: the user's modules stay where they are

    def get_output_embeddings(self):
        return self._head


class VerifyKernels:
    """How one target's verify passes (and plain steps in a decode loop) run on this machine: a `KernelTable`,
    measured on first use (`measure`) unless set from a matching profile (`profiling.sps_for`), kept up to date as
    it runs.

    The table times the linears alone, on a quiet machine, from two passes: what a whole verify costs each way can
    differ (the packed way's fused products are split and padded rows dropped in the forward, the few-row products
    leave the attention as it is), and another process on the same cores changes which way is fastest (oneDNN's many
    small calls wait on busy threads longer than transformers' own products). So each verify is timed, per row count,
    way and intra-op thread count (`threads.py` may run a round at fewer), exponentially weighted (`weight`; a packed
    or few-row way's first verify, which may pack the weights, left out); the 2nd, 4th, ... verifies at a row count
    try each other way that applies until each has been measured, every `retry`-th one after that the next of them
    in turn, and the way with the lowest measured time is used. A retry costs what the slower way costs (`F.linear`
    took 1.7–2.9x a packed verify on a 2-core AMD EPYC): while retries keep finding the others at least `margin`
    times slower than the best, the row count's interval doubles up to `max_retry`; a retry within the margin sets it
    back to `retry`.
    """

    def __init__(
        self,
        table: KernelTable | None = None,
        retry: int = 16,
        weight: float = 0.3,
        clock: Callable[[], float] = time.perf_counter,
        max_retry: int = 128,
        margin: float = 1.25,
    ):
        self.table, self.retry, self.weight, self.clock = table, retry, weight, clock
        self.max_retry, self.margin = max_retry, margin
        self.intervals: dict[int, int] = {}  # rows -> verifies between retries (`retry`, doubled while they lose)
        self.due: dict[int, int] = {}  # rows -> the verify count at which the next retry runs
        self.retried: tuple[int, str] | None = None  # (rows, way) of the retry in flight
        self.seconds: dict[tuple[int, str, int], float] = {}  # (rows, way, threads) -> smoothed seconds of a verify
        self.seen: dict[tuple[int, str], int] = {}
        self.verifies: dict[int, int] = {}
        self.retries: dict[int, int] = {}
        self.trial = False  # the last verify ran a way on trial (a retry, a way not yet measured): not typical

    def ensure(self, model: nn.Module, linears: list[nn.Linear] | None = None) -> KernelTable:
        if self.table is None:
            start = time.perf_counter()
            self.table = measure(model, linears, clock=self.clock)
            logger.info(
                f"Measured the target's verify kernels in {time.perf_counter() - start:.1f} s: "
                f"{ {r: w for r, (w, _) in self.table.choice.items()} }"
            )
        return self.table

    def pick(self, rows: int, way: str, others: Iterable[str] = ()) -> str:
        """The way this verify of `rows` rows runs, among the table's `way`, `others` and `F.linear`: the one that
        measured fastest lately (the table's until it is measured), or one of the others on a retry."""
        n = self.verifies.get(rows, 0)
        self.verifies[rows] = n + 1
        options = [way, *(o for o in others if o != way)]
        if "linear" not in options and way != "linear":
            options.append("linear")
        self.trial = False
        if len(options) == 1:
            return way
        threads = torch.get_num_threads()
        measured = {o: self.seconds[(rows, o, threads)] for o in options if (rows, o, threads) in self.seconds}
        best = min(measured, key=measured.get) if way in measured else way
        self.trial = True  # until shown otherwise: a way tried, or the table's before it is measured
        due = n >= self.due.get(rows, self.retry - 1)
        if (n % 2 and n < 2 * len(options)) or due:  # early, then seldom
            alternatives = [o for o in options if o != best]
            unmeasured = [o for o in alternatives if o not in measured]
            if unmeasured:
                return unmeasured[0]
            if due:
                self.due[rows] = n + self.intervals.get(rows, self.retry)
            self.retries[rows] = self.retries.get(rows, 0) + 1
            tried = alternatives[self.retries[rows] % len(alternatives)]
            self.retried = (rows, tried)
            return tried
        self.trial = best not in measured
        return best

    def record(self, rows: int, way: str, seconds: float) -> None:
        seen = self.seen[(rows, way)] = self.seen.get((rows, way), 0) + 1
        if seen == 1 and way != "linear":
            return  # a warm-up (packing the weights, first kernels); transformers' own products have none
        threads = torch.get_num_threads()
        key = (rows, way, threads)  # a way's speed at the thread count it ran at (`threads.py`)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - self.weight) * old + self.weight * seconds
        if self.retried == (rows, way):  # a retry: back off while the others stay clearly slower
            self.retried = None
            others = [t for (r, w, n), t in self.seconds.items() if r == rows and n == threads and w != way]
            losing = bool(others) and self.seconds[key] >= self.margin * min(others)
            interval = self.intervals.get(rows, self.retry)
            self.intervals[rows] = min(2 * interval, self.max_retry) if losing else self.retry
            self.due[rows] = self.verifies[rows] - 1 + self.intervals[rows]

    @contextlib.contextmanager
    def verify(self, model: nn.Module, rows: int, linears: list[nn.Linear] | None = None):
        """One forward of `rows` rows through the target, its linears the measured way."""
        self.trial = False
        if OPTIONS.verify_way is not None:
            way, pad = OPTIONS.verify_way, rows
        elif OPTIONS.verify_head:
            table = self.ensure(model, linears)
            way, pad = table.way(rows)
            others = ["few rows"] if verify_head.MIN_ROWS <= rows <= verify_head.MAX_ROWS_HEAD else []
            others += ["packed"] if packable(model, linears) else []
            chosen = self.pick(rows, way, others)
            if chosen != way:
                way, pad = chosen, table.pad(chosen, rows)
        else:
            way, pad = "linear", rows
        if way == "packed" and not packable(model, linears):
            way = "linear"
        start = self.clock()
        if way == "packed":
            with packs_for(model, linears).scope(model, pad):
                yield
        elif way == "few rows":
            with verify_kernels(model, linears):
                yield
        else:
            with routed(model):
                yield
        if OPTIONS.verify_way is None:
            self.record(rows, way, self.clock() - start)


def kernel_choice(model: nn.Module) -> VerifyKernels:
    """The `VerifyKernels` of `model` (in its `TargetRuntime`, never on the model)."""
    runtime = runtime_for(model)
    if runtime.kernels is None:
        runtime.kernels = VerifyKernels()
    return runtime.kernels


def measured_steps(model: nn.Module):
    """Within the block, every one-token decoding step of `model.generate()` (a keyword call with a filled cache)
    runs its linears the way measured for its rows (`kernel_choice`), as a plain round of a decode loop does: plain
    decoding at the verify kernels' speed, the kernel-neutral baseline of `dspark-hf bench`. Same tokens up to float
    rounding; the hooks are removed on exit."""
    choice, linears = kernel_choice(model), eligible_linears(model)
    return step_scopes(model, lambda kwargs: choice.verify(model, kwargs["input_ids"].numel(), linears))


__all__ = [
    "KernelTable",
    "PackedVerifyLinear",
    "TargetPacks",
    "VerifyKernels",
    "free_packs",
    "fused_product",
    "kernel_choice",
    "measure",
    "measured_steps",
    "packable",
    "packs_for",
]
