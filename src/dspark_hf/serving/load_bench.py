"""Closed-loop load benchmark over loopback HTTP: per-user speed against aggregate throughput (DSpark's Fig. 7).

For each configuration (`plain` decoding, `fixed` γ = the drafter's block, `fixed:K` γ = K drafts of that block,
`scheduled` = Algorithm 1 with the draft gate, `scheduled:ungated` = Algorithm 1 drafting every round) an in-process
`DSparkServer` is started on a free port, and for each concurrency C, C clients send streaming requests back to back
(closed loop: a client sends its next request as soon as the previous one ends) for `requests_per_client` requests
each. Per request: tokens from `usage`, time to first token, decode speed `(n - 1) / (t_last - t_first)` and the
server-reported mean verify length. Per point: the mean per-user decode speed and the aggregate rate
`Σ tokens / (end of the last request − start)`.
"""

import http.client
import json
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from tqdm.auto import tqdm
from transformers.utils import logging

from ..utils.files import atomic_write_json


logger = logging.get_logger(__name__)

CONFIGURATIONS = {"plain": None, "fixed": "fixed", "scheduled": "scheduler"}  # name -> Engine verify_policy
MATCHED_GAIN_TARGET = 0.30
BUILTIN_PROMPTS = [
    {"messages": [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]},
    {"messages": [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]},
    {"messages": [{"role": "user", "content": "What is 17 times 23? Show your working."}]},
    {"messages": [{"role": "user", "content": "Give me three tips for writing clear documentation."}]},
    {"messages": [{"role": "user", "content": "Summarise the plot of Romeo and Juliet in one paragraph."}]},
    {"messages": [{"role": "user", "content": "List the planets of the solar system in order from the sun."}]},
    {"messages": [{"role": "user", "content": "How does a hash table work? Keep it short."}]},
    {"messages": [{"role": "user", "content": "Write a haiku about autumn leaves."}]},
]


def parse_configuration(name: str, block_size: int | None) -> dict:
    """`plain` | `fixed` | `fixed:K` | `scheduled` | `scheduled:ungated` -> `Engine` keyword arguments
    (verify_policy, num_assistant_tokens, gate_drafts)."""
    base, _, option = name.partition(":")
    known = {"plain": ("",), "scheduled": ("", "ungated")}.get(base)
    if base not in CONFIGURATIONS or (known is not None and option not in known):
        raise ValueError(
            f"Unknown load-benchmark configuration {name!r}; choose from {list(CONFIGURATIONS)}, fixed:K "
            "(K drafts per round, e.g. fixed:2) or scheduled:ungated (Algorithm 1 drafting every round)."
        )
    settings = {"verify_policy": CONFIGURATIONS[base], "num_assistant_tokens": None, "gate_drafts": None}
    if base == "scheduled":
        settings["gate_drafts"] = option != "ungated"
    elif option:
        if not option.isdigit() or not 1 <= int(option) <= (block_size or 0):
            raise ValueError(f"{name!r}: K must be an int in 1..{block_size} (the drafter's block size).")
        settings["num_assistant_tokens"] = int(option)
    return settings


def request_payload(record: dict, max_tokens: int) -> tuple[str, dict]:
    """(endpoint, streaming greedy body) for a prompt record (`prompt`, `messages` or `turns`, as `bench`)."""
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if "prompt" in record:
        return "/v1/completions", {**body, "prompt": record["prompt"]}
    messages = record.get("messages") or [{"role": "user", "content": record["turns"][0]}]
    return "/v1/chat/completions", {**body, "messages": messages}


