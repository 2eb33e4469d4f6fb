"""What a long prompt costs the target's passes, old code path against new, side by side in one process.

    python benchmarks/time_long_context_cost.py prefill --length 8k [--repeats 2] [--json out.json]
    python benchmarks/time_long_context_cost.py steps --length 8k [--repeats 7] [--json out.json]
    python benchmarks/time_long_context_cost.py generate --length 8k [--new-tokens 64] [--json out.json]
    python benchmarks/time_long_context_cost.py attention --length 8k [--repeats 9] [--json out.json]

`prefill`: one `generate()` of a single new token on the long-context prompt of that length (prompt 0 of
`evaluation.long_context`), plain (transformers alone) and with the shipped drafter, the drafter's run once as it was
(every layer's hidden states kept, `OPTIONS.select_hidden_states = False`; `DynamicCache` layers,
`OPTIONS.in_place_cache = False`) and once as it is; the three interleaved, median of `--repeats`.

`steps`: over the prompt's cache, a plain one-token step as `generate()` takes it and a round's verify of width
1, 2, 4 and 8 as `SpeculativeDecoder._verify` runs it (the 2-D mask, positions, the tapped hidden states, the
attention routed through SDPA's own GQA; transformers' linears), each once with `DynamicCache` layers (a whole-cache
`torch.cat` per layer per forward) and once with `AppendCache` layers (in place), visited round-robin, median of
`--repeats` after one warm-up round. Every forward is cropped back, as a round's rejected slots are. Beside them:
the `torch.cat` of every layer's keys and values alone (a targeted timer), the share of `aten::cat` in a width-2
verify under `torch.profiler`, and whether the two caches' logits are bit-identical.

`generate`: whole `generate()` calls of `--new-tokens` and of 1 token, plain and with the drafter (old and new code
path), and the decoding phase as their difference; whether every output is identical to plain greedy.

`attention`: every layer's verify attention over the prompt's cache for 1-8 queries, through SDPA and through two
matrix products per key/value head (`verify_attention._matmul_attention`), and a 6-token verify's logits both ways.

Target: the embedded SmolLM2-135M-Instruct (float32); 2 threads. Prints the CPU model.
"""

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dspark_hf import load_default
from dspark_hf.decoding import ragged_cache
from dspark_hf.decoding.profiling import cpu_model
from dspark_hf.evaluation.long_context import long_context_prompt, parse_context_lengths
from dspark_hf.kernels import verify_attention
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.verify_attention import routed
from dspark_hf.utils.prompts import encode


WIDTHS = (1, 2, 4, 8)
MAX_PROMPT = 8120  # SmolLM2's 8,192 positions, less room for new tokens (as the long-context bench caps "8k")


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    """(1, L): prompt 0 at `length` tokens, capped to leave the model room for 8 more positions."""
    return encode(tokenizer, long_context_prompt(tokenizer, min(length, MAX_PROMPT), 0))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def round_robin(runs: dict, repeats: int) -> dict:
    """Median ms of each run, visiting them in turn `repeats` times after one warm-up visit."""
    times = {key: [] for key in runs}
    for i in range(repeats + 1):
        for key, run in runs.items():
            elapsed = timed(run)
            if i:
                times[key].append(elapsed)
    return {key: statistics.median(t) for key, t in times.items()}


@contextlib.contextmanager
def old_path(old: bool):
    """The code as it was (every hidden state, concatenating caches) while `old`, restored on exit."""
    saved = OPTIONS.select_hidden_states, OPTIONS.in_place_cache
    OPTIONS.select_hidden_states, OPTIONS.in_place_cache = not old, not old
    try:
        yield
    finally:
        OPTIONS.select_hidden_states, OPTIONS.in_place_cache = saved


