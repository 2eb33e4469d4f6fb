"""An OpenAI-compatible HTTP server over a `dspark_hf.Engine`: `/v1/completions`, `/v1/chat/completions` (both with
Server-Sent-Events streaming), `/v1/models` and `/health`, on the standard library's `ThreadingHTTPServer`.

    server = DSparkServer(Engine(target, drafter, tokenizer=tok), tok, port=8000).start()   # background threads
    ...                                                                                    # any OpenAI client
    server.shutdown()

Each HTTP connection gets a thread; the engine batches all live requests in its own background loop. Tokens are
detokenised incrementally (a multi-byte character split across tokens is held back until complete) and `stop`
sequences are cut on the text, so a stream never shows a partial stop sequence. Bad requests get a 4xx with
OpenAI's `{"error": {...}}` body naming the field; a client that disconnects, mid-stream or while waiting for a
non-streamed reply, has its request aborted (its engine slot freed within `DISCONNECT_POLL_S` seconds).

With `api_key`, every endpoint requires `Authorization: Bearer <key>` (compared in constant time; 401 otherwise).
Bound to an address other than loopback without a key, the server warns that anyone who reaches it can use it.
"""

import hmac
import ipaddress
import json
import os
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from transformers.utils import logging

from ..models.settings import check_sampling
from . import openai_protocol as protocol
from .openai_protocol import ProtocolError, ServingLimits


logger = logging.get_logger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still connected
API_KEY_ENV = "DSPARK_API_KEY"
_DISCONNECTED = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
_PARSERS = {"/v1/completions": protocol.parse_completion, "/v1/chat/completions": protocol.parse_chat}


class IncrementalDetokenizer:
    """Token ids arriving in chunks -> text deltas whose concatenation is the decoded text.

    Each push decodes a short window starting a little before the new tokens, so tokenizers whose pieces decode
    differently at the start of a string (SentencePiece's leading space) stay consistent, and holds the delta back
    while it ends in U+FFFD (a UTF-8 character whose bytes are split across tokens).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0  # window start; end of the tokens already turned into text

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix) :]

    def push(self, ids) -> str:
        self.ids.extend(int(t) for t in ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        return self._delta(final=True) if self.read_offset < len(self.ids) else ""


class TextStream:
    """Detokenised text with `stop` sequences cut: `push(ids)` and `finish()` return the text safe to show.

    The last `max(len(stop)) - 1` characters stay held back until more text proves they do not begin a stop
    sequence; so any stop sequence completed by a push starts at or after the text already released.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.sent, self.num_tokens, self.stopped = "", 0, 0, False

    def push(self, ids) -> str:
        self.num_tokens += len(ids)
        self.text += self.detokenizer.push(ids)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self.text += self.detokenizer.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            self.stopped, end = True, min(hits)
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta


class _Completion:
    """One engine request seen as text: iterate `deltas()`, then read `finish_reason`, `usage()`, `dspark_stats()`."""

    def __init__(self, engine, tokenizer, parsed: protocol.ParsedRequest):
        self.engine, self.parsed = engine, parsed
        _check_sampling(engine, parsed.generation)
        try:
            self.request = engine.add_request(parsed.prompt_ids, **parsed.generation)
        except (ValueError, TypeError) as err:
            raise ProtocolError(str(err)) from err
        self.text = TextStream(tokenizer, parsed.stop)
        self.finish_reason = None

    def deltas(self):
        try:
            for ids in self.request.stream():
                delta = self.text.push(ids)
                if delta:
                    yield delta
                if self.text.stopped:
                    break
            tail = self.text.finish()
            if tail:
                yield tail
            engine_reason = self.request.finish_reason
            self.finish_reason = "length" if engine_reason == "length" and not self.text.stopped else "stop"
        finally:  # stop sequence hit, client gone or an error: free the engine's slot
            if not self.request.finished:
                self.engine.abort(self.request.request_id)

    def usage(self) -> dict:
        return protocol.usage(len(self.parsed.prompt_ids), self.text.num_tokens)

    def dspark_stats(self) -> dict:
        lengths = list(self.request.verify_lengths)
        return {
            "rounds": self.request.num_rounds,
            "mean_verify_length": sum(lengths) / len(lengths) if lengths else 0.0,
        }


