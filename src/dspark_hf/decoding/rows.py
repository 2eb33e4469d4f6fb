"""Rows of a decoding batch, the drafts proposed for them, and how their logits are processed and sampled.

Shared by the round (`core.py`) and the candidate generators (`decoding/drafting.py`), so that a draft and the
target's verify of it process logits by exactly the same rule.
"""

import itertools
import operator
from dataclasses import dataclass, field

import torch

from ..models.settings import SAMPLING_MODES, check_choice
from .acceptance import accept_standard
from .randomness import draw, gumbel_choice, gumbel_noise, stream_key
from .stats import DSparkGenerationStats


class Row:
    """One sequence being decoded. Drivers subclass it to say how logits are processed and tokens committed.

    seq: committed tokens (prompt + output, no padding); the last one is the anchor, not yet run through the target.
    Logits are processed either by `warpers` shared by every row with the same `sampling_key` (prefix-free, so one
    pass serves them all: the Engine's temperature / top-k / top-p), or by `processors` called with each position's
    own prefix (`processor_ids()` + the drafts before it: transformers' logits processors in `generate()`).
    """

    sampling_key: tuple | None = None
    warpers = None
    processors = None
    keeps_hidden_states = False  # whether `commit` wants the target's hidden states of each token (all layers)

    def __init__(
        self,
        prompt_ids: list[int],
        *,
        do_sample=False,
        seed: int | None = None,
        block_size: int = 0,
        sampling: str = "coupled",
    ):
        if do_sample and seed is None:
            raise ValueError("A sampling row needs a seed (its noise at each position is keyed by it).")
        check_choice("sampling", sampling, SAMPLING_MODES)
        self.seq = list(prompt_ids)
        self.do_sample, self.seed = do_sample, seed
        # "coupled": the Gumbel-max coupling keyed by position; "standard": rejection sampling (`acceptance.py`)
        self.sampling = sampling
        self._generator: torch.Generator | None = None  # the standard mode's stream, made at its first draw
        self._noise: dict[int, torch.Tensor] = {}  # position -> its Gumbel noise (V,), until the position is committed
        self.noise_device = None  # where the noise is made (the decoder sets the target's: one device type per row)
        self.finished = False
        self._context: list[torch.Tensor] = []  # pieces of `context`, joined when read
        self._context_length = 0  # their entries in all
        self.hint: list[float] | None = None  # conditional confidences of its last drafted round (the gate's guess)
        self.suffix_index = None  # where its n-grams occurred (`lookup.SuffixIndex`), made at its first lookup
        self.stats = DSparkGenerationStats(block_size=block_size, num_prompt_tokens=len(self.seq))

    @property
    def context(self) -> torch.Tensor | None:
        """(n, m·d) target features not yet in the drafter's cache (None: none), joined once when a draft reads it."""
        if len(self._context) > 1:
            self._context = [torch.cat(self._context)]
        return self._context[0] if self._context else None

    @context.setter
    def context(self, value: torch.Tensor | None) -> None:
        self._context = [] if value is None else [value]
        self._context_length = 0 if value is None else value.shape[0]

    def add_context(self, features: torch.Tensor, reach: int | None = None) -> None:
        """Append target features (n, m·d) to `context` without copying what it holds: a round the draft gate keeps
        plain adds one position, and over a 4k prompt re-joining the whole context each such round cost more than
        the step's own attention. `reach`: a draft reads only the last `reach` entries (the drafter's
        `context_window`), so older ones are dropped (and a view of a larger tensor is copied, letting it go)."""
        if reach is not None and features.shape[0] > reach:
            features = features[-reach:].clone()
        self._context.append(features)
        self._context_length += features.shape[0]
        if reach is not None:  # hold fewer than 2·reach entries
            while len(self._context) > 1 and self._context_length - self._context[0].shape[0] >= reach:
                self._context_length -= self._context.pop(0).shape[0]
            if self._context_length >= 2 * reach:  # a joined piece (read, not drafted)
                self.context = torch.cat(self._context)[-reach:].clone()

    @property
    def anchor_position(self) -> int:
        return len(self.seq) - 1

    @property
    def remaining(self) -> int:
        """Tokens the row may still commit (a round commits at most drafts + 1)."""
        raise NotImplementedError

    def noise(self, positions: range, vocab_size: int, device) -> torch.Tensor:
        """The row's Gumbel noise at absolute `positions`: (n, V), keyed by (seed, position) only (`randomness.py`).
        Made once per position, on `noise_device` (else `device`): the draft and the verify of a position share it."""
        self._noise = {t: g for t, g in self._noise.items() if t >= len(self.seq)}  # committed: never asked again
        missing = [t for t in dict.fromkeys(positions) if t not in self._noise]  # a tree repeats positions
        if missing:
            made = gumbel_noise(self.seed, missing, vocab_size, self.noise_device or device)
            self._noise.update(zip(missing, made))
        return torch.stack([self._noise[t] for t in positions]).to(device)

    @property
    def standard(self) -> bool:
        """Whether the row samples with standard speculative sampling (greedy rows ignore `sampling`)."""
        return self.do_sample and self.sampling == "standard"

    def uniforms(self, n: int, device) -> torch.Tensor:
        """The next n U[0, 1) draws (n,) float64 of the row's own generator (standard sampling), seeded by
        `randomness.stream_key(seed)` on `noise_device` (else `device`) at the first call."""
        where = torch.device(self.noise_device or device)
        if self._generator is None:
            self._generator = torch.Generator(device=where).manual_seed(stream_key(self.seed))
        return torch.rand(n, generator=self._generator, dtype=torch.float64, device=where).to(device)

    def processor_ids(self) -> list[int]:
        """The ids `processors` see before the drafts: the committed sequence (drivers may prepend padding)."""
        return self.seq

    def commit(self, tokens: list[int], scores=None, logits=None, hidden_states=None) -> int:
        """Take tokens as plain decoding would, stopping where it stops; sets `finished`. Returns how many it took.

        For drivers that return them: scores (n, V), the processed target logits each token was chosen from; logits
        (n, V), the same unprocessed; hidden_states (rows with `keeps_hidden_states`), per token the target's hidden
        states (layers + 1, positions, d) of the forward that chose it (the whole prompt for the first token).
        """
        raise NotImplementedError


