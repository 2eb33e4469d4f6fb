"""Candidate generators: the draft step of the round (`core.py`), one class per drafter kind.

A candidate generator proposes drafts for every row of the batch at once and keeps the drafter's own state between
rounds. `propose(rows, caps, policy)` returns a `core.Drafts`: the draft tokens, the processed draft logits they were
chosen from (argmax, or for a sampling row argmax(logits + g) with the noise g its target choice at that position
uses, `randomness.py`) and, where the drafter has a confidence head, the calibrated
conditional acceptance of each position examined. The policy then chooses how many to verify.

- `DSparkCandidateGenerator` (DSpark, DFlash mode included): each row appends the target features it committed
  since its last draft to the drafter's ragged context cache; one parallel block pass over [anchor, mask, ...] for
  every row; then the block is sampled position by position through the sequential head, the confidence head
  scoring each position before its token exists (DSpark §3.5), until the policy's lengths are settled.
- `Eagle3CandidateGenerator`: an EAGLE-3 drafter feeds its own output back, one forward per draft, row by row.

transformers' `CandidateGenerator` interface is batch-1 (one (1, L) tensor in, candidates and logits out); these
keep its role, not its signature, since rows here hold different numbers of tokens. To add a drafter kind, write a
class with `block_size`, `taps`, `cache`, `add_rows`, `select`, `reset` and `propose`, and name it in
`candidate_generator_for`.
"""

import torch
from transformers.cache_utils import DynamicCache

from ..kernels.options import OPTIONS
from ..kernels.packed_linear import pack_linears
from ..kernels.weights import out_features
from ..models.configuration_dspark import EARLY_DRAFT_POSITIONS
from ..utils.devices import below_float16, below_float16_text, model_device, module_device
from .ragged_cache import RaggedCache
from .rows import Drafts, choose_tokens, process_logits
from .scheduler import conditional_confidences
from .trees import calibrated, grow_trees, tree_drafts


DRAFTER_TYPES = ("dspark", "dspark_eagle3")


def is_drafter(model) -> bool:
    """Whether `model` is one of this package's drafters (duck-typed on `config.model_type`, so a drafter loaded with
    `trust_remote_code` counts too)."""
    return getattr(getattr(model, "config", None), "model_type", None) in DRAFTER_TYPES


def candidate_generator_for(drafter, target):
    """The candidate generator for one of this package's drafters (dispatch on `config.model_type`, so a drafter
    loaded with `trust_remote_code` works too)."""
    model_type = getattr(getattr(drafter, "config", None), "model_type", None)
    if model_type == "dspark":
        return DSparkCandidateGenerator(drafter, target)
    if model_type == "dspark_eagle3":
        return Eagle3CandidateGenerator(drafter, target)
    raise TypeError(
        f"The drafter must be a DSpark or EAGLE-3 drafter of this package (config.model_type 'dspark' or "
        f"'dspark_eagle3'), got {type(drafter).__name__} with model_type {model_type!r}."
    )


class _Generator:
    """What both drafter kinds share: the borrowed embedding and LM head, the target layers tapped."""

    def __init__(self, drafter, target):
        if drafter.dtype == torch.float16 and (tiny := below_float16(drafter)):
            raise ValueError(
                f"The drafter runs in float16, but {below_float16_text(tiny)}. Load it in bfloat16 or float32 "
                "instead (from_pretrained(..., dtype=torch.bfloat16))."
            )
        self.drafter, self.config = drafter, drafter.config
        self.block_size = self.config.block_size
        self.taps = [i + 1 for i in self.config.target_layer_ids]  # +1: hidden_states[0] is the embedding output
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(target).__name__} has no output embeddings (LM head) for the drafter to borrow.")
        self.device = next(drafter.parameters()).device
        self.target_device = model_device(target)
        pack_linears(drafter)  # the drafter's CPU linears through oneDNN's packed weights (packed_linear.py)

    @property
    def context_reach(self) -> int | None:
        """How many of a row's latest context entries a draft reads: `config.context_window` (None: all), read each
        round since a live config can change."""
        return getattr(self.config, "context_window", None)


