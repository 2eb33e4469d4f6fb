"""`Engine`: batched DSpark speculative decoding with continuous batching, over any HF causal LM (public API only).

Requests join and leave between rounds; each round is the one round of `core.SpeculativeDecoder` (draft → choose
lengths → verify → accept → commit) for every active request. The Engine is its driver: a thread-safe request queue,
admission (prefill) while the batch has room, retirement of finished and aborted requests, a background loop for
servers, and counters. Each request's output is its own plain output whatever else is in the batch:
token-identical under greedy decoding; under sampling the very tokens its seed gives in plain decoding (noise keyed
by the request's seed and each token's position, `decoding/randomness.py`).
"""

import itertools
import secrets
import threading
from collections import deque
from collections.abc import Callable

import torch
from transformers.utils import logging

from ..decoding.core import SpeculativeDecoder
from ..decoding.drafting import is_drafter
from ..decoding.policy import VerifyPolicy
from ..decoding.rows import Row
from ..decoding.scheduler import SPS
from ..models.settings import check_sampling
from ..utils.devices import model_device
from .request import Request, check_sampling_settings, prompt_token_ids


logger = logging.get_logger(__name__)


class _RequestRow(Row):
    """A `Request` as a row of the decoder: its sampling settings, budget and output stream."""

    def __init__(self, request: Request, counts: dict):
        super().__init__(request.prompt_ids, do_sample=request.do_sample, seed=request.seed, sampling=request.sampling)
        self.request, self._counts = request, counts
        self.stats = request.stats
        self.sampling_key, self.warpers = request.sampling_key, request.warpers

    @property
    def remaining(self) -> int:
        return self.request.remaining

    def commit(self, tokens: list[int], scores=None, logits=None, hidden_states=None) -> int:
        before = len(self.request.output_ids)
        self.finished = self.request._commit(tokens)
        taken = len(self.request.output_ids) - before
        self._counts["generated_tokens"] += taken
        return taken


