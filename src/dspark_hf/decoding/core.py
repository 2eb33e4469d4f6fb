"""The speculative decoding round, written once for every driver: draft → choose lengths → verify → accept → commit.

`generate()` (through transformers' public `custom_generate` hook, `generation.py`) and the `Engine` (continuous
batching, `engine.py`) are thin drivers of one `SpeculativeDecoder`. It holds the batch: its rows (`Row`: a
sequence and how its logits are processed and its tokens committed), the target's ragged KV cache, the drafter's
candidate generator (`decoding/drafting.py`) and the verify policy (`policy.py`). Each `step()` is one round for
every row:

  draft    one drafter pass proposes a block for every row; the confidence head gives each position's calibrated
           survival as it is sampled (skipped when the draft gate expects a plain step to be faster); a row whose
           suffix occurred earlier in its sequence may take what followed it there instead (`lookup.py`), also in a
           round without a draft pass
  choose   the policy picks ℓ_r drafts per row (fixed / threshold / Algorithm 1), from survivals only
  verify   one target forward on (B, W = max ℓ_r + 1) tokens, [anchor, drafts] per row, over the ragged cache, with
           the target's CPU linears run this forward's way measured on this machine (`verify_linears.kernel_choice`)
  accept   each slot's target logits processed with that slot's own prefix (slot by slot, where a row has
           prefix-dependent processors, only along the walk acceptance takes); the target's choice at each slot
           (argmax, or for a sampling row the Gumbel-max draw keyed by its seed and the slot's position); the longest
           prefix of drafts equal to the choices, and the choice after it
  commit   accepted drafts + the bonus token go to each row (which clips at its stop); rejected and padding slots
           stay in the cache as masked holes, trimmed or compacted between rounds

Every row's output is what the target alone produces for it: token-identical under greedy decoding; under sampling
the very tokens plain decoding with the same seed produces (`acceptance.py`), so exactly the target's distribution,
whatever else is in the batch, whatever the policy drafted and whenever the gate skipped drafting. Host syncs per
round are few and do not grow with the block or batch size when sampling runs to the end of the block (see
docs/architecture.md).
"""

import inspect
import time
from contextlib import contextmanager, nullcontext

import torch
from transformers.utils import logging

from ..kernels.freshness import drop_stale
from ..kernels.lean_forward import run_target
from ..kernels.options import OPTIONS
from ..kernels.runtime import runtime_for
from ..kernels.threads import round_threads
from ..kernels.verify_head import eligible_linears
from ..kernels.verify_linears import kernel_choice
from ..kernels.weights import per_token_activations, per_token_linears
from ..models.settings import AUTO_TREE_BUDGET, AUTO_TREE_CONTEXT, AUTO_TREE_WIDTH_COST, check_sampling
from ..utils.compat import selects_hidden_states
from ..utils.devices import model_device
from .acceptance import accept_greedy, accept_tree
from .drafting import candidate_generator_for
from .lookup import LookupDrafts
from .policy import VerifyPolicy, gate_memory
from .ragged_cache import RaggedCache
from .rows import Drafts, Row, accept_standard_rows, choose_tokens, process_and_choose, process_logits
from .stats import RECORDERS, DraftRound
from .trees import slot_parents, tree_attention_mask


logger = logging.get_logger(__name__)