class DSparkCandidateGenerator(_Generator):
    """Drafts a block per row with a DSpark drafter: one parallel pass, then the sequential and confidence heads."""

    def __init__(self, drafter, target):
        super().__init__(drafter, target)
        self.temperatures = drafter.sts_temperatures.tolist()
        self.cache = RaggedCache(self.device)

    def add_rows(self, n: int) -> None:
        self.cache.extend(RaggedCache(self.device, batch_size=n))  # no context yet: the first draft brings it

    def select(self, keep: list[int]) -> None:
        self.cache.select(keep)

    def reset(self) -> None:
        self.cache = RaggedCache(self.device)

    @property
    def tree_budget(self) -> int | str:
        """`config.tree_budget` as set, read each round (0: chains; "auto": the decoder decides per round)."""
        return getattr(self.config, "tree_budget", 0)

    @property
    def context_lookup(self) -> int:
        """`config.context_lookup`, read each round (0: the drafter's chains only; `decoding/lookup.py`)."""
        return getattr(self.config, "context_lookup", 0)

    def propose(self, rows, caps: list[int], policy, early: bool = True, tree_budget: int = 0):
        """Drafts for every row: `core.Drafts` with tokens (B, K), logits (B, K, V) and conditional confidences;
        with `tree_budget` nodes (the round's, `SpeculativeDecoder.tree_budget`) a tree per row
        (`decoding/trees.py`), caps[r] bounding its depth."""
        if tree_budget:
            return self._tree(self._block(rows), rows, caps, tree_budget, policy if early else None)
        return self._sample(self._block(rows), rows, caps, policy, early)

    def _block(self, rows) -> torch.Tensor:
        """Backbone pass for all rows; returns h (B, γ, d). The drafter cache keeps the new context, not the block.

        Row r appends its n_r new context entries (positions start_r .. start_r + n_r - 1, padded to the longest
        row and masked) and runs the block [anchor, mask, ...] at positions anchor_r .. anchor_r + γ - 1.
        """
        gamma, device, window = self.block_size, self.device, getattr(self.config, "context_window", None)
        # a bounded window (`context_window`) sees only the last W context entries: older ones are never projected
        contexts = [(row.context if window is None else row.context[-window:]).to(device) for row in rows]
        n_new = torch.tensor([context.shape[0] for context in contexts], device=device)
        if window is not None:  # the cache keeps what the window still reaches beside the new entries
            self.cache.keep_last(window - n_new)
        context = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True)  # (B, C, m·d), zero-padded
        width = context.shape[1]
        ctx_valid = torch.arange(width, device=device)[None] < n_new[:, None]  # (B, C)
        anchor = torch.tensor([row.anchor_position for row in rows], device=device)
        start = anchor - n_new  # the context always ends right before the anchor
        ctx_positions = start[:, None] + torch.arange(width, device=device)  # (B, C)
        block_positions = anchor[:, None] + torch.arange(gamma, device=device)  # (B, γ)
        position_ids = torch.cat([ctx_positions, block_positions], dim=1)  # (B, C + γ)
        keys = torch.cat([self.cache.valid, ctx_valid, ctx_valid.new_ones(len(rows), gamma)], dim=1)
        mask = None if bool(keys.all()) else keys[:, None, None, :].expand(-1, 1, gamma, -1)  # (B, 1, γ, K)
        anchor_ids = torch.tensor([[row.seq[-1]] for row in rows], device=module_device(self.embed_tokens))
        out = self.drafter(
            noise_embeds=self.drafter.block_input_embeds(anchor_ids, self.embed_tokens),
            context_hidden_states=context,
            position_ids=position_ids,
            attention_mask=mask,
            cache=self.cache.cache,
        )
        self.cache.cache.crop(-gamma)  # the block's own K/V are not context
        self.cache.commit(ctx_valid)
        for row in rows:
            row.context = None
        return out.last_hidden_state

    def _sample(self, hidden: torch.Tensor, rows, caps: list[int], policy, early: bool):
        """Token-by-token sampling through the sequential head for all rows at once (DSpark §3.5).

        hidden (B, γ, d). For k = 1..K: the confidence c_k from [h_k; x_{k-1}] (before x_k exists), then x_k from
        processors(U_k + B_k(x_{k-1})): argmax, or the row's Gumbel-max draw at x_k's position. Row r examines
        `caps[r]` positions. With `early`, a policy that can stop early stops before sampling position k once the
        survivals seen (c_k included) settle every row's verify length short of it: under load Algorithm 1 often
        verifies 0-1 drafts per row, and the rest of the block would be sampled for nothing (this reads each
        position's confidences back: one host sync each).
        """
        steps = max(caps)
        prev = torch.tensor([[row.seq[-1]] for row in rows], device=hidden.device)  # (B, 1): the anchors
        tokens = prev.new_zeros(len(rows), steps)
        if steps == 0:
            return Drafts(tokens, None, list(caps), [[] for _ in rows])
        early = early and policy.stops_early
        drafter, narrow = self.drafter, self._narrow_vocab(rows)
        # One LM-head product for the block; a policy that can stop early takes the first positions first
        first = min(EARLY_DRAFT_POSITIONS, steps) if early else steps
        base = self._base_logits(hidden[:, :first], narrow)  # (B, K', V), or (B, K', V') over the draft vocabulary
        sampling = any(row.do_sample for row in rows)
        logits_out = base.new_zeros(len(rows), steps, base.shape[-1]) if sampling else None
        seen, state = [], None  # seen[k]: (B,) conditional confidences of position k + 1
        for k in range(steps):
            h_k = hidden[:, k : k + 1]
            conf = drafter.confidence_logits(h_k, prev)  # (B, 1), or None without a confidence head
            if conf is not None:
                seen.append(torch.sigmoid(conf[:, 0] / self.temperatures[k]))  # STS-calibrated c_k, before x_k
                if early:
                    seen[-1] = seen[-1].tolist()
                    width = policy.settled_width(_by_row(seen, len(rows)), caps)
                    if width is not None and width <= k:
                        break  # the survivals seen decide every row's length, and none verifies position k + 1
            if k == base.shape[1]:
                base = torch.cat([base, self._base_logits(hidden[:, k:steps], narrow)], dim=1)
            bias, next_state = self._sequential_bias(prev, h_k, state, narrow)
            logits = base[:, k] if bias is None else base[:, k] + bias[:, 0]  # (B, V) or (B, V')
            if narrow is not None:  # greedy rows, nothing processed: the argmax among the draft vocabulary's columns
                tokens[:, k] = narrow[logits.argmax(dim=-1)]
            else:
                logits = process_logits(rows, logits[:, None], tokens, first=k)[:, 0]
                logits = self._draft_vocab_fallback(logits, rows, h_k, prev, state, tokens, k)
                # a sampling row's draft at position t uses the noise its target choice at t will use (the coupling)
                counts = [int(k < cap) for cap in caps]
                tokens[:, k] = choose_tokens(rows, logits[:, None], first=k, counts=counts)[:, 0]
            state = next_state
            if logits_out is not None:
                logits_out[:, k] = logits
            prev = tokens[:, k : k + 1]
        seen = [c if isinstance(c, list) else c.tolist() for c in seen] if early else _read_back(seen)
        conditional = [c[:cap] for c, cap in zip(_by_row(seen, len(rows)), caps)]
        return Drafts(tokens.to(self.target_device), logits_out, list(caps), conditional)

    def _narrow_vocab(self, rows) -> torch.Tensor | None:
        """The draft vocabulary's ids (V',) where the block may be drafted among them alone: greedy rows whose logits
        nothing processes (the argmax among V' columns is the argmax over the whole vocabulary, whose other columns
        are -inf, first index first as the ids are sorted); else None (every column, as the processors and the
        sampling noise see the whole vocabulary). It skips spreading V' columns over V every position (measured in
        `benchmarks/time_draft_pass.py`). `OPTIONS.narrow_draft = False` drafts over every column always."""
        ids = self.drafter.draft_vocab_ids
        if ids is None or not OPTIONS.narrow_draft:
            return None
        if any(row.do_sample or row.processors is not None or row.warpers for row in rows):
            return None
        return ids

    def _base_logits(self, hidden: torch.Tensor, narrow: torch.Tensor | None) -> torch.Tensor:
        """U_k (B, K, V), or over the draft vocabulary's columns `narrow` only (B, K, V')."""
        if narrow is None:
            return self.drafter.draft_base_logits(hidden, self.lm_head)
        return self.drafter.base_logits(hidden, self.lm_head, narrow)

    def _sequential_bias(self, prev, hidden, state, narrow: torch.Tensor | None):
        """B_k and the head's next state: (B, 1, V), or over the draft vocabulary's columns `narrow` alone."""
        if narrow is None:
            return self.drafter.draft_sequential_bias(prev, hidden, state)
        return self.drafter.sequential_bias(prev, hidden, state, vocab_ids=narrow)

    def _tree(self, hidden: torch.Tensor, rows, caps: list[int], budget: int, policy=None) -> Drafts:
        """A best-first tree per row (`trees.grow_trees`): at most `budget` nodes, depth <= caps[r].

        hidden (B, γ, d). U_k is computed once per depth for every row; a node at depth k - 1 (the anchor: 0) gets as
        children the top candidates of l = processors(U_k + B_k(its token)), its path's tokens as their prefix, each
        scored by the confidence head and its draft probability (`node_children`: the first child's estimate is the
        chain's c_k), or for a greedy row with `config.tree_calibration` by that fit. A sampling row ranks them by
        l + g, with g the Gumbel noise its
        target choice at that position uses (`randomness.py`), so its first child is the coupled draft: the tree
        then holds the chain it would have drafted, and more. The nodes' path estimates take the place of
        survivals for the policy. With a `policy` that can stop early (the CPU default), growth stops once the
        nodes grown decide how many it verifies: nodes join in non-increasing order of estimate, so the last one's
        bounds every later one, as a chain's last survival does (`VerifyPolicy.settled`).
        """
        depth = max(caps)
        if depth == 0:
            return Drafts(hidden.new_zeros(len(rows), 0, dtype=torch.long), None, list(caps), [[] for _ in rows])
        early = policy is not None and policy.stops_early
        # U_k per row and depth (B, D, V); a policy that can stop early takes the first depths first, as chains do
        first = min(EARLY_DRAFT_POSITIONS, depth) if early else depth
        narrow = self._narrow_vocab(rows)  # greedy rows, nothing processed: the draft vocabulary's columns alone
        base = [self._base_logits(hidden[:, :first], narrow)]
        anchors = [row.seq[-1] for row in rows]
        fit = getattr(self.config, "tree_calibration", None)

        def expand(entries):
            if max(tree.depth(node) for _, tree, node in entries) >= base[0].shape[1]:  # deeper: the rest at once
                rest = self._base_logits(hidden[:, base[0].shape[1] : depth], narrow)
                base[0] = torch.cat([base[0], rest], dim=1)
            return node_children(
                self.drafter, hidden, base[0], anchors, entries, budget, rows, fit, self.temperatures, narrow
            )

        def settled(trees, open_rows):
            conditional = [conditional_confidences(tree.scores) for tree in trees]
            limits = [budget if grows else len(tree.tokens) for tree, grows in zip(trees, open_rows)]
            width = policy.settled_width(conditional, limits)
            return width is not None and all(len(t.tokens) >= min(width, n) for t, n in zip(trees, limits))

        return tree_drafts(grow_trees(expand, len(rows), caps, budget, settled if early else None), self.target_device)

    def _draft_vocab_fallback(self, logits, rows, h_k, prev, state, tokens, k):
        """With a draft vocabulary, logits processors can rule out all of it for a row (e.g. a bad-words list):
        draft that row's position over the whole vocabulary instead. Checked only when both are in play."""
        drafter = self.drafter
        if drafter.draft_vocab_ids is None or not any(row.processors is not None for row in rows):
            return logits
        empty = ~torch.isfinite(logits).any(dim=-1)  # (B,)
        if not bool(empty.any()):
            return logits
        bias, _ = drafter.sequential_bias(prev, h_k, state)
        full = drafter.base_logits(h_k, self.lm_head)[:, 0] + (0 if bias is None else bias[:, 0])
        full = process_logits(rows, full[:, None], tokens, first=k)[:, 0]
        return torch.where(empty[:, None], full, logits)


