"""OpenAI request validation and response shapes for `/v1/completions` and `/v1/chat/completions`.

Pure functions, no HTTP: `parse_completion` / `parse_chat` turn a decoded JSON body into a `ParsedRequest` (prompt
token ids plus `Engine.add_request` keyword arguments) or raise `ProtocolError` (an HTTP status and an OpenAI-style
message naming the field); the `*_response` / `*_chunk` builders produce OpenAI's JSON objects. Non-standard
statistics travel in an extra top-level `"dspark"` field, which OpenAI clients ignore; the one request
field of this server's own, `dspark_sampling`, carries the same prefix (OpenAI's clients send it as an extra body
field).
"""

import math
import time
import uuid
from dataclasses import dataclass, field

from ..models.settings import SAMPLING_MODES
from ..utils.prompts import encode


MAX_STOP_SEQUENCES = 4

# Fields OpenAI defines that this server does not implement: accepted only with their "off" value.
_UNSUPPORTED_COMMON = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None,),
}
_UNSUPPORTED_COMPLETION = {"echo": (False, None), "best_of": (1, None), "suffix": (None,), "logprobs": (None, 0)}
_UNSUPPORTED_CHAT = {
    "logprobs": (False, None),
    "top_logprobs": (None, 0),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None,),
    "function_call": (None, "none"),
    "response_format": (None,),
}
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "user",
    "dspark_sampling",  # this server's own: how a sampled request is decoded (`Engine.add_request`'s `sampling`)
}
_CHAT = {"messages", "max_completion_tokens"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ProtocolError(ValueError):
    """A request the server refuses: `status` is the HTTP code, `param` the offending field (or None)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def to_dict(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ServingLimits:
    """What the served model accepts: its name, context length (prompt + completion tokens) and vocabulary size."""

    model_name: str
    max_model_len: int
    vocab_size: int


@dataclass
class ParsedRequest:
    """A validated request: `prompt_ids` and the `Engine.add_request` keyword arguments in `generation`."""

    chat: bool
    prompt_ids: list[int]
    generation: dict
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    request_id: str = ""
    created: int = 0
    model: str = ""


def _number(body, name, low, high, default, *, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"`{name}` must be a finite number, got {value!r}.", name)
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ProtocolError(f"`{name}` must lie in {bracket}{low}, {high}], got {value}.", name)
    return float(value)


def _integer(body, name, default, low=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"`{name}` must be an integer, got {type(value).__name__}.", name)
    if low is not None and value < low:
        raise ProtocolError(f"`{name}` must be >= {low}, got {value}.", name)
    return value


def _boolean(body, name, default=False):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"`{name}` must be true or false, got {type(value).__name__}.", name)
    return value


def _sampling(body) -> str:
    """`dspark_sampling`: "coupled" (the default, also for null) or "standard"."""
    value = body.get("dspark_sampling")
    if value is None:
        return "coupled"
    if not isinstance(value, str) or value not in SAMPLING_MODES:
        modes = " or ".join(f'"{mode}"' for mode in SAMPLING_MODES)
        raise ProtocolError(
            f'`dspark_sampling` must be {modes}, got {value!r:.60}; leave it out for the default, "coupled".',
            "dspark_sampling",
        )
    return value


def _text(value: str, param: str) -> str:
    """`value`, refused if it holds a lone UTF-16 surrogate: JSON can spell one (`"\\ud800"`), but it is no text, so
    no tokenizer can encode it and no generated text can contain it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ProtocolError(
            f"`{param}` is not valid Unicode text: it holds a lone UTF-16 surrogate ({value[err.start]!r} at "
            f"character {err.start}); send text as UTF-8, with surrogates only in pairs.",
            param,
        ) from None
    return value


def _check_fields(body: dict, chat: bool) -> None:
    unsupported = {**_UNSUPPORTED_COMMON, **(_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION)}
    known = _COMMON | (_CHAT if chat else {"prompt"}) | set(unsupported)
    for name in body:
        if name not in known:
            raise ProtocolError(f"Unrecognized request argument supplied: `{name}`.", name)
    for name, allowed in unsupported.items():
        if name in body and body[name] not in allowed and body[name] not in ({}, []):
            raise ProtocolError(f"`{name}` is not supported by this server; leave it out.", name)
    n = _integer(body, "n", 1)
    if n != 1:
        raise ProtocolError(f"`n` must be 1 (this server returns one choice per request), got {n}.", "n")


def _stop_sequences(body) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError("`stop` must be a non-empty string or a list of non-empty strings.", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ProtocolError(f"`stop` holds at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}.", "stop")
    return [_text(s, "stop") for s in stops]


def _generation(body: dict, prompt_len: int, limits: ServingLimits, default_max_tokens: int | None) -> dict:
    """`Engine.add_request` keyword arguments; `max_tokens` is clipped to what the context window leaves."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise ProtocolError(
            f"The prompt is {prompt_len} tokens; this model's context holds {limits.max_model_len} tokens "
            "(prompt and completion together). Shorten the prompt.",
            "messages" if "messages" in body else "prompt",
        )
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, default_max_tokens, low=1)
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_k = _integer(body, "top_k", 0, low=-1)
    return {
        "max_new_tokens": room if max_tokens is None else min(max_tokens, room),
        "do_sample": temperature > 0,
        "temperature": temperature if temperature > 0 else 1.0,
        "top_p": _number(body, "top_p", 0.0, 1.0, 1.0, low_open=True),
        "top_k": max(top_k, 0),  # -1 (vLLM's "off") and 0 both disable top-k
        "seed": _integer(body, "seed", None),
        "sampling": _sampling(body),
    }


def _prompt_ids(prompt, vocab_size: int, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = encode(tokenizer, {"prompt": _text(prompt, "prompt")})[0].tolist()
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ProtocolError(f"`prompt` token id {bad[0]} is outside the vocabulary [0, {vocab_size}).", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ProtocolError("`prompt` must be one prompt (a string or a list of token ids), not a batch.", "prompt")
    else:
        raise ProtocolError("`prompt` must be a string or a list of token ids.", "prompt")
    if not ids:
        raise ProtocolError("`prompt` is empty: it encodes to no tokens.", "prompt")
    return ids


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("`messages` must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ProtocolError(f"`{where}` needs a `role`, one of {list(_ROLES)}.", where)
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ProtocolError(f"`{where}.content[{j}]` must be a text part.", f"{where}.content[{j}]")
                _text(part["text"], f"{where}.content[{j}]")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ProtocolError(f"`{where}.content` must be a string or a list of text parts.", f"{where}.content")
        _text(content, f"{where}.content")
        out.append({"role": message["role"], "content": content})
    return out


def _common(body, chat: bool, limits: ServingLimits) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"The request body must be a JSON object, got {type(body).__name__}.")
    _check_fields(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("`model` must be a string.", "model")
    if model not in (None, "", limits.model_name):
        raise ProtocolError(
            f"The model `{model}` does not exist; this server serves `{limits.model_name}`.",
            "model",
            404,
            "model_not_found",
        )
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise ProtocolError("`stream_options` must be an object and needs `stream: true`.", "stream_options")
    include_usage = _boolean(options or {}, "include_usage")
    return {"stream": stream, "include_usage": include_usage, "stop": _stop_sequences(body)}


def parse_completion(body, tokenizer, limits: ServingLimits) -> ParsedRequest:
    """Validate a `/v1/completions` body (OpenAI's defaults: `max_tokens` 16, `temperature` 1)."""
    common = _common(body, False, limits)
    if "prompt" not in body:
        raise ProtocolError("`prompt` is required.", "prompt")
    ids = _prompt_ids(body["prompt"], limits.vocab_size, tokenizer)
    generation = _generation(body, len(ids), limits, default_max_tokens=16)
    return ParsedRequest(False, ids, generation, request_id=f"cmpl-{uuid.uuid4().hex}", **_stamp(limits), **common)


def parse_chat(body, tokenizer, limits: ServingLimits) -> ParsedRequest:
    """Validate a `/v1/chat/completions` body; the prompt is the tokenizer's chat template with a generation prompt."""
    common = _common(body, True, limits)
    if "messages" not in body:
        raise ProtocolError("`messages` is required.", "messages")
    messages = _messages(body["messages"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise ProtocolError("This model's tokenizer has no chat template; use /v1/completions.", "messages")
    ids = encode(tokenizer, {"messages": messages})[0].tolist()
    generation = _generation(body, len(ids), limits, default_max_tokens=None)
    return ParsedRequest(True, ids, generation, request_id=f"chatcmpl-{uuid.uuid4().hex}", **_stamp(limits), **common)


def _stamp(limits: ServingLimits) -> dict:
    return {"created": int(time.time()), "model": limits.model_name}


def _head(req: ParsedRequest, chunk: bool) -> dict:
    kind = ("chat.completion" if req.chat else "text_completion") + (".chunk" if chunk and req.chat else "")
    return {"id": req.request_id, "object": kind, "created": req.created, "model": req.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(req: ParsedRequest, text: str, finish_reason: str, usage_: dict, dspark: dict) -> dict:
    """The non-streaming response object."""
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    return {
        **_head(req, False),
        "choices": [{**choice, "finish_reason": finish_reason}],
        "usage": usage_,
        "dspark": dspark,
    }


def chunk(req: ParsedRequest, text: str | None, finish_reason: str | None = None, dspark: dict | None = None) -> dict:
    """One streamed chunk. For chat, `text=None` opens the stream (the role delta); the last chunk carries the finish
    reason and the `dspark` statistics."""
    if req.chat:
        if text is None:
            delta = {"role": "assistant", "content": ""}
        else:
            delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out = {**_head(req, True), "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    if dspark is not None:
        out["dspark"] = dspark
    return out


def usage_chunk(req: ParsedRequest, usage_: dict) -> dict:
    """The extra last chunk sent when `stream_options.include_usage` is set: no choices, only usage."""
    return {**_head(req, True), "choices": [], "usage": usage_}


def models_response(limits: ServingLimits, created: int) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": limits.model_name,
                "object": "model",
                "created": created,
                "owned_by": "dspark-hf",
                "max_model_len": limits.max_model_len,
            }
        ],
    }


__all__ = ["ParsedRequest", "ProtocolError", "ServingLimits", "parse_chat", "parse_completion"]
