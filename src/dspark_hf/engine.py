"""`Engine`: batched DSpark speculative decoding with continuous batching, over any HF causal LM (public API only).

transformers' assisted generation is batch-1; here many requests share one drafter and one target, join and leave
between rounds, and each verifies its own number of drafts. Each `step()` is one round for every active request:

  admit     prefill queued requests one at a time (exactly plain `generate()`'s prefill, first token included) and
            merge their KV into the batch
  gate      under "scheduler": draft only when the round is expected to beat a plain step, counting the draft's
            own cost (`scheduler.DraftGate`); otherwise the round is a plain decoding step
  draft     one drafter pass for all rows: each row appends the target features it committed last round to its
            context and drafts a block from its anchor (the newest token, which has no features yet)
  schedule  per-row verify lengths ℓ_r: the whole block ("fixed"), the calibrated survival threshold ("threshold"),
            or Algorithm 1 over all rows against the SPS profile of the batch's verify token count ("scheduler"),
            priced as if the verify could be padded to its cheapest token count within the caps
  verify    one target forward on (B, W) tokens, W = max_r ℓ_r + 1: [anchor, ℓ_r drafts] per row, the shorter
            rows filled up to W with their own further drafts where they have them, else padded
  accept    greedy prefix match, or exact rejection sampling against the biased draft distribution, per row
  commit    append accepted drafts and the bonus, clipped at EOS / `max_new_tokens` as plain decoding is; stream them
  crop      padding and rejected slots stay in the target cache as masked holes (see `RaggedCache`); trailing
            holes are cropped, and caches are compacted when holes pile up
  retire    finished and aborted rows leave the batch

Each request's output is its own plain output whatever else is in the batch: token-identical under greedy decoding,
identically distributed under sampling (per-request `torch.Generator`, seeded by `seed`).
"""

import inspect
import itertools
import math
import operator
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.utils import logging

from .acceptance import accept_greedy, accept_speculative_sampling
from .configuration_dspark import EARLY_DRAFT_POSITIONS, VERIFY_POLICIES
from .generation import is_dspark_drafter
from .packed_linear import pack_linears
from .ragged_cache import RaggedCache
from .request import Request, check_sampling_settings, prompt_token_ids
from .scheduler import SPS, DraftGate, SPSCurve, prefix_schedule, settled_prefix_schedule
from .verify_head import attach, verifying


logger = logging.get_logger(__name__)


@dataclass
class _Row:
    """An active request. `seq` = prompt + output; its last token is the anchor, not yet run through the target."""

    request: Request
    seq: list[int]
    context: torch.Tensor | None  # (n, m·d) target features of committed positions not yet in the drafter cache
    hint: list[float] | None = None  # conditional confidences of the last round it drafted (the gate's prediction)

    @property
    def anchor_position(self) -> int:
        return len(self.seq) - 1


@dataclass
class _Block:
    """One round's drafts for all rows.

    tokens (B, K): drafts (K = the most any row examined; columns past a row's length are padding); logits
    (B, K, V): processed draft logits they were drawn from (None when no row samples); lengths: ℓ_r to verify;
    confidences: calibrated conditional acceptance c_{r,k} of the positions row r examined.
    """

    tokens: torch.LongTensor
    logits: torch.Tensor | None
    lengths: list[int]
    confidences: list[list[float]]

    @property
    def survival(self) -> list[list[float]]:
        """Cumulative survival a_{r,k} = Π_{i<=k} c_{r,i} per row."""
        return [list(itertools.accumulate(c, operator.mul)) for c in self.confidences]