def timed_request(conn: http.client.HTTPConnection, record: dict, max_tokens: int) -> dict:
    """Send one streaming request on `conn` (kept alive) and time its tokens; with the API key of a server started
    with `--api-key` in `DSPARK_API_KEY`."""
    from .server import api_key_from_env

    path, body = request_payload(record, max_tokens)
    headers = {"Content-Type": "application/json"}
    if api_key_from_env() is not None:
        headers["Authorization"] = f"Bearer {api_key_from_env()}"
    start = time.perf_counter()
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{path} answered {resp.status}: {resp.read().decode(errors='replace')}")
    first = last = None
    usage, dspark = None, {}
    while line := resp.readline():
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"{path} failed mid-stream: {event['error']['message']}")
        usage, dspark = event.get("usage") or usage, event.get("dspark") or dspark
        choice = event["choices"][0] if event["choices"] else {}
        if choice.get("text") or choice.get("delta", {}).get("content"):
            last = time.perf_counter()
            first = first or last
    resp.read()  # drain the chunked terminator so the connection can be reused
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    decode = (n - 1) / (last - first) if first is not None and last > first and n > 1 else None
    return {
        "completion_tokens": n,
        "ttft_s": None if first is None else first - start,
        "latency_s": end - start,
        "decode_tok_s": decode,
        "mean_verify_length": dspark.get("mean_verify_length"),
        "rounds": dspark.get("rounds"),
        "start": start,
        "end": end,
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def run_point(url: str, records: list[dict], concurrency: int, requests_per_client: int, max_tokens: int) -> dict:
    """C closed-loop clients against `url`; client i sends prompts i, i + C, i + 2C, ... (cycling)."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    results, errors = [[] for _ in range(concurrency)], []
    barrier = threading.Barrier(concurrency + 1)

    def client(i):
        conn = http.client.HTTPConnection(host, port, timeout=600)
        barrier.wait()
        try:
            for j in range(requests_per_client):
                record = records[(i + j * concurrency) % len(records)]
                results[i].append(timed_request(conn, record, max_tokens))
        except Exception as err:  # reported after all clients finished
            errors.append(err)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    requests = [r for rs in results for r in rs]
    tokens = sum(r["completion_tokens"] for r in requests)
    elapsed = max(r["end"] for r in requests) - start
    return {
        "concurrency": concurrency,
        "num_requests": len(requests),
        "completion_tokens": tokens,
        "seconds": elapsed,
        "aggregate_tok_s": tokens / elapsed,
        "per_user_tok_s": _mean(r["decode_tok_s"] for r in requests),
        "per_user_e2e_tok_s": _mean(r["completion_tokens"] / r["latency_s"] for r in requests),
        "mean_ttft_s": _mean(r["ttft_s"] for r in requests),
        "mean_verify_length": _mean(r["mean_verify_length"] for r in requests),
        "tokens_per_round": _mean(r["completion_tokens"] / r["rounds"] for r in requests if r["rounds"]),
    }


def run_curve(url, records, concurrencies, requests_per_client=2, max_tokens=64, progress=True) -> list[dict]:
    """One warm-up request, then one `run_point` per concurrency."""
    run_point(url, records[:1], 1, 1, min(max_tokens, 8))
    points = []
    for c in tqdm(concurrencies, desc=f"load {url}", disable=not progress):
        points.append(run_point(url, records, c, requests_per_client, max_tokens))
        logger.info(f"C={c}: {points[-1]['per_user_tok_s']} tok/s/user, {points[-1]['aggregate_tok_s']} tok/s")
    return points


def run_load_benchmark(
    target,
    tokenizer,
    drafter,
    records=None,
    concurrencies=(1, 2, 4, 8, 16),
    configurations=("plain", "fixed", "scheduled"),
    requests_per_client: int = 2,
    max_tokens: int = 64,
    model_name: str = "dspark-hf",
    progress: bool = True,
) -> dict:
    """Serve `target` once per configuration on a free loopback port and measure a load curve for each."""
    from .engine import Engine
    from .server import DSparkServer

    block_size = drafter.config.block_size if drafter is not None else None
    settings = {name: parse_configuration(name, block_size) for name in configurations}  # all checked up front
    records = records or BUILTIN_PROMPTS
    curves = {}
    for name, engine_kwargs in settings.items():
        uses_drafter = engine_kwargs["verify_policy"] is not None
        engine = Engine(
            target, drafter if uses_drafter else None, tokenizer=tokenizer, max_batch_size=max(concurrencies),
            **engine_kwargs,
        )  # fmt: skip
        with DSparkServer(engine, tokenizer, port=0, model_name=model_name) as server:
            curves[name] = run_curve(server.url, records, concurrencies, requests_per_client, max_tokens, progress)
    return {
        "concurrencies": list(concurrencies),
        "requests_per_client": requests_per_client,
        "max_tokens": max_tokens,
        "num_prompts": len(records),
        "block_size": block_size,
        "untrained_drafter": bool(getattr(drafter, "is_untrained", False)),
        "labels": {name: _label(name, drafter) for name in configurations},
        "curves": curves,
        "targets": compare_curves(curves),
    }


def _label(name: str, drafter) -> str:
    if name.startswith("fixed"):
        return f"fixed γ={name.partition(':')[2] or drafter.config.block_size}"
    return {"scheduled": "scheduled (Algorithm 1 + draft gate)", "scheduled:ungated": "scheduled (Algorithm 1)"}.get(
        name, name
    )


def _interpolate(points: list[dict], aggregate: float) -> float | None:
    """Per-user speed of a curve at `aggregate` throughput (linear between its points; None outside them)."""
    pts = sorted((p["aggregate_tok_s"], p["per_user_tok_s"]) for p in points if p["per_user_tok_s"] is not None)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= aggregate <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (aggregate - x0) / (x1 - x0)
    return pts[0][1] if len(pts) == 1 and pts[0][0] == aggregate else None


def compare_curves(curves: dict) -> dict:
    """The load-benchmark targets, against the best fixed γ (curves `fixed` and `fixed:K`): scheduled per-user speed
    at batch 1, and at matched throughput (the upper envelope of the fixed curves at the same aggregate tok/s,
    wherever the scheduled curve and at least one fixed curve both reach)."""
    fixed = {name: pts for name, pts in curves.items() if name.partition(":")[0] == "fixed"}
    if "scheduled" not in curves or not fixed:
        return {}
    sched = curves["scheduled"]

    def at_one(pts):
        return next((p["per_user_tok_s"] for p in pts if p["concurrency"] == 1), None)

    fixed_at_one = {name: at_one(pts) for name, pts in fixed.items()}
    known = {name: v for name, v in fixed_at_one.items() if v is not None}
    best_fixed = max(known, key=known.get) if known else None
    # Both curves are piecewise linear, so the ratio is extreme at a point of one of them: compare at every
    # measured throughput of either where both are defined (interpolating the other)
    throughputs = sorted({p["aggregate_tok_s"] for pts in (sched, *fixed.values()) for p in pts})
    gains = []
    for aggregate in throughputs:
        ours = _interpolate(sched, aggregate)
        matched = {name: _interpolate(pts, aggregate) for name, pts in fixed.items()}
        matched = {name: v for name, v in matched.items() if v}
        if matched and ours is not None:
            name = max(matched, key=matched.get)
            gains.append({"aggregate_tok_s": aggregate, "gain": ours / matched[name] - 1, "vs": name})
    best = max(gains, key=lambda g: g["gain"], default=None)
    sched_one = at_one(sched)
    ok_one = None if sched_one is None or best_fixed is None else sched_one >= known[best_fixed]
    return {
        "batch1_per_user_tok_s": {"scheduled": sched_one, **fixed_at_one},
        "batch1_best_fixed": best_fixed,
        "batch1_scheduled_ge_fixed": ok_one,
        "matched_throughput_gains": gains,
        "best_matched_gain": None if best is None else best["gain"],
        "matched_gain_ge_30pct": None if best is None else best["gain"] >= MATCHED_GAIN_TARGET,
    }


def plot_load(result: dict, png_path: str | Path) -> Path:
    """Per-user decode speed against aggregate throughput, one line per configuration, points labelled by C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for name, points in result["curves"].items():
        pts = [p for p in points if p["per_user_tok_s"] is not None]
        xs, ys = [p["aggregate_tok_s"] for p in pts], [p["per_user_tok_s"] for p in pts]
        ax.plot(xs, ys, marker="o", label=result.get("labels", {}).get(name, name))
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(f"C={p['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("aggregate throughput (tok/s)")
    ax.set_ylabel("per-user decode speed (tok/s/user)")
    title = "DSpark load benchmark" + (" (untrained drafter)" if result.get("untrained_drafter") else "")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(png_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_load_summary(result: dict) -> str:
    header = f"{'config':<10} {'C':>3} {'tok/s/user':>10} {'aggregate':>10} {'TTFT s':>7} {'verify':>7} {'tok/rnd':>7}"
    lines = [header]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for name, points in result["curves"].items():
        for p in points:
            lines.append(
                f"{name:<10} {p['concurrency']:>3} {fmt(p['per_user_tok_s'], '10.1f')} "
                f"{p['aggregate_tok_s']:>10.1f} {fmt(p['mean_ttft_s'], '7.3f')} "
                f"{fmt(p['mean_verify_length'], '7.2f')} {fmt(p['tokens_per_round'], '7.2f')}"
            )
    t = result.get("targets") or {}
    if t:
        gain = t["best_matched_gain"]
        lines.append(
            f"batch 1: scheduled >= best fixed ({t['batch1_best_fixed']}): {t['batch1_scheduled_ge_fixed']}   "
            f"best per-user gain at matched "
            f"throughput: {'-' if gain is None else f'{100 * gain:+.0f}%'} (target +30%: {t['matched_gain_ge_30pct']})"
        )
    return "\n".join(lines)


def write_load_result(result: dict, json_path=None, png_path=None) -> None:
    if json_path:
        atomic_write_json(result, json_path)
    if png_path:
        plot_load(result, png_path)


__all__ = [
    "BUILTIN_PROMPTS",
    "compare_curves",
    "parse_configuration",
    "plot_load",
    "run_curve",
    "run_load_benchmark",
    "run_point",
]