@torch.no_grad()
def part_generate(args, target, tokenizer, drafter) -> dict:
    """Whole generate() calls of 1 token (the prefill) and, unless `prefill_only`, of `--new-tokens` per way; the
    decoding phase is their difference."""
    ids = prompt_ids(tokenizer, args.length)
    kwargs = {"do_sample": False}
    ways = {
        "plain": lambda i, n: target.generate(i, attention_mask=torch.ones_like(i), max_new_tokens=n, **kwargs),
        "drafter, old": lambda i, n: _with(old_path(True), target.generate, i, assistant_model=drafter,
                                           max_new_tokens=n, **kwargs),
        "drafter, new": lambda i, n: _with(old_path(False), target.generate, i, assistant_model=drafter,
                                           max_new_tokens=n, **kwargs),
    }  # fmt: skip
    if args.reverse:  # the drafter's ways in the other order (the first one also pays what is measured once)
        ways = {name: ways[name] for name in ("plain", "drafter, new", "drafter, old")}
    for way in ways.values():  # warm-up on a short prompt: kernel choices, profiles
        way(ids[:, -64:], 8)
    if args.warm_up:  # and one drafted generation on the prompt itself: the verify kernels measure as they run
        ways["drafter, new"](ids, args.warm_up)
    counts = (1,) if args.part == "prefill" else (1, args.new_tokens)
    times, outputs = {}, {}
    for repeat in range(args.repeats):
        order = list(ways.items())
        if repeat % 2:  # alternate the drafter's two ways
            order = [order[0]] + order[:0:-1]
        for name, way in order:
            for n in counts:
                start = time.perf_counter()
                outputs[name, n] = way(ids, n)
                times.setdefault((name, n), []).append(1e3 * (time.perf_counter() - start))
    ms = {f"{name}, {n}": statistics.median(t) for (name, n), t in times.items()}
    n = counts[-1]
    result = {
        "prompt_tokens": ids.shape[1],
        "new_tokens": n,
        "ms": ms,
        "all_ms": {f"{name}, {k}": t for (name, k), t in times.items()},
        "identical": all(torch.equal(outputs[name, n], outputs["plain", n]) for name in ways),
    }
    if n > 1:
        result["decode_ms"] = {name: ms[f"{name}, {n}"] - ms[f"{name}, 1"] for name in ways}
        result["prefill_share_plain"] = ms["plain, 1"] / ms[f"plain, {n}"]
    return result


def _with(scope, fn, *args, **kwargs):
    with scope:
        return fn(*args, **kwargs)


@torch.no_grad()
def part_steps(args, target, tokenizer, drafter) -> dict:
    ids = prompt_ids(tokenizer, args.length)
    length = ids.shape[1]
    taps = [i + 1 for i in drafter.config.target_layer_ids]
    dynamic = DynamicCache()
    target(input_ids=ids, cache=dynamic, use_cache=True, logits_to_keep=1)
    layers = [(k, v) for k, v, *_ in dynamic]
    append = ragged_cache.AppendCache([(k.clone(), v.clone()) for k, v in layers])
    caches = {"DynamicCache": dynamic, "AppendCache": append}
    generator = torch.Generator().manual_seed(0)
    new = torch.randint(0, target.config.vocab_size, (1, max(WIDTHS)), generator=generator)
    logits = {}

    def plain(cache):
        def run():
            target(input_ids=new[:, :1], attention_mask=torch.ones(1, length + 1, dtype=torch.long), cache=cache,
                   use_cache=True)  # fmt: skip
            cache.crop(-1)

        return run

    def verify(cache, width, name):
        def run():
            mask = torch.ones(1, length + width, dtype=torch.long)
            positions = torch.arange(length, length + width)[None]
            with routed(target):
                out = target(input_ids=new[:, :width], attention_mask=mask, cache=cache, use_cache=True,
                             position_ids=positions, output_hidden_states=taps)  # fmt: skip
            logits[name, width] = out.logits
            cache.crop(-width)

        return run

    passes = {}
    for name, cache in caches.items():
        passes[f"plain step, {name}"] = plain(cache)
        for width in WIDTHS:
            passes[f"verify {width}, {name}"] = verify(cache, width, name)
    medians = round_robin(passes, args.repeats)
    identical = all(torch.equal(logits["DynamicCache", w], logits["AppendCache", w]) for w in WIDTHS)
    # the copy alone: every layer's keys and values concatenated with 2 new slots, as DynamicLayer.update does
    two = [(k[:, :, :2].clone(), v[:, :, :2].clone()) for k, v in layers]
    cat_ms = statistics.median(
        timed(lambda: [torch.cat([k, n], dim=-2) for (k, _), (n, _) in zip(layers, two)] + [
            torch.cat([v, n], dim=-2) for (_, v), (_, n) in zip(layers, two)])
        for _ in range(args.repeats)
    )  # fmt: skip
    profile = {}
    for name, cache in caches.items():
        run = verify(cache, 2, name)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        events = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        total = sum(events.values())
        profile[name] = {
            "cat_ms": events.get("aten::cat", 0.0) / 1e3,
            "copy_ms": events.get("aten::copy_", 0.0) / 1e3,
            "sdpa_ms": sum(v for k, v in events.items() if "flash_attention" in k or "scaled_dot" in k) / 1e3,
            "total_self_ms": total / 1e3,
        }
    cache_mb = sum(k.numel() * k.element_size() * 2 for k, _ in layers) / 1e6
    return {
        "prompt_tokens": length,
        "ms": medians,
        "logits_identical": identical,
        "cat_every_layer_ms": cat_ms,
        "kv_cache_mb": cache_mb,
        "profile_verify2": profile,
    }