class Engine:
    """Batched speculative decoding: `add_request` from any thread, then `step()` (or `start()` a loop thread).

    Args:
        target: a causal LM with a full-attention KV cache (Llama, Qwen2/3, Mistral, Gemma text models).
        drafter: a DSpark drafter made for `target`, or None for plain batched decoding (the benchmark baseline).
        tokenizer: checked against the drafter's recorded tokenizer; also lets `add_request` take a string.
        max_batch_size: most requests decoded together; more wait in a queue.
        verify_policy: "fixed" | "threshold" | "scheduler"; None takes `drafter.config.verify_policy`. Without a
            confidence head every policy verifies the whole block.
        sps: Algorithm 1's profile {verify_batch_tokens: steps_per_second} or a callable; None uses
            `profiling.sps_for` (the checkpoint's sps_profile.json, else a quick profile).
        num_assistant_tokens: the most drafts a request examines per round (transformers' name), 1..block size;
            None = the drafter's whole block. With "fixed" this is fixed γ: a shorter γ from the same block pass.
        gate_drafts: skip the draft pass in rounds where it is not expected to pay (`scheduler.DraftGate`), so the
            round is a plain step. None = `drafter.config.draft_gate` under "scheduler" (it needs the SPS
            profile), off otherwise.
        draft_seconds: what the gate takes a draft pass of R rows to cost: None measures it as the engine runs
            (per batch size, smoothed), a float or a callable R -> seconds fixes it.
        compact_fraction: compact a cache when more than this fraction of its slots are holes.
    """

    def __init__(
        self,
        target,
        drafter=None,
        *,
        tokenizer=None,
        max_batch_size: int = 8,
        verify_policy: str | None = None,
        sps: SPS | None = None,
        num_assistant_tokens: int | None = None,
        gate_drafts: bool | None = None,
        draft_seconds: float | Callable[[int], float] | None = None,
        compact_fraction: float = 0.5,
    ):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"`max_batch_size` must be a positive int, got {max_batch_size!r}.")
        if not 0.0 < compact_fraction <= 1.0:
            raise ValueError(f"`compact_fraction` must lie in (0, 1], got {compact_fraction}.")
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.max_batch_size, self.compact_fraction = max_batch_size, compact_fraction
        self.device = next(target.parameters()).device
        text_config = target.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.sliding = getattr(text_config, "sliding_window", None) is not None or "sliding_attention" in (
            getattr(text_config, "layer_types", None) or []
        )
        params = inspect.signature(target.forward).parameters
        # transformers 5.24 renamed `past_key_values` to `cache`; remote-code models may keep the old name
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params
        attach(target)  # CPU float32 linears compute a step's few rows faster (verify_head.py)
        if drafter is not None:
            pack_linears(drafter)  # the drafter's CPU linears through oneDNN's packed weights (packed_linear.py)
        self.policy = self._setup_drafter(drafter, tokenizer, verify_policy, sps)
        self.num_assistant_tokens = self._check_num_assistant_tokens(num_assistant_tokens)
        self.gate = DraftGate(self.sps, draft_seconds) if self._check_gate(gate_drafts, draft_seconds) else None
        self.target_cache = RaggedCache(self.device)
        self.drafter_cache = RaggedCache(self.device)
        self.rows: list[_Row] = []
        self._waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._counts = dict.fromkeys(
            ("rounds", "prefills", "request_rounds", "generated_tokens", "verified_drafts", "accepted_drafts",
             "finished_requests", "compactions", "gated_rounds"),
            0,
        )  # fmt: skip
        self._position_counts = ([0] * self.block_size, [0] * self.block_size)

    def _setup_drafter(self, drafter, tokenizer, verify_policy, sps) -> str:
        """Checks the pairing and resolves the policy; returns "plain" without a drafter."""
        self.block_size, self.taps = 0, None
        if drafter is None:
            if verify_policy is not None:
                raise ValueError(f"verify_policy={verify_policy!r} needs a drafter; plain decoding verifies nothing.")
            return "plain"
        if not is_dspark_drafter(drafter):
            raise TypeError(f"`drafter` must be a DSpark drafter (config.model_type 'dspark'), got {type(drafter)}.")
        config = drafter.config
        config.check_target(self.target.config, tokenizer)
        policy = verify_policy if verify_policy is not None else config.verify_policy
        if policy not in VERIFY_POLICIES:
            raise ValueError(f"Unknown verify_policy={policy!r}; choose one of {list(VERIFY_POLICIES)}.")
        self.lm_head = self.target.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(self.target).__name__} has no output embeddings (LM head) to lend the drafter.")
        self.embed_tokens = self.target.get_input_embeddings()
        self.block_size = config.block_size
        self.taps = [i + 1 for i in config.target_layer_ids]  # +1: hidden_states[0] is the embedding output
        self.drafter_device = drafter.fc.weight.device
        if self.drafter_device != self.device:  # per-request generators live on one device
            raise ValueError(f"Put the drafter on the target's device {self.device}; it is on {self.drafter_device}.")
        self.temperatures = drafter.sts_temperatures.tolist()
        if not config.confidence_head:
            return "fixed"  # no survival estimates: verify the whole block, as build_admission does
        if policy == "scheduler":
            from .profiling import sps_for

            covering = _covering_sps(sps if sps is not None else sps_for(drafter, self.target),
                                     self.max_batch_size * (self.block_size + 1))  # fmt: skip
            self.sps = SPSCurve(covering)  # one curve, so its padded tables are built once per reach
        return policy

    def _check_num_assistant_tokens(self, value: int | None) -> int:
        if value is None:
            return self.block_size
        if self.drafter is None:
            raise ValueError(f"num_assistant_tokens={value!r} needs a drafter; plain decoding drafts nothing.")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.block_size:
            raise ValueError(
                f"`num_assistant_tokens` must be an int in 1..{self.block_size} (the drafter's block size), "
                f"got {value!r}."
            )
        return value

    def _check_gate(self, gate_drafts: bool | None, draft_seconds) -> bool:
        if gate_drafts is None:
            gate_drafts = self.policy == "scheduler" and bool(getattr(self.drafter.config, "draft_gate", True))
        if not isinstance(gate_drafts, bool):
            raise TypeError(f"`gate_drafts` must be a bool or None, got {gate_drafts!r}.")
        if gate_drafts and self.policy != "scheduler":
            raise ValueError(
                f"gate_drafts=True needs verify_policy='scheduler' (it weighs a draft against the SPS profile); "
                f"the policy here is {self.policy!r}."
            )
        if draft_seconds is not None and not gate_drafts:
            raise ValueError(
                "`draft_seconds` prices the draft gate, which is off here; pass gate_drafts=True or drop it."
            )
        return gate_drafts  # DraftGate checks draft_seconds itself

    # -- requests -----------------------------------------------------------------------------------------------

    def add_request(
        self,
        input_ids,
        *,
        max_new_tokens: int = 128,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_token_id: int | list[int] | None = None,
        seed: int | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Queue a request (thread-safe). `input_ids`: list[int] or 1-D LongTensor (a string with a tokenizer).

        `eos_token_id` None takes the target's `generation_config.eos_token_id`; `seed` seeds the request's own
        generator (None: drawn from torch's global RNG). Under the fixed and threshold policies a seeded request's
        output does not depend on what else is in the batch (Algorithm 1 lets the batch change ℓ_r, and with it
        the random stream; the distribution stays exact either way). Returns the `Request` to stream or wait on.
        """
        prompt = prompt_token_ids(input_ids, self.vocab_size, self.tokenizer)
        check_sampling_settings(max_new_tokens, do_sample, temperature, top_p, top_k, seed)
        eos = self.target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if not all(isinstance(t, int) for t in eos):
            raise TypeError(f"`eos_token_id` must be an int or a list of ints, got {eos_token_id!r}.")
        with self._lock:
            request_id = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
            if request_id in self._requests:
                raise ValueError(f"A request with id {request_id!r} is still running; ids must be unique.")
            request = Request(
                request_id, prompt, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                top_p=top_p, top_k=top_k, eos_token_ids=frozenset(eos), seed=seed, block_size=self.block_size,
            )  # fmt: skip
            if seed is None:
                seed = int(torch.randint(0, 2**62, ()).item())
            request.generator = torch.Generator(device=self.device).manual_seed(seed)
            self._requests[request_id] = request
            self._waiting.append(request)
            self._wakeup.notify_all()
        return request

    def abort(self, request_id: str) -> None:
        """Stop a request (thread-safe); it finishes with reason "abort". No-op if unknown or already finished."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return
            if request in self._waiting:
                self._waiting.remove(request)
                self._release(request, "abort")
            else:
                self._aborted.add(request_id)
            self._wakeup.notify_all()

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests)

    def generate(self, prompts, **request_kwargs) -> list[list[int]]:
        """Run `prompts` (a list of prompts) to completion; returns the new tokens of each, in order."""
        if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("`generate` takes a list of prompts; wrap a single prompt in a list.")
        requests = [self.add_request(p, **request_kwargs) for p in prompts]
        if not self.is_running:
            while not all(r.finished for r in requests):
                self.step()
        return [r.wait() for r in requests]

    # -- the round ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[Request]:
        """One round: admit -> draft -> schedule -> verify -> accept -> commit -> crop -> retire.

        Returns the requests that finished during this step.
        """
        with self._step_lock:
            try:
                finished = self._retire() + self._admit()
                self._crop()  # a sliding-window target must see right-aligned rows from the first verify on
                if self.rows:
                    block = self._drafted_block() if self._drafting_pays() else self._no_drafts()
                    logits, features = self._verify(block)
                    accepted, bonus = self._accept(block, logits)
                    self._commit(block, accepted, bonus, features)
                    finished += self._retire()
                    self._crop()
                return finished
            except BaseException as error:
                self._fail_all(error)
                raise

    def _admit(self) -> list[Request]:
        """Prefill queued requests while the batch has room; returns those finished by their first token."""
        with self._lock:
            room = min(self.max_batch_size - len(self.rows), len(self._waiting))
            requests = [self._waiting.popleft() for _ in range(room)]
        if not requests:
            return []
        rows, cache = self._prefill(requests)
        keep = [i for i, r in enumerate(requests) if not r.finished]  # EOS or max_new_tokens=1: done already
        if len(keep) < len(requests):
            cache.select(keep)
        if keep:
            self.target_cache.extend(cache)
            if self.drafter is not None:
                self.drafter_cache.extend(RaggedCache(self.device, batch_size=len(keep)))  # no context yet: holes
            self.rows += [rows[i] for i in keep]
        return [self._released(r) for r in requests if r.finished]

    def _prefill(self, requests: list[Request]) -> tuple[list[_Row], RaggedCache]:
        """The new prompts through the target in one forward, right-padded (pads are holes); commits each first
        token. A single prompt runs exactly as plain `generate()` runs it (no mask, logits of the last position)."""
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.tensor([r.prompt_ids + [0] * (width - len(r.prompt_ids)) for r in requests], device=self.device)
        last = torch.tensor(lengths, device=self.device) - 1  # (n,) position of each prompt's last token
        valid = torch.arange(width, device=self.device)[None] <= last[:, None]  # (n, P)
        kept = torch.unique(last)  # sorted; only these logits are computed, as generate() keeps only the last
        kwargs = {"logits_to_keep": kept} if self.keeps_logits else {}
        if not bool(valid.all()):
            kwargs["attention_mask"] = valid.long()
        cache = RaggedCache(self.device, batch_size=len(requests))
        out = self.target(
            input_ids=ids, use_cache=True, output_hidden_states=self.taps, **kwargs, **{self.cache_arg: cache.cache}
        )
        cache.commit(valid)
        self._counts["prefills"] += 1
        column = torch.searchsorted(kept, last) if self.keeps_logits else last
        logits = out.logits.to(self.device)[torch.arange(len(requests), device=self.device), column].float()  # (n, V)
        tokens = self._choose(self._warp(logits, requests), requests).tolist()
        features = self._features(out) if self.taps else None  # (n, P, m·d)
        rows = []
        for i, (request, token) in enumerate(zip(requests, tokens)):
            context = features[i, : lengths[i]] if features is not None else None  # every prompt position
            self._emit(request, [token])
            rows.append(_Row(request, request.prompt_ids + [token], context))
        return rows, cache

    def _drafting_pays(self) -> bool:
        """Whether to draft this round: always with a drafter, unless the draft gate (`scheduler.DraftGate`) finds
        the round cheaper as a plain step."""
        if self.drafter is None:
            return False
        if self.gate is None or self.gate.should_draft([row.hint for row in self.rows], self._caps()):
            return True
        self._counts["gated_rounds"] += 1
        return False

    def _drafted_block(self) -> _Block:
        """draft -> sample -> schedule; timed, with the confidences seen, for the gate."""
        start = time.perf_counter()
        block = self._schedule(self._sample(self._draft()))
        if self.gate is not None:  # _sample read the confidences back: the time includes the device's work
            self.gate.record(time.perf_counter() - start, block.confidences)
            for row, confidences in zip(self.rows, block.confidences):
                row.hint = confidences
        return block

    def _caps(self) -> list[int]:
        """Drafts each row may examine: `num_assistant_tokens`, and one fewer than its remaining budget (the bonus
        takes the last slot)."""
        return [min(self.num_assistant_tokens, row.request.remaining - 1) for row in self.rows]

    def _draft(self) -> torch.Tensor:
        """Backbone pass for all rows; returns h (B, γ, d). The drafter cache keeps the new context, not the block.

        Row r appends its n_r new context entries (positions start_r .. start_r + n_r - 1, padded to the longest
        row and masked) and runs the block [anchor, mask, ...] at positions anchor_r .. anchor_r + γ - 1.
        """
        rows, gamma = self.rows, self.block_size
        device = self.drafter_device
        n_new = torch.tensor([row.context.shape[0] for row in rows], device=device)
        contexts = [row.context.to(device) for row in rows]
        context = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True)  # (B, C, m·d), zero-padded
        width = context.shape[1]
        ctx_valid = torch.arange(width, device=device)[None] < n_new[:, None]  # (B, C)
        anchor = torch.tensor([row.anchor_position for row in rows], device=device)
        start = anchor - n_new  # context always ends right before the anchor
        ctx_positions = start[:, None] + torch.arange(width, device=device)  # (B, C)
        block_positions = anchor[:, None] + torch.arange(gamma, device=device)  # (B, γ)
        position_ids = torch.cat([ctx_positions, block_positions], dim=1)  # (B, C + γ)
        keys = torch.cat([self.drafter_cache.valid, ctx_valid, ctx_valid.new_ones(len(rows), gamma)], dim=1)
        mask = None if bool(keys.all()) else keys[:, None, None, :].expand(-1, 1, gamma, -1)  # (B, 1, γ, K)
        anchor_ids = torch.tensor([[row.seq[-1]] for row in rows], device=self.embed_tokens.weight.device)
        out = self.drafter(
            noise_embeds=self.drafter.block_input_embeds(anchor_ids, self.embed_tokens),
            context_hidden_states=context,
            position_ids=position_ids,
            attention_mask=mask,
            cache=self.drafter_cache.cache,
        )
        self.drafter_cache.cache.crop(-gamma)  # the block's own K/V are not context
        self.drafter_cache.commit(ctx_valid)
        for row in rows:
            row.context = None
        return out.last_hidden_state

    def _sample(self, hidden: torch.Tensor) -> _Block:
        """Token-by-token sampling through the sequential head for all rows at once (DSpark §3.5).

        hidden (B, γ, d). For k = 1..K: the confidence of position k from [h_k; x_{k-1}] (before x_k exists), then
        x_k from processors(U_k + B_k(x_{k-1})): argmax, or a draw from the row's own generator. Row r examines
        `cap_r = min(num_assistant_tokens, remaining_r - 1)` positions (it cannot commit more: the bonus takes the
        last slot). "threshold" and "scheduler" stop sampling once the positions seen settle every row's verify
        length (`_settled`): under load Algorithm 1 often verifies 0-1 drafts per row, and the rest of the block
        would be sampled for nothing.
        """
        requests = [row.request for row in self.rows]
        caps = self._caps()
        steps = max(caps)
        prev = torch.tensor([[row.seq[-1]] for row in self.rows], device=hidden.device)  # (B, 1): the anchors
        tokens = prev.new_zeros(len(requests), steps)
        if steps == 0:
            return _Block(tokens, None, caps, [[] for _ in requests])
        # One LM-head product for the block; a policy that can stop early takes the first two positions first
        first = steps if self.policy == "fixed" else min(EARLY_DRAFT_POSITIONS, steps)
        base = self.drafter.draft_base_logits(hidden[:, :first], self.lm_head)  # (B, K', V)
        sampling = any(r.do_sample for r in requests)
        logits_out = base.new_zeros(len(requests), steps, base.shape[-1]) if sampling else None
        conditional, state = [], None
        for k in range(steps):
            if k == base.shape[1]:
                base = torch.cat([base, self.drafter.draft_base_logits(hidden[:, k:steps], self.lm_head)], dim=1)
            h_k = hidden[:, k : k + 1]
            conf = self.drafter.confidence_logits(h_k, prev)  # (B, 1) or None without a confidence head
            if conf is not None:
                conditional.append(torch.sigmoid(conf[:, 0] / self.temperatures[k]).tolist())  # STS-calibrated c_k
            bias, state = self.drafter.draft_sequential_bias(prev, h_k, state)
            logits = self._warp(base[:, k] if bias is None else base[:, k] + bias[:, 0], requests)  # (B, V)
            tokens[:, k] = self._choose(logits, requests, live=[k < cap for cap in caps])
            if logits_out is not None:
                logits_out[:, k] = logits
            prev = tokens[:, k : k + 1]
            if conf is not None and k + 1 < steps and self._settled(conditional, caps):
                break  # no later position can be verified: the rest of the block is not sampled
        seen = [list(c) for c in zip(*conditional)] if conditional else [[] for _ in requests]
        return _Block(tokens, logits_out, caps, [c[:cap] for c, cap in zip(seen, caps)])

    def _settled(self, conditional: list[list[float]], caps: list[int]) -> bool:
        """Whether the positions sampled so far already decide every row's verify length.

        conditional[k][r]: c_{r,k+1} for the K positions sampled so far. The survivals a_{r,K} of rows with
        positions left bound every later survival; "threshold" is settled when they are all below the threshold,
        Algorithm 1 when its greedy stops above them (`settled_prefix_schedule`). "fixed" never stops early.
        """
        seen = len(conditional)
        rows = [[c[r] for c in conditional[: caps[r]]] for r in range(len(caps))]
        bound = max((math.prod(c) for c, cap in zip(rows, caps) if cap > seen), default=0.0)
        if self.policy == "threshold":
            return bound < self.drafter.config.confidence_threshold
        if self.policy == "scheduler":
            return settled_prefix_schedule(rows, self.sps, bound, max_tokens=len(caps) + sum(caps)) is not None
        return False

    def _schedule(self, block: _Block) -> _Block:
        """Verify lengths ℓ_r <= cap_r per the policy. Each decides position k from survivals of positions <= k
        (and, for Algorithm 1, other rows' survivals), never from x_k itself: the cut stays lossless.

        The verify runs on (B, W) tokens, W = max ℓ_r + 1, whatever the shorter rows verify, so each row then
        fills its slots up to W with its own further drafts (those it sampled, within its cap): more drafts checked
        at no extra cost. Whether row r's draft k is verified still depends only on its drafts before k (through
        the policy's cut and the other rows' lengths), so this stays lossless too.
        """
        if self.policy == "fixed":
            return block  # the whole (capped) block
        if self.policy == "threshold":
            threshold = self.drafter.config.confidence_threshold
            block.lengths = [sum(1 for _ in itertools.takewhile(lambda a: a >= threshold, s)) for s in block.survival]
        else:  # "scheduler"
            reach = len(block.lengths) + sum(block.lengths)  # lengths are still the caps here: the widest verify
            block.lengths = prefix_schedule(block.confidences, self.sps, max_tokens=reach)
        width = max(block.lengths, default=0)
        block.lengths = [min(width, len(c)) for c in block.confidences]  # len(c): positions sampled, capped
        return block

    def _no_drafts(self) -> _Block:
        """Plain decoding: every row verifies only its anchor."""
        n = len(self.rows)
        return _Block(torch.zeros(n, 0, dtype=torch.long, device=self.device), None, [0] * n, [[] for _ in range(n)])

    def _verify(self, block: _Block) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One target forward over [anchor, ℓ_r drafts] per row, padded to W = max ℓ_r + 1 and masked.

        Returns logits (B, W, V) float32 and the tapped features (B, W, m·d) (None for plain decoding). Slot j of
        row r sits at position anchor_r + j and predicts the token after it.
        """
        lengths = torch.tensor(block.lengths, device=self.device)
        width = int(lengths.max()) + 1
        anchors = torch.tensor([[row.seq[-1]] for row in self.rows], device=self.device)
        ids = torch.cat([anchors, block.tokens[:, : width - 1].to(self.device)], dim=1)  # (B, W)
        slots = torch.arange(width, device=self.device)
        position_ids = torch.tensor([row.anchor_position for row in self.rows], device=self.device)[:, None] + slots
        mask = self.target_cache.attention_mask(slots[None] <= lengths[:, None])  # (B, T + W)
        with verifying(self.target):
            out = self.target(
                input_ids=ids, attention_mask=mask.long(), position_ids=position_ids, use_cache=True,
                output_hidden_states=self.taps, **{self.cache_arg: self.target_cache.cache},
            )  # fmt: skip
        self._counts["rounds"] += 1
        return out.logits.to(self.device).float(), self._features(out) if self.taps else None

    def _accept(self, block: _Block, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """Accepted draft count and bonus token per row: greedy match, or rejection sampling for sampling rows."""
        lengths = torch.tensor(block.lengths, device=self.device)
        width = logits.shape[1]
        drafts = block.tokens[:, : width - 1].to(self.device)
        accepted, bonus = accept_greedy(drafts, logits.argmax(dim=-1), lengths)
        accepted, bonus = accepted.tolist(), bonus.tolist()
        requests = [row.request for row in self.rows]
        warped = self._warp(logits, requests)
        for i, request in enumerate(requests):
            if request.do_sample:
                n = block.lengths[i]
                target_probs = torch.softmax(warped[i, : n + 1], dim=-1)  # (n + 1, V)
                draft_probs = torch.softmax(block.logits[i, :n].to(self.device), dim=-1) if n else logits[i, :0]
                accepted[i], bonus[i] = accept_speculative_sampling(
                    target_probs, draft_probs, drafts[i, :n], request.generator
                )
        return accepted, bonus

    def _commit(self, block: _Block, accepted: list[int], bonus: list[int], features: torch.Tensor | None) -> None:
        """Append accepted drafts + bonus per row; the anchor and accepted drafts stay valid in the target cache."""
        width = max(block.lengths) + 1
        keep = torch.arange(width, device=self.device)[None] <= torch.tensor(accepted, device=self.device)[:, None]
        self.target_cache.commit(keep)  # rejected and padding slots become holes
        survival = block.survival
        for i, row in enumerate(self.rows):
            n_acc, request = accepted[i], row.request
            new = block.tokens[i, :n_acc].tolist() + [bonus[i]]
            stopped = self._emit(request, new)
            request.stats.record_step(block.lengths[i], n_acc, stopped=stopped, survival=survival[i])
            row.seq += new
            if features is not None:  # the old anchor + accepted drafts (the bonus is the new anchor), after any
                new_context = features[i, : n_acc + 1]  # context a gated round left for the next draft pass
                row.context = new_context if row.context is None else torch.cat([row.context, new_context])
            self._counts["request_rounds"] += 1
            self._counts["verified_drafts"] += block.lengths[i]
            self._counts["accepted_drafts"] += n_acc

    def _crop(self) -> None:
        """Drop trailing holes; compact a cache whose holes pile up (the target's whenever a sliding window would
        otherwise count holes)."""
        for cache in (self.target_cache, self.drafter_cache):
            cache.trim()
            sliding = cache is self.target_cache and self.sliding and not cache.is_right_aligned()
            if cache.batch_size and (sliding or cache.hole_fraction() > self.compact_fraction):
                cache.compact()
                self._counts["compactions"] += 1

    def _retire(self) -> list[Request]:
        """Remove finished and aborted rows from the batch and both caches."""
        with self._lock:
            aborted, self._aborted = self._aborted, set()
        for row in self.rows:
            if row.request.request_id in aborted:
                row.request._finish("abort")
        keep = [i for i, row in enumerate(self.rows) if not row.request.finished]
        done = [row.request for row in self.rows if row.request.finished]
        if done:
            self.target_cache.select(keep)
            if self.drafter is not None:
                self.drafter_cache.select(keep)
            self.rows = [self.rows[i] for i in keep]
        return [self._released(r) for r in done]

    # -- helpers --------------------------------------------------------------------------------------------------

    def _features(self, out) -> torch.Tensor:
        """Tapped target layers, concatenated in `target_layer_ids` order: (B, L, m·d)."""
        return torch.cat([out.hidden_states[i].to(self.device) for i in self.taps], dim=-1)

    def _warp(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each sampling request's warpers on its rows of logits (B, ..., V); greedy rows pass through unchanged."""
        groups: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            if request.sampling_key is not None and len(request.warpers):
                groups.setdefault(request.sampling_key, []).append(i)
        if not groups:
            return logits
        logits = logits.clone()
        for rows in groups.values():
            index = torch.tensor(rows, device=logits.device)
            part = logits[index]
            flat = part.reshape(-1, part.shape[-1])  # (rows · slots, V): warpers act per row
            logits[index] = requests[rows[0]].warpers(None, flat).reshape(part.shape)
        return logits

    def _choose(self, logits: torch.Tensor, requests: list[Request], live: list[bool] | None = None):
        """Next token per row from processed logits (B, V): argmax, or a draw from the row's own generator for
        sampling rows. Only `live` rows draw, so a request's random stream does not depend on the batch."""
        tokens = logits.argmax(dim=-1)
        for i, request in enumerate(requests):
            if request.do_sample and (live is None or live[i]):
                probs = torch.softmax(logits[i], dim=-1)
                tokens[i] = torch.multinomial(probs, 1, generator=request.generator)[0]
        return tokens

    def _emit(self, request: Request, tokens: list[int]) -> bool:
        """Commit tokens to a request (clipped at EOS / max_new_tokens); True if it finished."""
        before = len(request.output_ids)
        finished = request._commit(tokens)
        self._counts["generated_tokens"] += len(request.output_ids) - before
        return finished

    def _released(self, request: Request) -> Request:
        """Bookkeeping for a finished request."""
        with self._lock:
            self._requests.pop(request.request_id, None)
        self._counts["finished_requests"] += 1
        reached, accepted = request.stats.position_counts()
        for k in range(self.block_size):
            self._position_counts[0][k] += reached[k]
            self._position_counts[1][k] += accepted[k]
        return request

    def _release(self, request: Request, reason: str, error: BaseException | None = None) -> None:
        """Finish a request that is not in the batch (called with `_lock` held)."""
        request._finish(reason, error)
        self._requests.pop(request.request_id, None)

    def _fail_all(self, error: BaseException) -> None:
        """After an exception mid-round the batch state is unreliable: end every request with reason "error"."""
        logger.error(f"DSpark engine step failed: {error!r}; ending all requests.")
        with self._lock:
            for request in list(self._requests.values()):
                self._release(request, "error", error)
            self._waiting.clear()
            self._aborted.clear()
        self.rows = []
        self.target_cache, self.drafter_cache = RaggedCache(self.device), RaggedCache(self.device)

    # -- background loop ----------------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Run `step()` in a background thread whenever there is work (for servers). Idempotent."""
        if self.is_running:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="dspark-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop thread after its current step; unfinished requests stay queued for a later start/step."""
        self._stopping.set()
        with self._lock:
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                self._wakeup.wait_for(lambda: self._stopping.is_set() or bool(self._requests), timeout=1.0)
            if self._stopping.is_set():
                break
            if self._requests:
                try:
                    self.step()
                except Exception:  # already logged and every request failed by step(); keep serving
                    pass

    # -- statistics -----------------------------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """Aggregate counters. τ (`acceptance_length`) counts tokens committed per request-round, bonus included;
        `per_position_acceptance` covers finished requests."""
        c = dict(self._counts)
        rounds, request_rounds = c["rounds"], c["request_rounds"]
        reached, accepted = self._position_counts
        c.update(
            target_forwards=rounds + c["prefills"],
            mean_batch_size=request_rounds / rounds if rounds else 0.0,
            mean_verify_length=c["verified_drafts"] / request_rounds if request_rounds else 0.0,
            acceptance_length=(c["accepted_drafts"] + request_rounds) / request_rounds if request_rounds else 0.0,
            per_position_acceptance=[a / r if r else None for r, a in zip(reached, accepted)],
            active=len(self.rows),
            waiting=len(self._waiting),
            verify_policy=self.policy,
            num_assistant_tokens=self.num_assistant_tokens,
            gate_drafts=self.gate is not None,
        )
        return c


def _covering_sps(sps: SPS, max_tokens: int) -> SPS:
    """An SPS lookup defined up to `max_tokens` (the largest possible verify batch). A table that stops short is
    extended by assuming verify time grows linearly beyond its largest entry (conservative), with a warning."""
    if callable(sps):
        return sps
    table = {int(b): float(s) for b, s in dict(sps).items()}
    largest = max(table)
    if largest >= max_tokens:
        return table
    logger.warning(
        f"The SPS profile covers verify batches up to {largest} tokens, the engine may verify {max_tokens}: "
        "assuming time grows linearly beyond. Profile larger batches (`dspark-hf profile`) for a precise schedule."
    )
    lookup = SPSCurve(table)
    return lambda b: lookup(b) if b <= largest else table[largest] * largest / b


__all__ = ["Engine", "Request"]