def node_children(
    drafter, hidden, base, anchors, entries, budget: int, rows=None, fit=None, temperatures=None, narrow=None
):
    """Candidate children of a batch of tree nodes, `grow_trees`' `expand`: per (row, tree, node) entry (node -1:
    the row's anchor), (tokens, estimates, state) of its top `budget` candidates, best first.

    hidden (B, γ, d) and base (B, ≥ depth + 1, V): row r's block hidden states and base logits U_k; anchors[r] its
    anchor token. A node at depth d gets l = U_{d+1} + B_{d+1}(its token) (its sequential-head state carried),
    under `rows[r]`'s logits processors with its path as prefix; a sampling row ranks by l + g, its target choice's
    Gumbel noise at that position (`randomness.py`), so its first child is the coupled draft. A child's estimate is
    its draft probability softmax(l), calibrated for greedy rows by `fit` (`trees.calibrated`). Else, with
    `temperatures` (the STS temperatures per depth) and a confidence head, the first child's estimate is the head's
    calibrated c = sigmoid(conf(h, parent) / T_depth), exactly the survival a chain drafting that path gives it, and
    the others share 1 - c in proportion to their draft probabilities: the policy then prices a tree's top path as it
    prices the chain, and its side branches by what the head leaves. rows None: greedy rows without processors
    (`training/calibration.py` grows held-out blocks' trees with it). `narrow` (V',): base holds only the draft
    vocabulary's columns (B, ≥ depth + 1, V') and the children are chosen among them, as `_narrow_vocab` allows
    (greedy rows that nothing processes: every other column is -inf, so the same children and probabilities).
    """
    index = torch.tensor([r for r, _, _ in entries], device=hidden.device)
    levels = [tree.depth(node) for _, tree, node in entries]
    level = torch.tensor(levels, device=hidden.device)
    prev = torch.tensor(
        [[anchors[r] if node < 0 else tree.tokens[node]] for r, tree, node in entries], device=hidden.device
    )  # (n, 1)
    states = [None if node < 0 else tree.states[node] for _, tree, node in entries]
    state = None if states[0] is None else torch.stack(states)  # (n, r): the RNN head's, per node
    h = hidden[index, level][:, None]
    if narrow is None:
        bias, next_state = drafter.draft_sequential_bias(prev, h, state)
    else:
        bias, next_state = drafter.sequential_bias(prev, h, state, vocab_ids=narrow)
    logits = base[index, level] if bias is None else base[index, level] + bias[:, 0]  # (n, V), or (n, V')
    entry_rows = None if rows is None else [rows[r] for r, _, _ in entries]
    ranked = logits
    if entry_rows is not None and narrow is None:  # (narrowed rows have nothing to process)
        paths = [[tree.path(node)] for _, tree, node in entries]
        logits = process_logits(entry_rows, logits[:, None], paths=paths)[:, 0]
        ranked = logits
        if any(row.do_sample for row in entry_rows):  # the children of a node at depth d: position len(seq) + d
            ranked = logits.clone()
            for i, (row, d) in enumerate(zip(entry_rows, levels)):
                if row.do_sample:
                    ranked[i] += row.noise([len(row.seq) + d], logits.shape[-1], logits.device)[0]
    top = torch.topk(ranked, min(budget, logits.shape[-1]), dim=-1)
    probs = torch.softmax(logits, dim=-1).gather(1, top.indices)  # (n, k)
    finite = torch.isfinite(top.values)  # a token the processors ruled out is never a child
    ids = top.indices if narrow is None else narrow[top.indices]  # token ids
    heads = None
    if fit is None and temperatures is not None:
        conf = drafter.confidence_logits(hidden[index, level][:, None], prev)  # (n, 1), or None without the head
        if conf is not None:
            scale = torch.tensor([temperatures[d] for d in levels], device=conf.device)
            heads = torch.sigmoid(conf[:, 0] / scale).tolist()  # c of each node's first child, as a chain's c_k
    out = []
    for i, (tokens, p, ok) in enumerate(zip(ids.tolist(), probs.tolist(), finite.tolist())):
        kept = [(t, q) for t, q, o in zip(tokens, p, ok) if o]
        greedy = entry_rows is None or not entry_rows[i].do_sample
        if fit is not None and greedy:
            estimates = calibrated([q for _, q in kept], levels[i] + 1, fit)  # the children sit at depth levels[i] + 1
            # best estimate first: where fewer nodes than children are left, `grow_trees` keeps the first ones
            kept = sorted(zip([t for t, _ in kept], estimates), key=lambda child: -child[1])
        elif heads is not None and kept:
            kept = _head_estimates(kept, heads[i], sort=greedy)
        child_state = None if next_state is None else next_state[i]
        out.append(([t for t, _ in kept], [q for _, q in kept], child_state))
    return out