class SpeculativeDecoder:
    """A batch of rows decoded together, one round per `step()`.

    Args:
        target: a causal LM whose layers keep keys/values in a `DynamicCache` (Llama, Qwen2/3, Mistral, Gemma text
            models; sliding windows included).
        drafter: a drafter of this package made for `target` (DSpark, DFlash-mode or EAGLE-3), or None for plain
            batched decoding.
        policy: the `VerifyPolicy` (None: plain decoding, or "fixed" for a drafter).
        num_assistant_tokens: the most drafts a row examines per round (1..block size; None: the whole block).
        compact_fraction: compact a cache when more than this fraction of its slots are holes.
        stop_sampling_early: stop sampling a block once the policy's lengths are settled (None: on the CPU, where it
            saves drafter work; on an accelerator sampling the whole block avoids one host sync per position).
    """

    def __init__(
        self,
        target,
        drafter=None,
        *,
        policy: VerifyPolicy | None = None,
        num_assistant_tokens: int | None = None,
        compact_fraction: float = 0.5,
        stop_sampling_early: bool | None = None,
    ):
        if not 0.0 < compact_fraction <= 1.0:
            raise ValueError(f"`compact_fraction` must lie in (0, 1], got {compact_fraction}.")
        self.target, self.compact_fraction = target, compact_fraction
        self._drafter = drafter
        self.device = model_device(target)
        text_config = target.config.get_text_config()
        self.sliding = getattr(text_config, "sliding_window", None) is not None or "sliding_attention" in (
            getattr(text_config, "layer_types", None) or []
        )
        params = inspect.signature(target.forward).parameters
        # transformers 5.24 renamed `past_key_values` to `cache`; remote-code models may keep the old name
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params
        self.candidates = candidate_generator_for(drafter, target) if drafter is not None else None
        self.block_size = self.candidates.block_size if self.candidates is not None else 0
        self.taps = self.candidates.taps if self.candidates is not None else None
        if policy is None and drafter is not None:
            policy = VerifyPolicy("fixed")
        self.policy = policy
        self.num_assistant_tokens = self._check_num_assistant_tokens(num_assistant_tokens)
        # `tree_budget="auto"`: whether this target and policy take trees (a round still drafts a chain where a row
        # samples with sampling="standard" or is longer than AUTO_TREE_CONTEXT)
        self._auto_trees = self._trees_pay()
        self.stop_sampling_early = self.device.type == "cpu" if stop_sampling_early is None else stop_sampling_early
        # what is kept for this target on this machine (kernel ways, packs, threads, the gate's measurements)
        self.runtime = runtime_for(target)
        self._selects = selects_hidden_states(target)
        self._linears = eligible_linears(target)  # kept here (never on the target) for `verify_kernels`
        # a dynamically quantized target's linears verify token by token, as its one-token steps run (weights.py)
        self._per_token = per_token_linears(target)
        # the CPU verify kernels, the way measured fastest on this machine per row count (never on an accelerator)
        self._kernels = kernel_choice(target) if self.device.type == "cpu" else None
        # each round's intra-op thread count, the one measured fastest under the machine's load (CPU only)
        self._threads = round_threads(target) if self.device.type == "cpu" else None
        self.target_cache = RaggedCache(self.device)
        self.rows: list[Row] = []
        self.lookup = LookupDrafts()  # drafts copied from a row's own context; how often they are accepted, learned
        self._joined = False  # rows joined since the last round
        self.counts = dict.fromkeys(
            ("rounds", "prefills", "request_rounds", "verified_drafts", "accepted_drafts", "compactions",
             "gated_rounds", "lookup_rounds", "fewer_threads_rounds"),
            0,
        )  # fmt: skip

    def _check_num_assistant_tokens(self, value: int | None) -> int:
        if value is None:
            return self.block_size
        if self.candidates is None:
            raise ValueError(f"num_assistant_tokens={value!r} needs a drafter; plain decoding drafts nothing.")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.block_size:
            raise ValueError(
                f"`num_assistant_tokens` must be an int in 1..{self.block_size} (the drafter's block size), "
                f"got {value!r}."
            )
        return value

    # -- joining and leaving --------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, rows: list[Row]) -> list[Row]:
        """Run new prompts through the target in one forward (right-padded; pads are holes), commit each row's first
        token and add the unfinished rows to the batch. Returns the rows that finished on their first token.

        A single prompt runs exactly as plain `generate()` runs it (no mask, logits of the last position only); a
        dynamically quantized target (`weights.per_token_linears`) prefills its prompts one by one for that reason.
        """
        if not rows:
            return []
        self._check_tree(rows)
        if not self.rows:  # a new generate() call, or an Engine starting work after being idle
            self._refresh_weights()
        if self._per_token and len(rows) > 1:  # one activation scale per call: each prompt alone, as plain decoding
            return [done for row in rows for done in self.prefill([row])]
        lengths = [len(row.seq) for row in rows]
        width = max(lengths)
        ids = torch.tensor([row.seq + [0] * (width - len(row.seq)) for row in rows], device=self.device)
        last = torch.tensor(lengths, device=self.device) - 1  # (n,) position of each prompt's last token
        valid = torch.arange(width, device=self.device)[None] <= last[:, None]  # (n, P)
        kept = torch.unique(last)  # sorted; only these logits are computed, as generate() keeps only the last
        kwargs = {"logits_to_keep": kept} if self.keeps_logits else {}
        if len(set(lengths)) > 1:
            kwargs["attention_mask"] = valid.long()
        cache = RaggedCache(self.device, batch_size=len(rows))
        hidden = self._hidden_states_wanted(any(row.keeps_hidden_states for row in rows))
        out = self.target(
            input_ids=ids, use_cache=True, output_hidden_states=hidden, **kwargs, **{self.cache_arg: cache.cache}
        )
        cache.commit(valid)
        self.counts["prefills"] += 1
        column = torch.searchsorted(kept, last) if self.keeps_logits else last
        logits = out.logits.to(self.device)[torch.arange(len(rows), device=self.device), column].float()  # (n, V)
        for row in rows:
            row.noise_device = self.device  # a row's noise is made on one device type, whoever asks for it first
        processed = process_logits(rows, logits[:, None])
        tokens = choose_tokens(rows, processed)[:, 0].tolist()
        processed = processed[:, 0]
        features = self._features(out) if self.taps else None  # (n, P, m·d)
        for i, (row, token) in enumerate(zip(rows, tokens)):
            row.context = None
            if features is not None:  # every prompt position (that a draft can reach)
                row.add_context(features[i, : lengths[i]], self.candidates.context_reach)
            states = [_layers(out.hidden_states, i, 0, lengths[i])] if row.keeps_hidden_states else None
            row.commit([token], processed[i : i + 1], logits[i : i + 1], states)
            row.seq.append(token)
        keep = [i for i, row in enumerate(rows) if not row.finished]  # EOS or a one-token budget: done already
        if len(keep) < len(rows):
            cache.select(keep)
        if keep:
            self.target_cache.extend(cache)
            if self.candidates is not None:
                self.candidates.add_rows(len(keep))
            self.rows += [rows[i] for i in keep]
            self._joined = True
        return [row for row in rows if row.finished]

    def _refresh_weights(self) -> None:
        """Drop the kernels' copies of weights that changed since they were made (`kernels/freshness.py`): edits
        through `.data`, adapters merged, modules swapped or wrapped since the last batch."""
        self._linears = eligible_linears(self.target)
        drop_stale(self.target, self._drafter)

    def retire(self) -> list[Row]:
        """Remove finished rows from the batch and every cache; returns them."""
        keep = [i for i, row in enumerate(self.rows) if not row.finished]
        done = [row for row in self.rows if row.finished]
        if done:
            self.target_cache.select(keep)
            if self.candidates is not None:
                self.candidates.select(keep)
            self.rows = [self.rows[i] for i in keep]
        return done

    def reset(self) -> None:
        """Drop every row and cache (after a failed round the batch state is unreliable)."""
        self.rows = []
        self.target_cache = RaggedCache(self.device)
        if self.candidates is not None:
            self.candidates.reset()

    # -- the round ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """One round for every row: draft → choose lengths → verify → accept → commit. Rows that finish stay in the
        batch, marked `finished`, until `retire()`."""
        self._crop()  # a sliding-window target must see right-aligned rows from the first verify on
        if not self.rows:
            return
        start = _clock(self.device) if RECORDERS else 0.0
        drafted = self._drafting_pays()
        with self._measured_threads(drafted):
            drafts = self._draft() if drafted else self._lookup_only()
            record = DraftRound(start, _clock(self.device) - start, sum(drafts.lengths)) if RECORDERS else None
            logits, features, hidden = self._verify(drafts)
            if record is not None:
                record.verify_seconds = _clock(self.device) - record.start - record.seconds
            accepted, bonus, processed, paths = self._accept(drafts, logits)
            self._count("lookup_rounds", [self.rows[i] for i in self.lookup.learn(drafts, accepted, paths)])
            self._commit(drafts, accepted, bonus, processed, logits, features, hidden, paths)
            if self.policy is not None:  # the round's time per token, for the draft gate
                self.policy.end_round(sum(accepted) + len(accepted), measured=self._typical())
        if record is not None:
            record.accepted, record.end = sum(accepted), _clock(self.device)
            RECORDERS[-1].append(record)

    @contextmanager
    def _measured_threads(self, drafted: bool):
        """The round at the intra-op thread count measured fastest for its kind (`kernels/threads.py`, CPU only)."""
        joined, self._joined = self._joined, False  # this round also feeds the drafter new prompts: not typical
        if self._threads is None:
            yield
            return
        full, kind = torch.get_num_threads(), (drafted, len(self.rows))
        with self._threads.round(kind, measured=lambda: not joined and self._kernels_typical()) as count:
            if count < full and not self._threads.trial:  # chosen, not tried
                self._count("fewer_threads_rounds", self.rows)
            yield

    def _kernels_typical(self) -> bool:
        """Whether the round's verify ran the kernels as usual (no way on trial), so its time may be measured."""
        return self._kernels is None or not self._kernels.trial

    def _typical(self) -> bool:
        """... and at the usual thread count: a round the draft gate may measure."""
        return self._kernels_typical() and (self._threads is None or not self._threads.trial)

    def _count(self, name: str, rows: list[Row]) -> None:
        """One more round of kind `name` (e.g. "gated_rounds") in the decoder's counts and in each row's stats."""
        self.counts[name] += 1
        for row in rows:
            setattr(row.stats, name, getattr(row.stats, name) + 1)

    @property
    def context_lookup(self) -> int:
        """The drafter's `config.context_lookup` (the shortest suffix match that may draft; 0: never), read each
        round."""
        return getattr(self.candidates, "context_lookup", 0) if self.candidates is not None else 0

    @property
    def tree_budget(self) -> int:
        """This round's tree budget (0: chains): the drafter's `config.tree_budget`, read each round; "auto" is
        `AUTO_TREE_BUDGET` where this decoder takes trees (`_trees_pay`), no row samples with sampling="standard" and
        no row's sequence is longer than `AUTO_TREE_CONTEXT`, else 0."""
        return self._tree_budget_for(self.rows)

    def _tree_budget_for(self, rows: list[Row]) -> int:
        budget = getattr(self.candidates, "tree_budget", 0) if self.candidates is not None else 0
        if budget != "auto":
            return budget
        if not self._auto_trees or any(row.standard or len(row.seq) > AUTO_TREE_CONTEXT for row in rows):
            return 0
        return AUTO_TREE_BUDGET

    def _trees_pay(self) -> bool:
        """Whether `tree_budget="auto"` drafts trees here: a drafter that grows them, a target that can take a
        tree's mask (no sliding window), and a policy that prices nodes against a profile where width is cheap
        enough (`VerifyPolicy.prices_trees`). Says why not, once per drafter and target, where the drafter asks for
        "auto"."""
        if self.candidates is None or getattr(self.candidates, "tree_budget", 0) != "auto":
            return False
        why = None
        if self.sliding:
            why = f"{type(self.target).__name__} has sliding-window layers, which cannot take a tree's mask"
        elif self.policy.name != "scheduler":
            why = f'verify_policy="{self.policy.name}" does not price tree nodes (Algorithm 1, "scheduler", does)'
        elif not self.policy.prices_trees(AUTO_TREE_BUDGET):
            cost = self.policy.width_cost(AUTO_TREE_BUDGET + 1)
            why = (
                f"a verify of {AUTO_TREE_BUDGET + 1} tokens costs {cost:.1f} one-token steps on this target's profile "
                f"(trees need at most {AUTO_TREE_WIDTH_COST})"
            )
        if why is None:
            return True
        told = gate_memory(self._drafter, self.target).told  # said once per drafter and target
        if why not in told:
            told.add(why)
            logger.info(f'tree_budget="auto" drafts chains here: {why}.')
        return False

    def _check_tree(self, rows: list[Row] = ()) -> int:
        """Trees need every layer to see exactly the mask given: refuse sliding-window targets by name; and chains
        for rows with standard sampling (`acceptance.accept_standard`). Returns the tree budget of the batch with
        `rows` (0: chains)."""
        budget = self._tree_budget_for([*self.rows, *rows])
        if not budget:
            return 0
        for row in [*self.rows, *rows]:
            check_sampling(row.sampling, budget, row.do_sample)
        if self.sliding:
            raise ValueError(
                f"drafter.config.tree_budget={budget}, but {type(self.target).__name__} has sliding-window layers, "
                "which cannot take a tree's attention mask. Set drafter.config.tree_budget = 0 (chains)."
            )
        return budget

    def _caps(self) -> list[int]:
        """Drafts each row may examine: `num_assistant_tokens`, and one fewer than its remaining budget (the bonus
        takes the last slot)."""
        return [max(0, min(self.num_assistant_tokens, row.remaining - 1)) for row in self.rows]

    def _drafting_pays(self) -> bool:
        """Whether to draft this round: always with a drafter, unless the draft gate finds a plain step cheaper."""
        caps = self._caps()
        if self.candidates is None or max(caps) == 0:  # no row may take a draft: a plain step, not a gated one
            return False
        if self.policy.should_draft([row.hint for row in self.rows], caps):
            return True
        self._count("gated_rounds", self.rows)
        return False

    def _draft(self) -> Drafts:
        """draft → choose lengths; timed, with the confidences seen, for the gate."""
        start = time.perf_counter()
        caps = self._caps()
        budget = self._check_tree()
        early = self.stop_sampling_early
        drafts = self.candidates.propose(self.rows, caps, self.policy, early=early, tree_budget=budget)
        if self.context_lookup:
            drafts, caps = self.lookup.merge(self.rows, drafts, caps, self.context_lookup, budget)
        # a chain's caps bound its positions, a tree's its depth: the policy then chooses among its nodes
        limits = drafts.lengths if drafts.is_tree else caps
        drafts.lengths = self.policy.lengths(drafts.conditional, limits)
        # the survivals were read back: the time includes the device's work
        if self.policy.record_draft(time.perf_counter() - start, drafts.conditional, drafts.lengths):
            for row, conditional in zip(self.rows, drafts.conditional):
                row.hint = conditional
        return drafts

    def _lookup_only(self) -> Drafts:
        """A round without a draft pass (the gate found one not worth it, or no drafter may draft): still, rows
        whose suffix recurs may verify its continuation where the policy finds that worth the verify's width (a plain
        step for every row otherwise)."""
        drafts = Drafts.none(len(self.rows), self.device)
        caps = self._caps()
        if not self.context_lookup or max(caps) == 0:  # (with trees on too: such a round is a chain's)
            return drafts
        drafts, caps = self.lookup.merge(self.rows, drafts, caps, self.context_lookup)
        if drafts.lookup:
            caps = [cap if i in drafts.lookup else 0 for i, cap in enumerate(caps)]
            drafts.lengths = self.policy.lengths(drafts.conditional, caps)
        return drafts

    def _verify(self, drafts: Drafts) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """One target forward over [anchor, ℓ_r drafts] per row, padded to W = max ℓ_r + 1 and masked.

        Returns logits (B, W, V) float32, the tapped features (B, W, m·d) (None for plain decoding) and, when a row
        keeps them, every layer's hidden states (layers + 1 tensors (B, W, d)). Slot j of row r sits at position
        anchor_r + j and predicts the token after it.
        """
        keep_hidden = any(row.keeps_hidden_states for row in self.rows)
        hidden = self._hidden_states_wanted(keep_hidden)
        lengths = torch.tensor(drafts.lengths, device=self.device)
        width = max(drafts.lengths) + 1
        anchors = torch.tensor([[row.seq[-1]] for row in self.rows], device=self.device)
        ids = torch.cat([anchors, drafts.tokens[:, : width - 1].to(self.device)], dim=1)  # (B, W)
        slots = torch.arange(width, device=self.device)
        anchor_positions = torch.tensor([row.anchor_position for row in self.rows], device=self.device)[:, None]
        new_valid = slots[None] <= lengths[:, None]  # (B, W)
        if drafts.is_tree:  # slot s at position anchor + its depth, seeing the cache and its own ancestors
            depths = torch.cat([slots.new_zeros(len(self.rows), 1), drafts.depths[:, : width - 1].to(self.device)], 1)
            position_ids = anchor_positions + depths
            parents = slot_parents(drafts.parents.to(self.device), width)
            dtype = self.target.get_input_embeddings().weight.dtype
            max_depth = self.block_size
            mask = tree_attention_mask(self.target_cache.valid, parents, new_valid, max_depth, dtype)  # (B,1,W,T+W)
        else:
            position_ids = anchor_positions + slots
            mask = self.target_cache.attention_mask(new_valid).long()  # (B, T + W)
        with (
            self._kernels.verify(self.target, ids.numel(), self._linears) if self._kernels else nullcontext(),
            per_token_activations(self.target, self._per_token),
        ):
            out = run_target(
                self.target, input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                output_hidden_states=hidden, **{self.cache_arg: self.target_cache.cache},
            )  # fmt: skip
        self.counts["rounds"] += 1
        features = self._features(out) if self.taps else None
        return out.logits.to(self.device).float(), features, out.hidden_states if keep_hidden else None

    def _accept(self, drafts: Drafts, logits: torch.Tensor):
        """Accepted draft count and bonus token per row, the processed target logits (B, W, V) and the slots of each
        row's accepted path (the anchor's 0 first; a chain's is 0..accepted, a tree's the nodes walked).

        choose: the target's token at every slot a row verifies, from that slot's processed logits: the argmax, or
        for a sampling row argmax(logits + g_{seed, position}) (`choose_tokens`). accept: the longest prefix of drafts
        equal to those choices; the bonus is the choice after it; a tree: the walk from the anchor along the choices
        (`accept_tree`). One rule for greedy and sampling rows (`acceptance.py`).
        """
        width = logits.shape[1]
        tokens = drafts.tokens[:, : width - 1].to(self.device)
        lengths = torch.tensor(drafts.lengths, device=self.device)
        if drafts.is_tree:
            return self._accept_tree(drafts, logits, tokens, lengths)
        processed, choices = process_and_choose(self.rows, logits, tokens, drafts.lengths)  # (B, W, V), (B, W)
        accepted, bonus = accept_greedy(tokens, choices, lengths)
        # rows with sampling="standard": rejection sampling against the draft distributions instead
        standard, taken, drawn = accept_standard_rows(self.rows, tokens, drafts.logits, processed, lengths)
        accepted[standard], bonus[standard] = taken, drawn
        accepted = accepted.tolist()
        return accepted, bonus.tolist(), processed, [list(range(n + 1)) for n in accepted]

    def _accept_tree(self, drafts: Drafts, logits, tokens, lengths):
        """`_accept` for trees: each slot processed with its own path as prefix, and chosen at its own position
        (anchor + 1 + its depth: a sampling row's noise is shared by the nodes of one depth)."""
        width = logits.shape[1]
        parents = drafts.parents[:, : width - 1].to(self.device)
        processed, choices = process_and_choose(self.rows, logits, tokens, drafts.lengths, parents, drafts.depths)
        on_path, depth, bonus = accept_tree(tokens, parents, choices, lengths, self.block_size)
        path_slots = [[s for s, on in enumerate(row) if on] for row in on_path.tolist()]
        return depth.tolist(), bonus.tolist(), processed, path_slots

    def _commit(self, drafts: Drafts, accepted, bonus, processed, logits, features, hidden, paths) -> None:
        """Append each row's accepted path (`paths[r]`: slots, the anchor's 0 first, at positions anchor + 0, 1, 2,
        ...) and bonus; the path's slots stay valid in the target cache, every other slot becomes a hole (a chain's
        path is a prefix of its slots, a tree's any path from the anchor)."""
        keep = torch.zeros(len(self.rows), processed.shape[1], dtype=torch.bool)
        for i, slots in enumerate(paths):
            keep[i, slots] = True
        self.target_cache.commit(keep.to(self.device))
        tokens = drafts.tokens.tolist()
        survival = drafts.survival
        depths = drafts.depths.tolist() if drafts.is_tree else None
        for i, row in enumerate(self.rows):
            n_acc, path = accepted[i], paths[i]
            slots = torch.tensor(path, device=self.device)
            new = [tokens[i][s - 1] for s in path[1:]] + [bonus[i]]  # node s - 1 sits at slot s
            states = None
            if row.keeps_hidden_states:  # slot j's states chose the token after it
                states = [_layers(hidden, i, j, j + 1) for j in path]
            taken = row.commit(new, processed[i, slots], logits[i, slots], states)
            verified_depth = max(depths[i][: drafts.lengths[i]], default=0) if depths is not None else None
            row.stats.record_step(
                drafts.lengths[i], n_acc, stopped=row.finished, survival=survival[i], depth=verified_depth,
                source=self.lookup.source(drafts, i, path), committed=taken,
            )  # fmt: skip
            row.seq += new[:taken]
            if features is not None:  # the old anchor + accepted drafts (the bonus is the new anchor)
                row.add_context(features[i, slots], self.candidates.context_reach)
            self.counts["request_rounds"] += 1
            self.counts["verified_drafts"] += drafts.lengths[i]
            self.counts["accepted_drafts"] += n_acc

    def _crop(self) -> None:
        """Drop trailing holes; compact a cache whose holes pile up (the target's whenever a sliding window would
        otherwise count holes)."""
        caches = [self.target_cache] + ([self.candidates.cache] if self.candidates is not None else [])
        for cache in caches:
            if cache is None:
                continue
            cache.trim()
            sliding = cache is self.target_cache and self.sliding and not cache.is_right_aligned()
            if cache.batch_size and (sliding or cache.hole_fraction() > self.compact_fraction):
                cache.compact()
                self.counts["compactions"] += 1

    def _hidden_states_wanted(self, every_layer: bool) -> bool | list[int]:
        """`output_hidden_states` for a target forward: every layer's when a row keeps them, else only the tapped
        ones where transformers can select them (`compat.selects_hidden_states`; the others are never kept: at 8k
        positions 31 layers of SmolLM2 are 0.6 GB, the drafter's 5 taps 0.1 GB), else all or none."""
        if every_layer or not self.taps:
            return every_layer
        return list(self.taps) if OPTIONS.select_hidden_states and self._selects else True

    def _features(self, out) -> torch.Tensor:
        """Tapped target layers, concatenated in `target_layer_ids` order: (B, L, m·d)."""
        return torch.cat([out.hidden_states[i].to(self.device) for i in self.taps], dim=-1)


def _layers(hidden_states: tuple, row: int, start: int, stop: int) -> torch.Tensor:
    """Row `row`'s positions start..stop of every layer's hidden states: (layers + 1, stop - start, d)."""
    return torch.stack([layer[row, start:stop] for layer in hidden_states])


def _clock(device) -> float:
    """`time.perf_counter()` after the device has finished its queued work (timing for the evaluation harness)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


__all__ = ["Drafts", "Row", "SpeculativeDecoder"]