@dataclass
class Drafts:
    """One round's drafts for all rows.

    tokens (B, K): drafts (K = the most any row sampled; columns past a row's own are padding); logits (B, K, V):
    the processed draft logits they were chosen from, kept for inspection when a row samples (else None);
    lengths: ℓ_r to verify; conditional: c_{r,k}, the calibrated conditional acceptance of the positions row r
    examined.

    A tree (`decoding/trees.py`) has its nodes as the columns, in join order: parents (B, K) the verify slot of each
    node's parent (0: the anchor; node i sits at slot i + 1), depths (B, K) its draft position; `conditional` then
    holds a_i / a_{i-1} of the nodes' path estimates a_i, and `lengths` counts nodes. A chain has neither.

    Where drafts came from: `lookup` maps a row that took a context lookup's continuation (`lookup.py`) to its match
    length; a chain row's drafts are then the lookup's, a tree row's lookup path is `lookup_paths[row]` (its nodes,
    from the anchor's child down). Every other draft is the drafter's.
    """

    tokens: torch.LongTensor
    logits: torch.Tensor | None
    lengths: list[int]
    conditional: list[list[float]]
    parents: torch.LongTensor | None = None
    depths: torch.LongTensor | None = None
    lookup: dict[int, int] = field(default_factory=dict)
    lookup_paths: dict[int, list[int]] = field(default_factory=dict)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def survival(self) -> list[list[float]]:
        """Cumulative survival a_{r,k} = Π_{i<=k} c_{r,i} per row."""
        return [list(itertools.accumulate(c, operator.mul)) for c in self.conditional]

    @classmethod
    def none(cls, n_rows: int, device) -> "Drafts":
        """A plain step: every row verifies only its anchor."""
        return cls(torch.zeros(n_rows, 0, dtype=torch.long, device=device), None, [0] * n_rows, [[]] * n_rows)