def _check_sampling(engine, generation: dict) -> None:
    """A 400 for `dspark_sampling: "standard"` on a sampled request while the engine's drafter drafts trees. The
    engine would refuse it too, but with a fix for the server's operator (a drafter setting); the client needs its
    own."""
    try:
        check_sampling(generation["sampling"], engine.tree_budget, generation["do_sample"])
    except ValueError:
        raise ProtocolError(
            '`dspark_sampling: "standard"` is not available on this server: its drafter verifies token trees '
            f"(tree_budget {engine.tree_budget}) and standard sampling verifies chains only. Leave `dspark_sampling` "
            'out (or send "coupled"), or send `temperature: 0` for greedy decoding.',
            "dspark_sampling",
        ) from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for JSON replies; streams use chunked transfer encoding
    server_version = "dspark-hf"

    def log_message(self, format, *args):  # noqa: A002 (BaseHTTPRequestHandler's signature)
        logger.info(f"{self.address_string()} {format % args}")

    @property
    def app(self) -> "DSparkServer":
        return self.server.app

    def _send_json(self, status: int, obj: dict, close: bool = False) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: ProtocolError, close: bool = False) -> None:
        self._send_json(err.status, err.to_dict(), close=close)

    def _authorized(self) -> bool:
        """With an API key: whether the request carries `Authorization: Bearer <key>`; a 401 is sent if not."""
        key = self.app.api_key
        if key is None:
            return True
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
            return True
        err = ProtocolError(
            "Missing or wrong API key: send the header `Authorization: Bearer <key>` (the server's --api-key).",
            status=401,
            code="invalid_api_key",
        )
        data = json.dumps(err.to_dict()).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Connection", "close")  # an unread request body would garble the next request
        self.close_connection = True
        self.end_headers()
        self.wfile.write(data)
        return False

    def do_GET(self):
        if not self._authorized():
            return
        path = urlsplit(self.path).path.rstrip("/")
        if path == "/health":
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(200, protocol.models_response(self.app.limits, self.app.created))
        elif path in _PARSERS:
            self._send_error(ProtocolError(f"{path} takes POST requests.", status=405))
        else:
            self._send_error(ProtocolError(f"No such endpoint: {path}.", status=404))

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise ProtocolError("Chunked request bodies are not supported; send a Content-Length.", status=411)
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            raise ProtocolError("A POST request needs a Content-Length header.", status=411)
        if int(length) > MAX_BODY_BYTES:
            raise ProtocolError(f"The request body exceeds {MAX_BODY_BYTES} bytes.", status=413)
        return self.rfile.read(int(length))

    def do_POST(self):
        if not self._authorized():
            return
        try:
            raw = self._read_body()
        except ProtocolError as err:  # the unread body would garble the next request: close the connection
            return self._send_error(err, close=True)
        path = urlsplit(self.path).path.rstrip("/")
        try:
            if path not in _PARSERS:
                raise ProtocolError(f"No such endpoint: {path}.", status=404)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ProtocolError(f"The request body is not valid JSON: {err}.") from err
            with self.app.tokenizer_lock:  # a Rust tokenizer may refuse concurrent calls ("Already borrowed")
                parsed = _PARSERS[path](body, self.app.tokenizer, self.app.limits)
            completion = _Completion(self.app.engine, self.app.tokenizer, parsed)
        except ProtocolError as err:
            return self._send_error(err)
        except Exception as err:  # a bug must cost one request, never the server
            logger.error(f"Request to {path} failed", exc_info=True)
            return self._send_error(ProtocolError(f"Internal error: {err}", status=500))
        if parsed.stream:
            self._stream(parsed, completion)
        else:
            self._respond(parsed, completion)

    def _client_gone(self) -> bool:
        """Whether the client closed or reset its connection (a readable socket with nothing to read). Bytes of a
        pipelined next request are left in place (peeked, not read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except (OSError, ValueError):  # reset, or the socket is already closed
            return True

    def _watch_client(self, completion: _Completion, done: threading.Event, gone: threading.Event) -> None:
        """Abort `completion` (and set `gone`) when its client goes away before the reply is ready (non-streamed
        requests: nothing is written until then, so no failed write can tell)."""
        while not done.wait(DISCONNECT_POLL_S):
            if completion.request.finished:
                return
            if self._client_gone():
                gone.set()
                logger.info(f"Client disconnected; aborted {completion.request.request_id}")
                self.app.engine.abort(completion.request.request_id)
                return

    def _respond(self, parsed, completion: _Completion) -> None:
        done, gone = threading.Event(), threading.Event()
        watcher = threading.Thread(target=self._watch_client, args=(completion, done, gone), daemon=True)
        watcher.start()
        try:
            text = "".join(completion.deltas())
        except Exception as err:
            logger.error("Generation failed", exc_info=True)
            return self._send_error(ProtocolError(f"Generation failed: {err}", status=500))
        finally:
            done.set()
            watcher.join()
        if gone.is_set():  # nobody to answer
            self.close_connection = True
            return
        body = protocol.full_response(
            parsed, text, completion.finish_reason, completion.usage(), completion.dspark_stats()
        )
        try:
            self._send_json(200, body)
        except _DISCONNECTED:
            self.close_connection = True

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _event(self, obj) -> None:
        self._write_chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _stream(self, parsed, completion: _Completion) -> None:
        deltas = completion.deltas()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if parsed.chat:
                self._event(protocol.chunk(parsed, None))
            try:
                for delta in deltas:
                    self._event(protocol.chunk(parsed, delta))
            except _DISCONNECTED:
                raise
            except Exception as err:  # headers are out: report in-band, as OpenAI does
                logger.error("Generation failed mid-stream", exc_info=True)
                self._event(ProtocolError(f"Generation failed: {err}", status=500).to_dict())
            else:
                self._event(protocol.chunk(parsed, "", completion.finish_reason, completion.dspark_stats()))
                if parsed.include_usage:
                    self._event(protocol.usage_chunk(parsed, completion.usage()))
            self._write_chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except _DISCONNECTED:
            logger.info(f"Client disconnected; aborted {completion.request.request_id}")
            self.close_connection = True
        finally:
            deltas.close()  # aborts the engine request if it is still running


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # listen() backlog. socketserver's default of 5 reset connections when 16 clients connected at once while the
    # engine's verify forward kept the accept loop waiting (measured: `bench --serve --concurrency 16`, fixed γ).
    request_queue_size = 256


class DSparkServer:
    """OpenAI-compatible HTTP front end of `engine` (see the module docstring).

    `port=0` picks a free port (read it back from `.port`). `model_name` is the id clients pass as `model`;
    `max_model_len` (prompt + completion tokens; longer `max_tokens` are clipped) and `vocab_size` default to the
    engine's target config. The server starts and stops the engine's background loop.
    """

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str = "dspark-hf",
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        api_key: str | None = None,
    ):
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"`port` must be in 0..65535, got {port}.")
        if api_key is not None and not api_key.strip():
            raise ValueError("`api_key` is empty; pass a non-empty key, or None for no authentication.")
        config = getattr(getattr(engine, "target", None), "config", None)
        max_model_len = max_model_len or getattr(config, "max_position_embeddings", None)
        vocab_size = vocab_size or getattr(config, "vocab_size", None) or len(tokenizer)
        if not max_model_len:
            raise ValueError("DSparkServer needs `max_model_len` (the target's context length in tokens).")
        self.engine, self.tokenizer = engine, tokenizer
        self.tokenizer_lock = threading.Lock()
        self.limits = ServingLimits(model_name, int(max_model_len), int(vocab_size))
        self.created = int(time.time())
        self.api_key = api_key
        self.httpd = _HTTPServer((host, port), _Handler)
        self.httpd.app = self
        self.host, self.port = self.httpd.server_address[:2]
        self._thread = None
        if api_key is None and not is_loopback(host):
            logger.warning(
                f"Serving on {host}, which is not a loopback address, WITHOUT an API key: anyone who can reach "
                f"port {self.port} can use the model. Set --api-key (or {API_KEY_ENV}), or bind to 127.0.0.1."
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "DSparkServer":
        """Start the engine loop and serve in a background thread; returns self."""
        self.engine.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dspark-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (Ctrl-C), then stop the engine."""
        self.engine.start()
        try:
            self.httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.httpd.server_close()
            self.engine.stop()

    def shutdown(self) -> None:
        """Stop accepting requests, close the socket and stop the engine loop."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()
        self.engine.stop()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) reaches only this machine; unresolvable names count as not."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False  # "" binds every interface
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def api_key_from_env() -> str | None:
    """The API key in the `DSPARK_API_KEY` environment variable, if set and not empty."""
    return os.environ.get(API_KEY_ENV, "").strip() or None


__all__ = ["DSparkServer", "IncrementalDetokenizer", "TextStream", "api_key_from_env", "is_loopback"]
