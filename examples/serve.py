"""Serve the embedded pair over an OpenAI-compatible HTTP API, then call it as a client would.

Usage:
    python examples/serve.py                  # start a server on a free port, send two requests, stop
    python examples/serve.py --port 8000 --forever   # keep serving (Ctrl-C stops); as `dspark-hf serve`

Endpoints: /v1/completions, /v1/chat/completions (with "stream": true), /v1/models, /health. The client below uses
the `openai` package when it is installed and the standard library (urllib) otherwise.
"""

import argparse
import json
import urllib.request

import dspark_hf
from dspark_hf.serving.server import DSparkServer


def ask_with_openai(url, question):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")  # a server started without an API key accepts any
    messages = [{"role": "user", "content": question}]
    # temperature 0 is greedy; the server, like OpenAI's, samples at temperature 1 when none is given
    reply = client.chat.completions.create(model="dspark-hf", messages=messages, max_tokens=48, temperature=0)
    print(reply.choices[0].message.content)
    stream = client.chat.completions.create(  # sampled and streamed: chunks arrive as rounds commit tokens
        model="dspark-hf", messages=messages, max_tokens=48, temperature=0.7, seed=0, stream=True
    )
    print("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))


def ask_with_urllib(url, question):
    messages = [{"role": "user", "content": question}]
    body = {"model": "dspark-hf", "messages": messages, "max_tokens": 48, "temperature": 0}  # 0: greedy
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as response:
        print(json.load(response)["choices"][0]["message"]["content"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--forever", action="store_true", help="serve until Ctrl-C instead of sending two requests")
    parser.add_argument("--question", default="What is the capital of France?")
    args = parser.parse_args(argv)

    target, tokenizer, drafter = dspark_hf.load_default()
    engine = dspark_hf.Engine(target, drafter, tokenizer=tokenizer, max_batch_size=8)
    server = DSparkServer(engine, tokenizer, port=args.port, model_name="dspark-hf")
    if args.forever:
        print(f"serving on {server.url}")
        server.serve_forever()
        return
    server.start()  # the engine loop and the HTTP server, in background threads
    try:
        try:
            ask_with_openai(server.url, args.question)
        except ImportError:
            ask_with_urllib(server.url, args.question)
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