def _warp_shared(rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
    """The prefix-free warpers of rows without `processors`: one pass per `sampling_key` over its rows' slots."""
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        if row.processors is None and row.sampling_key is not None and row.warpers:
            groups.setdefault(row.sampling_key, []).append(i)
    for members in groups.values():
        index = torch.tensor(members, device=logits.device)
        part = logits[index]
        flat = part.reshape(-1, part.shape[-1])  # (rows · slots, V): warpers act per row
        logits[index] = rows[members[0]].warpers(None, flat).reshape(part.shape)
    return logits


def _wants_processing(rows: list[Row]) -> bool:
    return any(row.processors is not None or (row.sampling_key is not None and row.warpers) for row in rows)


def process_logits(
    rows: list[Row], logits: torch.Tensor, drafts: torch.Tensor | None = None, first: int = 0, paths=None
) -> torch.Tensor:
    """Each row's logits processing on logits (B, S, V); slot s of row r follows seq_r + drafts[r, :first + s], or
    seq_r + paths[r][s] (a tree's slots follow their own ancestors).

    Rows with equal `sampling_key` share one warper pass; rows with `processors` are processed slot by slot with
    their own prefix, as transformers processes every position of a verify. Unprocessed rows pass through unchanged.
    """
    if not _wants_processing(rows):
        return logits
    logits = _warp_shared(rows, logits.clone())
    for i in (i for i, row in enumerate(rows) if row.processors is not None):
        prefix = torch.tensor([rows[i].processor_ids()], device=logits.device)  # (1, L)
        for s in range(logits.shape[1]):
            if paths is not None:
                ids = torch.cat([prefix, torch.tensor([paths[i][s]], dtype=prefix.dtype, device=prefix.device)], 1)
            elif drafts is None:
                ids = prefix
            else:
                ids = torch.cat([prefix, drafts[i : i + 1, : first + s].to(prefix)], dim=1)
            logits[i, s] = rows[i].processors(ids, logits[i, s][None])[0]
    return logits


def process_and_choose(
    rows: list[Row],
    logits: torch.Tensor,
    tokens: torch.LongTensor,
    lengths: list[int],
    parents: torch.LongTensor | None = None,
    depths: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.LongTensor]:
    """process → choose over a verify's slots: the processed logits (B, W, V) and the target's choice at every slot
    a row verifies (B, W; `choose_tokens`).

    Slot 0 is the anchor; slot s ≥ 1 holds draft s - 1 of tokens (B, ≥ W - 1), whose parent is slot s - 1 in a chain
    and slot parents[r, s - 1] in a tree, where depths[r, s - 1] is its draft position (the slot chooses the token
    after it). Row r verifies its first lengths[r] drafts.

    Rows with `processors` are processed slot by slot, each slot with its own path as prefix, but only along the
    walk that acceptance can take: a slot whose parent's choice is not its token is never reached, nor is a slot
    past the drafts verified, so its logits stay unprocessed and its choice is never read. A chain stops at its
    first rejected draft; transformers' verify processes every slot, and on a chain the calls past the first
    rejection were most of them. Rows with `sampling="standard"` are processed at every slot verified (their
    acceptance reads each slot's distribution) and choose nothing here (`accept_standard_rows` draws theirs).
    """
    width = logits.shape[1]
    offsets = None  # a tree's slot s chooses the token at depth(s) + 1
    if depths is not None:
        offsets = [[0] + row_depths for row_depths in depths[:, : width - 1].tolist()]
    counts = [0 if row.standard else n + 1 for row, n in zip(rows, lengths)]
    own = [i for i, row in enumerate(rows) if row.processors is not None]
    if _wants_processing(rows):
        logits = _warp_shared(rows, logits.clone())
    walked: dict[int, dict[int, int]] = {}  # row -> slot -> its choice, for the slots processed along the walk
    drafted = tokens.tolist()
    up = parents.tolist() if parents is not None else None
    for i in own:
        row, prefix = rows[i], rows[i].processor_ids()
        walk = None if row.standard else walked.setdefault(i, {})  # a standard row reads every slot
        paths: dict[int, list[int]] = {0: []}  # slot -> the drafts before the token it chooses
        for s in range(min(width, lengths[i] + 1)):
            if s > 0:
                parent = s - 1 if up is None else up[i][s - 1]
                if walk is not None and walk.get(parent) != drafted[i][s - 1]:  # never reached
                    if up is None:
                        break  # a chain: every later slot hangs below this one
                    continue
                paths[s] = paths[parent] + [drafted[i][s - 1]]
            ids = torch.tensor([prefix + paths[s]], device=logits.device)
            logits[i, s] = row.processors(ids, logits[i, s][None])[0]
            if walk is not None:
                at = [[s if offsets is None else offsets[i][s]]]
                walk[s] = choose_tokens([row], logits[i : i + 1, s : s + 1], offsets=at)[0, 0].item()
    # the walked rows' choices are set above (the rest of their slots: never read)
    choices = choose_tokens(
        rows, logits, counts=[0 if i in walked else n for i, n in enumerate(counts)], offsets=offsets
    )
    for i, chosen in walked.items():
        for s, token in chosen.items():
            choices[i, s] = token
    return logits, choices


def choose_tokens(
    rows: list[Row], logits: torch.Tensor, first: int = 0, counts: list[int] | None = None, offsets=None
) -> torch.LongTensor:
    """Each row's choice from processed logits (B, S, V): slot s of row r chooses the token at absolute position
    len(seq_r) + first + s, or len(seq_r) + offsets[r][s] (a tree's slots: their depths). Greedy rows: the argmax.
    Sampling rows: argmax(logits + g_{seed, position}), a draw from softmax(logits) whose noise depends only on the
    row's seed and the position (Gumbel-max), for the first `counts[r]` slots (None: all); slots past them keep the
    argmax. A row with standard sampling draws those slots from softmax(logits) with its own generator's uniforms
    instead (`Row.uniforms`). Returns (B, S) on the logits' device."""
    tokens = logits.argmax(dim=-1)
    for i, row in enumerate(rows):
        n = logits.shape[1] if counts is None else min(counts[i], logits.shape[1])
        if row.standard and n > 0:
            tokens[i, :n] = draw(torch.softmax(logits[i, :n].float(), dim=-1), row.uniforms(n, logits.device))
        elif row.do_sample and n > 0:
            start = len(row.seq) + first
            positions = range(start, start + n) if offsets is None else [len(row.seq) + o for o in offsets[i][:n]]
            noise = row.noise(positions, logits.shape[-1], logits.device)
            tokens[i, :n] = gumbel_choice(logits[i, :n], noise)
    return tokens


def accept_standard_rows(
    rows: list[Row], tokens: torch.LongTensor, draft_logits: torch.Tensor | None, processed: torch.Tensor, lengths
) -> tuple[list[int], torch.LongTensor, torch.LongTensor]:
    """Standard speculative sampling (`acceptance.accept_standard`) for the rows with `sampling="standard"`.

    tokens (B, W-1): a chain's drafts; draft_logits (B, ≥ W-1, V): the processed logits they were drawn from
    (`Drafts.logits`); processed (B, W, V): the target's processed logits; lengths (B,). Each such row takes
    lengths[r] + 1 fresh uniforms from its generator (the acceptance tests, then the residual or bonus draw).
    Returns (their indices, accepted counts, bonus tokens) for those rows; nothing for the other rows.
    """
    index = [i for i, row in enumerate(rows) if row.standard]
    if not index:
        return [], lengths.new_zeros(0), lengths.new_zeros(0)
    width, device = processed.shape[1], processed.device
    at = torch.tensor(index, device=device)
    own = lengths.to(device)[at]  # (b,)
    uniforms = torch.zeros(len(index), width, dtype=torch.float64, device=device)  # (b, W): tests, then the draw
    for j, (i, n) in enumerate(zip(index, own.tolist())):
        drawn = rows[i].uniforms(n + 1, device)
        uniforms[j, :n], uniforms[j, -1] = drawn[:n], drawn[n]
    draft_probs = processed.new_zeros(len(index), width - 1, processed.shape[-1])  # (b, W-1, V)
    if draft_logits is not None and width > 1:  # (none: a round without a draft pass, these rows verify nothing)
        draft_probs = torch.softmax(draft_logits[at.to(draft_logits.device), : width - 1].to(device).float(), dim=-1)
    target_probs = torch.softmax(processed[at].float(), dim=-1)  # (b, W, V)
    accepted, bonus = accept_standard(
        tokens[at], draft_probs, target_probs, own, uniforms[:, : width - 1], uniforms[:, -1]
    )
    return index, accepted, bonus


__all__ = ["Drafts", "Row", "accept_standard_rows", "choose_tokens", "process_and_choose", "process_logits"]
