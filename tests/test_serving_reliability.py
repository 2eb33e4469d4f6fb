"""The server under careless and hostile clients: abandoned non-streamed requests free their slot, an API key guards
every endpoint, and an exposed address without a key is warned about."""

import importlib.util
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest
from transformers.testing_utils import CaptureLogger

from clocks import HANG_S
from conftest import make_drafter, make_target
from dspark_hf import Engine
from dspark_hf.serving import server as serving
from dspark_hf.serving.server import DSparkServer, is_loopback
from helpers import char_tokenizer


KEY = "s3cret-key"


@pytest.fixture(scope="module")
def models():
    target = make_target()
    tokenizer = char_tokenizer(99)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}>"
    return target, make_drafter(target), tokenizer


def start_server(models, wrap_step=None, **server_kwargs):
    """A one-slot server (port 0), its engine's `step` replaced by `wrap_step(step)` when given; returns (server,
    requests), `requests` every engine request in the order made."""
    target, drafter, tokenizer = models
    engine = Engine(target, drafter, tokenizer=tokenizer, max_batch_size=1)
    requests, add_request = [], engine.add_request

    def recording_add_request(*args, **kwargs):
        requests.append(add_request(*args, **kwargs))
        return requests[-1]

    engine.add_request = recording_add_request
    if wrap_step is not None:
        engine.step = wrap_step(engine.step)
    return DSparkServer(engine, tokenizer, port=0, model_name="tiny", **server_kwargs).start(), requests


def call(server, method, path, body=None, key=None):
    """(status, JSON body, headers) of one request, with `Authorization: Bearer key` when `key` is given."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


def test_an_abandoned_non_streamed_request_is_aborted_and_frees_its_slot(models):
    """One slot; a 250-token request whose engine is held still after its first round (so, whatever the machine's
    load, it cannot finish by itself). Its client leaves; the server's watcher aborts it (no round runs in between),
    and a 3-token request made then is served in its own few rounds, not queued behind the abandoned one's ~250
    tokens. Nothing is timed: the waits are hang guards."""
    started, aborted, release, rounds = threading.Event(), threading.Event(), threading.Event(), []

    def held(step):
        def held_step():
            finished = step()
            rounds.append([r.request_id for r in requests if not r.finished])
            if requests and requests[0].output_ids and not release.is_set():
                started.set()  # the abandoned request has its first tokens: no more rounds until the test says so
                release.wait(HANG_S)
            return finished

        return held_step

    server, requests = start_server(models, wrap_step=held)
    abort = server.engine.abort
    server.engine.abort = lambda request_id: [abort(request_id), aborted.set()][0]
    try:
        body = json.dumps({"prompt": "go", "max_tokens": 250, "temperature": 0}).encode()
        client = socket.create_connection((server.host, server.port), timeout=HANG_S)
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert started.wait(HANG_S), "the request never produced its first tokens"
        abandoned = requests[0]
        ran = len(abandoned.output_ids)
        assert 0 < ran < 250 and not abandoned.finished  # running, held between rounds
        client.close()
        assert aborted.wait(HANG_S), "the client left, but its request was never aborted"
        release.set()
        assert abandoned.wait(timeout=HANG_S) is not None and abandoned.finished
        assert abandoned.finish_reason == "abort" and len(abandoned.output_ids) == ran  # not one round more
        before = len(rounds)
        status, reply, _ = call(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200 and reply["usage"]["completion_tokens"] == 3
        assert len(requests) == 2 and requests[1].finish_reason == "length"
        assert len(rounds) - before <= 6  # admit + at most 3 rounds + retire, not the abandoned one's ~250 tokens
    finally:
        release.set()
        server.shutdown()


@pytest.fixture(scope="module")
def keyed(models):
    server, _ = start_server(models, api_key=KEY)
    yield server
    server.shutdown()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("GET", "/nowhere", None),
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ],
)
def test_every_endpoint_requires_the_key(keyed, method, path, body):
    for key in (None, "wrong", KEY[:-1], KEY + "x", ""):
        status, reply, headers = call(keyed, method, path, body, key=key)
        assert status == 401, (key, status)
        assert reply["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in reply["error"]["message"]
        assert headers["WWW-Authenticate"] == "Bearer"
    status, _, _ = call(keyed, method, path, body, key=KEY)
    assert status == (404 if path == "/nowhere" else 200)


def test_the_openai_client_works_with_the_key(keyed, models):
    if importlib.util.find_spec("openai") is None:
        pytest.skip("needs the `openai` package (pip install openai)")
    import openai

    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
    status, reply, _ = call(
        keyed, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 6, "temperature": 0}, key=KEY
    )
    assert status == 200 and completion.choices[0].text == reply["choices"][0]["text"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_an_exposed_address_without_a_key_is_warned_about(models):
    target, _, tokenizer = models
    engine = Engine(target, None, tokenizer=tokenizer)
    for host, key, warned in [("0.0.0.0", None, True), ("0.0.0.0", KEY, False), ("127.0.0.1", None, False)]:
        with CaptureLogger(serving.logger) as captured:
            DSparkServer(engine, tokenizer, host=host, port=0, api_key=key).httpd.server_close()
        assert ("WITHOUT an API key" in captured.out) == warned, (host, key)
    with pytest.raises(ValueError, match="0..65535"):
        DSparkServer(engine, tokenizer, port=99999)
    with pytest.raises(ValueError, match="api_key"):
        DSparkServer(engine, tokenizer, port=0, api_key=" ")


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("::")