@torch.no_grad()
def part_attention(args, target, tokenizer, drafter) -> dict:
    """Every layer's verify attention over the prompt's real cache, for 1-8 queries, through SDPA (`MATMUL_ROWS = 0`:
    packed or GQA, as before) and through two matrix products per key/value head (`_matmul_attention`), visited
    round-robin, median of `--repeats` (ms for all layers); beside them, a whole verify forward's logits both ways."""
    ids = prompt_ids(tokenizer, args.length)
    length = ids.shape[1]
    cache = DynamicCache()
    target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    layers = [(k, v) for k, v, *_ in cache]
    config, module = target.config, target.model.layers[0].self_attn
    heads, dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    ways = {"sdpa": 0, "matmul": verify_attention.MATMUL_ROWS}
    runs = {}
    for q in (1, 2, 3, 4, 6, 8):
        queries = [torch.randn(1, heads, q, dim, generator=generator) for _ in layers]
        sees = torch.arange(length)[None] <= torch.arange(length - q, length)[:, None]  # the last q: the new ones
        mask = None if q == 1 else sees[None, None]  # a one-token step has no mask (a cache without holes)
        for way, rows in ways.items():

            def run(queries=queries, mask=mask, rows=rows):
                verify_attention.MATMUL_ROWS = rows
                for query, (key, value) in zip(queries, layers):
                    verify_attention.verify_sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)

            runs[f"{q} queries, {way}"] = run
    medians = round_robin(runs, args.repeats)
    new = torch.randint(0, config.vocab_size, (1, 6), generator=generator)
    logits = {}
    for way, rows in ways.items():
        verify_attention.MATMUL_ROWS = rows
        with routed(target):
            logits[way] = target(input_ids=new, attention_mask=torch.ones(1, length + 6, dtype=torch.long),
                                 position_ids=torch.arange(length, length + 6)[None], cache=cache).logits  # fmt: skip
        cache.crop(-6)
    verify_attention.MATMUL_ROWS = ways["matmul"]
    return {
        "prompt_tokens": length,
        "ms": medians,
        "verify6_logits_max_abs_difference": (logits["sdpa"] - logits["matmul"]).abs().max().item(),
        "verify6_argmax_equal": torch.equal(logits["sdpa"].argmax(-1), logits["matmul"].argmax(-1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["prefill", "steps", "generate", "attention"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reverse", action="store_true", help="generate: run the new way before the old one")
    parser.add_argument("--warm-up", type=int, default=0, help="generate: first decode this many tokens drafted")
    parser.add_argument("--length", default="2k")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=None, help="accumulate results in this file (one key per part and length)")
    args = parser.parse_args()
    args.length = parse_context_lengths(args.length)[0]
    if args.repeats is None:
        args.repeats = {"prefill": 2, "steps": 7, "generate": 1, "attention": 9}[args.part]
    torch.set_num_threads(2)
    target, tokenizer, drafter = load_default()
    part = {"steps": part_steps, "attention": part_attention}.get(args.part, part_generate)
    result = part(args, target, tokenizer, drafter)
    result.update(cpu=cpu_model(), threads=torch.get_num_threads(), torch=torch.__version__)
    print(json.dumps({k: v for k, v in result.items() if k != "all_ms"}, indent=1), flush=True)
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else {}
        suffix = " reversed" if args.reverse else ""
        suffix += f" warm {args.warm_up} x{args.repeats}" if args.warm_up else ""
        data[f"{args.part} {args.length}{suffix}"] = result
        path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
