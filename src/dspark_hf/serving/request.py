"""`Request`: one generation request inside the batched `Engine`, with its sampling settings and its output stream."""

import operator
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..decoding.stats import DSparkGenerationStats


_POLL_S = 0.05  # how often a waiting caller checks whether the engine's loop thread still runs


class Request:
    """A request's settings, output and progress; created by `Engine.add_request`.

    The engine appends committed tokens to `output_ids` once per round and pushes the same chunk to the stream.
    `finish_reason` is "stop" (an EOS token, included in the output), "length" (`max_new_tokens` reached),
    "abort" (`Engine.abort`) or "error" (the engine loop raised; `error` holds the exception).
    """

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        do_sample: bool,
        temperature: float,
        top_p: float,
        top_k: int,
        eos_token_ids: frozenset[int],
        seed: int | None,
        block_size: int = 0,
        sampling: str = "coupled",
    ):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.max_new_tokens, self.do_sample = max_new_tokens, do_sample
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.eos_token_ids, self.seed = eos_token_ids, seed
        self.sampling = sampling  # "coupled" or "standard" (`decoding/acceptance.py`)
        self.stats = DSparkGenerationStats(block_size=block_size, num_prompt_tokens=len(prompt_ids))
        self._warpers = self._build_warpers()
        self._chunks: queue.Queue = queue.Queue()
        self._done = threading.Event()
        # set by the engine: runs one round in the caller's thread when no loop thread runs; False when one does
        self._run_round: Callable[[], bool] | None = None

    # -- progress -----------------------------------------------------------------------------------------------

    @property
    def num_rounds(self) -> int:
        """Verify rounds this request took part in (the prefill is not a round)."""
        return self.stats.num_target_forwards

    @property
    def verify_lengths(self) -> list[int]:
        """Drafts verified per round (0 every round for plain decoding)."""
        return self.stats.verify_lengths

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def sampling_key(self) -> tuple | None:
        """Requests with equal keys share one warper pass; None for greedy."""
        return (self.temperature, self.top_k, self.top_p) if self.do_sample else None

    @property
    def warpers(self) -> LogitsProcessorList:
        """The warpers `generate()` builds for these settings, in its order (temperature, top-k, top-p)."""
        return self._warpers

    def _build_warpers(self) -> LogitsProcessorList:
        out = LogitsProcessorList()
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(self.top_p))
        return out

    # -- engine side ----------------------------------------------------------------------------------------------

    def _commit(self, tokens: list[int]) -> bool:
        """Append tokens as plain decoding would: nothing after an EOS or past `max_new_tokens`. True if finished."""
        tokens = tokens[: self.remaining]
        reason = None
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                tokens, reason = tokens[: i + 1], "stop"
                break
        if reason is None and len(tokens) == self.remaining:
            reason = "length"
        self.output_ids.extend(tokens)
        self.stats.num_new_tokens = len(self.output_ids)
        if tokens:
            self._chunks.put(list(tokens))
        if reason is not None:
            self._finish(reason)
        return reason is not None

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        if self.finished:
            return
        self.finished, self.finish_reason, self.error = True, reason, error
        self._chunks.put(None)
        self._done.set()

    # -- user side ------------------------------------------------------------------------------------------------

    def stream(self, timeout: float | None = None) -> Iterator[list[int]]:
        """New token chunks as rounds commit them; ends when the request finishes. One consumer per request.
        While the engine runs no loop thread (never started, or stopped), the rounds run here, in the caller's thread.

        Raises TimeoutError when no chunk arrives within `timeout` seconds, RuntimeError if the engine failed.
        """
        while True:
            chunk = self._next_chunk(timeout)
            if chunk is None:
                self._chunks.put(None)  # a later stream() ends at once too
                self._raise_error()
                return
            yield chunk

    def wait(self, timeout: float | None = None) -> list[int]:
        """Block until finished; returns the generated tokens (prompt excluded). While the engine runs no loop thread
        (never started, or stopped), the rounds run here, in the caller's thread, so a queued request never waits
        for a round nobody will run."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"Request {self.request_id} did not finish within {timeout} s.")
            if not self._serve():
                self._done.wait(_POLL_S if left is None else min(_POLL_S, left))
        self._raise_error()
        return list(self.output_ids)

    def _next_chunk(self, timeout: float | None):
        """The next chunk (None: finished), running rounds here while no loop thread does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._chunks.get_nowait()
            except queue.Empty:
                pass
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"Request {self.request_id}: no tokens within {timeout} s.")
            if not self._serve():
                try:
                    return self._chunks.get(timeout=_POLL_S if left is None else min(_POLL_S, left))
                except queue.Empty:
                    continue

    def _serve(self) -> bool:
        """Run one round of the engine in this thread if no loop thread runs one; False if one does."""
        return self._run_round is not None and self._run_round()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"The engine failed while running request {self.request_id}.") from self.error

    def __repr__(self) -> str:
        state = self.finish_reason if self.finished else "running"
        return f"Request({self.request_id!r}, prompt={len(self.prompt_ids)}, new={len(self.output_ids)}, {state})"


def prompt_token_ids(input_ids, vocab_size: int, tokenizer=None) -> list[int]:
    """A prompt as token ids: list[int] (any integer-like items) or a 1-D integer tensor; a string with a tokenizer."""
    if isinstance(input_ids, str):
        if tokenizer is None:
            raise TypeError("A string prompt needs `tokenizer=` at Engine construction; or pass token ids.")
        try:
            input_ids.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"`input_ids` is not valid Unicode text: it holds a lone UTF-16 surrogate ({e.object[e.start]!r} at "
                f"character {e.start}); pass text with surrogates only in pairs, or token ids."
            ) from None
        input_ids = tokenizer.encode(input_ids)
    if isinstance(input_ids, torch.Tensor):
        if input_ids.numel() == 0:
            raise ValueError(
                f"`input_ids` is empty (shape {tuple(input_ids.shape)}): a request needs at least one prompt token."
            )
        if input_ids.dim() != 1 or input_ids.is_floating_point():
            raise ValueError(f"`input_ids` must be a 1-D integer tensor, got {input_ids.dtype} {input_ids.shape}.")
        input_ids = input_ids.tolist()
    try:
        input_ids = [operator.index(t) for t in input_ids]
    except TypeError:
        raise TypeError(f"`input_ids` must be a list of ints or a 1-D LongTensor, got {input_ids!r:.80}") from None
    if not input_ids:
        raise ValueError("`input_ids` is empty: a request needs at least one prompt token.")
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"Token ids {bad[:5]} lie outside the target's vocabulary [0, {vocab_size}).")
    return input_ids


def check_sampling_settings(max_new_tokens, do_sample, temperature, top_p, top_k, seed) -> None:
    """ValueError/TypeError naming the first bad setting of a request."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be an int >= 1, got {max_new_tokens!r}.")
    if do_sample and not temperature > 0:
        raise ValueError(f"`temperature` must be > 0 when sampling, got {temperature} (greedy: do_sample=False).")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"`top_p` must lie in (0, 1], got {top_p}.")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"`top_k` must be an int >= 0 (0 disables it), got {top_k!r}.")
    if seed is not None and not isinstance(seed, int):
        raise TypeError(f"`seed` must be an int or None, got {type(seed).__name__}.")


__all__ = ["Request", "check_sampling_settings", "prompt_token_ids"]