def _head_estimates(kept: list[tuple[int, float]], c: float, sort: bool) -> list[tuple[int, float]]:
    """(token, estimate) children from (token, draft probability) ones, first child first: the first gets the
    confidence head's c, the others (1 - c) · q / (1 - q_first). `sort`: best estimate first (a greedy row; a sampling
    row keeps its coupled draft first)."""
    rest = max(1.0 - kept[0][1], 1e-9)
    children = [(kept[0][0], c)] + [(t, (1.0 - c) * min(q / rest, 1.0)) for t, q in kept[1:]]
    return sorted(children, key=lambda child: -child[1]) if sort else children


def _read_back(seen: list[torch.Tensor]) -> list[list[float]]:
    """Every position's confidences in one host transfer: seen[k] (B,) -> [[c_{r,k} for r] for k]."""
    return torch.stack(seen).tolist() if seen else []


def _by_row(seen: list[list[float]], n_rows: int) -> list[list[float]]:
    """seen[k][r] -> [c_{r,1}, c_{r,2}, ...] per row."""
    return [list(column) for column in zip(*seen)] if seen else [[] for _ in range(n_rows)]


class Eagle3CandidateGenerator(_Generator):
    """Drafts with an EAGLE-3 drafter, row by row: the positions a row committed since its last draft enter its own
    drafter cache with their target features (one forward, which also predicts the first draft), then each further
    draft is one more forward feeding the drafter's own output back. No confidence head: it verifies what it drafts.
    """

    cache = None  # one exact `DynamicCache` per row instead of a shared ragged one

    def __init__(self, drafter, target):
        super().__init__(drafter, target)
        self.caches: list[DynamicCache] = []

    def add_rows(self, n: int) -> None:
        self.caches += [DynamicCache() for _ in range(n)]

    def select(self, keep: list[int]) -> None:
        self.caches = [self.caches[i] for i in keep]

    def reset(self) -> None:
        self.caches = []

    def propose(self, rows, caps: list[int], policy, early: bool = True, tree_budget: int = 0):
        steps, drafted = max(caps), []  # (chains: EAGLE-3 drafts no trees)
        for row, cap, cache in zip(rows, caps, self.caches):
            if cap == 0:  # its context waits for the next draft
                drafted.append(None)
                continue
            seq = torch.tensor([row.seq], device=self.device)
            length = seq.shape[1]

            def processors(ids, scores, row=row, length=length):
                return process_logits([row], scores[:, None], ids[:, length:], first=ids.shape[1] - length)[:, 0]

            def choose(ids, scores, row=row, length=length):  # argmax, or the row's Gumbel-max draw at this position
                return choose_tokens([row], scores[:, None], first=ids.shape[1] - length)[:, 0]

            drafted.append(
                self.drafter.draft(
                    seq,
                    row.context[None].to(self.device),
                    cache,
                    self.embed_tokens,
                    self.lm_head,
                    cap,
                    logits_processor=processors,
                    choose=choose,
                )  # fmt: skip
            )
            row.context = None
        tokens = torch.zeros(len(rows), steps, dtype=torch.long, device=self.target_device)
        logits = None
        if any(row.do_sample for row in rows):
            logits = torch.zeros(len(rows), steps, out_features(self.lm_head), device=self.target_device)
        for i, draft in enumerate(drafted):
            if draft is not None:
                n = draft.tokens.shape[1]
                tokens[i, :n] = draft.tokens[0].to(self.target_device)
                if logits is not None:
                    logits[i, :n] = draft.logits[0].to(self.target_device)
        return Drafts(tokens, logits, list(caps), [[] for _ in rows])


__all__ = [
    "DRAFTER_TYPES",
    "DSparkCandidateGenerator",
    "Eagle3CandidateGenerator",
    "candidate_generator_for",
    "is_drafter",
    "node_children",
]