class Engine:
    """Batched speculative decoding: `add_request` from any thread, then `step()` (or `start()` a loop thread).

    Args:
        target: a causal LM with a full-attention KV cache (Llama, Qwen2/3, Mistral, Gemma text models).
        drafter: a drafter of this package made for `target` (DSpark, DFlash mode, EAGLE-3), or None for plain
            batched decoding (the benchmark baseline).
        tokenizer: checked against the drafter's recorded tokenizer; also lets `add_request` take a string.
        max_batch_size: most requests decoded together; more wait in a queue.
        verify_policy: "fixed" | "threshold" | "scheduler"; None takes `drafter.config.verify_policy`. Without a
            confidence head every policy verifies the whole block.
        sps: Algorithm 1's profile {verify_batch_tokens: steps_per_second} or a callable; None uses
            `profiling.sps_for` (the checkpoint's sps_profile.json, else a quick profile).
        num_assistant_tokens: the most drafts a request examines per round (transformers' name), 1..block size;
            None = the drafter's whole block. With "fixed" this is fixed γ: a shorter γ from the same block pass.
        gate_drafts: skip the draft pass in rounds where it is not expected to pay (`decoding.gate.DraftGate`), so the
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
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.max_batch_size = max_batch_size
        self.device = model_device(target)
        self.vocab_size = target.config.get_text_config().vocab_size
        policy = None
        if drafter is None:
            for name, value in (("verify_policy", verify_policy), ("gate_drafts", gate_drafts)):
                if value:
                    raise ValueError(f"{name}={value!r} needs a drafter; plain decoding verifies nothing.")
            if draft_seconds is not None:
                raise ValueError("`draft_seconds` prices the draft gate, which needs a drafter.")
        else:
            if not is_drafter(drafter):
                raise TypeError(
                    "`drafter` must be a DSpark or EAGLE-3 drafter of this package (config.model_type 'dspark' or "
                    f"'dspark_eagle3'), got {type(drafter).__name__}."
                )
            drafter.config.check_runtime_settings(drafter)
            drafter.config.check_target(target.config, tokenizer)
            policy = VerifyPolicy.for_drafter(
                drafter, target, verify_policy, sps=sps, max_rows=max_batch_size, gate_drafts=gate_drafts,
                draft_seconds=draft_seconds,
            )  # fmt: skip
        self.decoder = SpeculativeDecoder(
            target,
            drafter,
            policy=policy,
            num_assistant_tokens=num_assistant_tokens,
            compact_fraction=compact_fraction,
        )
        self.block_size = self.decoder.block_size
        self._waiting: deque[Request] = deque()
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self._counts = {"generated_tokens": 0, "finished_requests": 0}
        self._position_counts = ([0] * self.block_size, [0] * self.block_size)

    @property
    def policy(self) -> str:
        """The verify policy in use ("plain" without a drafter)."""
        return "plain" if self.decoder.policy is None else self.decoder.policy.name

    @property
    def gate(self):
        """The draft gate (`decoding.gate.DraftGate`), or None."""
        return None if self.decoder.policy is None else self.decoder.policy.gate

    @property
    def tree_budget(self) -> int | str:
        """The drafter's tree budget as it stands now (0: chains, and always 0 without a drafter; "auto": trees in
        the rounds that can take them). Standard sampling verifies chains only, so a sampled request with
        `sampling="standard"` is refused while this is a number > 0 (under "auto" its rounds draft chains)."""
        return getattr(getattr(self.drafter, "config", None), "tree_budget", 0)

    @property
    def rows(self) -> list[Row]:
        """The active requests' rows, in batch order."""
        return self.decoder.rows

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
        sampling: str = "coupled",
    ) -> Request:
        """Queue a request (thread-safe). `input_ids`: list[int] or 1-D LongTensor (a string with a tokenizer).

        `eos_token_id` None takes the target's `generation_config.eos_token_id`. `seed` keys a sampled request's
        noise at each position (`decoding/randomness.py`), so one seed gives one output under every policy, batch
        and load, with or without a drafter (None: a fresh random seed, kept in `request.seed`). `sampling="standard"`
        samples with standard speculative (rejection) sampling instead: more drafts accepted, the same distribution,
        but a seed's tokens then depend on the drafter, its settings and the batch (`decoding/acceptance.py`).
        Returns the `Request` to stream or wait on.
        """
        if self.drafter is not None:  # rounds read the drafter's settings: changed since construction, refused here
            self.drafter.config.check_runtime_settings(self.drafter)
        prompt = prompt_token_ids(input_ids, self.vocab_size, self.tokenizer)
        check_sampling_settings(max_new_tokens, do_sample, temperature, top_p, top_k, seed)
        check_sampling(sampling, self.tree_budget, do_sample)
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
                sampling=sampling,
            )  # fmt: skip
            if request.seed is None:  # recorded on the request: passing it again reproduces the output
                request.seed = secrets.randbits(63)
            request._run_round = self._round_for_a_waiter
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
        """One round: retire → admit → the decoder's round → retire. Returns the requests that finished."""
        with self._step_lock:
            try:
                finished = self._retire() + self._admit()
                self.decoder.step()
                return finished + self._retire()
            except BaseException as error:
                self._fail_all(error)
                raise

    def _round_for_a_waiter(self) -> bool:
        """`Request.wait()` / `stream()` while no loop thread runs: one round in the caller's thread (False, and
        nothing run, when a loop thread runs). A failed round has already ended every request with its error."""
        if self.is_running:
            return False
        try:
            self.step()
        except Exception:  # step() has ended every request with the error, which wait() / stream() raise
            pass
        return True

    def _admit(self) -> list[Request]:
        """Prefill queued requests while the batch has room; returns those finished by their first token."""
        with self._lock:
            room = min(self.max_batch_size - len(self.decoder.rows), len(self._waiting))
            requests = [self._waiting.popleft() for _ in range(room)]
        if not requests:
            return []
        done = self.decoder.prefill([_RequestRow(r, self._counts) for r in requests])
        return [self._released(row.request) for row in done]

    def _retire(self) -> list[Request]:
        """Remove finished and aborted requests from the batch."""
        with self._lock:
            aborted, self._aborted = self._aborted, set()
        for row in self.decoder.rows:
            if row.request.request_id in aborted:
                row.request._finish("abort")
                row.finished = True
        return [self._released(row.request) for row in self.decoder.retire()]

    # -- helpers --------------------------------------------------------------------------------------------------

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
        self.decoder.reset()

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
        """Stop the loop thread after its current step. The engine can start again: unfinished and newly added
        requests stay queued for a later `start()` or `step()`, and `wait()` / `stream()` on one run its rounds in the
        caller's thread meanwhile (as on an engine never started)."""
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
        c = {**self.decoder.counts, **self._counts}
        rounds, request_rounds = c["rounds"], c["request_rounds"]
        reached, accepted = self._position_counts
        c.update(
            target_forwards=rounds + c["prefills"],
            mean_batch_size=request_rounds / rounds if rounds else 0.0,
            mean_verify_length=c["verified_drafts"] / request_rounds if request_rounds else 0.0,
            acceptance_length=(c["accepted_drafts"] + request_rounds) / request_rounds if request_rounds else 0.0,
            per_position_acceptance=[a / r if r else None for r, a in zip(reached, accepted)],
            active=len(self.decoder.rows),
            waiting=len(self._waiting),
            verify_policy=self.policy,
            num_assistant_tokens=self.decoder.num_assistant_tokens,
            gate_drafts=self.gate is not None,
        )
        return c


__all__ = ["Engine", "Request"]
