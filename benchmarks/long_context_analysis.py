"""Why speculation pays less on long prompts: measurements on the long-context prompt sets (docs/long_context.md).

Run one part at a time (each takes a few minutes on 2 CPU cores; results accumulate in --out):

    python benchmarks/long_context_analysis.py features   # the target over two 8k prompts: tapped features, argmax
    python benchmarks/long_context_analysis.py accuracy   # teacher-forced draft accuracy by anchor position and window
    python benchmarks/long_context_analysis.py attention  # the block's attention mass by distance from the anchor
    python benchmarks/long_context_analysis.py stats      # the target features' statistics by position
    python benchmarks/long_context_analysis.py kernels    # which SDPA kernel the verify, draft and plain passes get
    python benchmarks/long_context_analysis.py cost       # ms of a plain step, a verify of 8, a draft pass by length
    python benchmarks/long_context_analysis.py rest       # cost and attention in one process
    python benchmarks/long_context_analysis.py routing    # 4k decoding with the verify attention routed or not

Prompts: `evaluation.long_context` (CPython's `logging` documentation and `argparse` source, ~8.1k tokens each).
Target: the embedded SmolLM2-135M-Instruct (float32); drafter: the shipped default (bf16 where the CPU computes it,
as decoding runs it). Teacher-forced accuracy at block position 1: the drafter's greedy token for the anchor's
successor against the target's greedy token there, the block seeing the context before the anchor (all of it, or
the last W positions with a window), exactly what greedy verification accepts at position 1.
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
from dspark_hf.evaluation.long_context import long_context_prompt
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.verify_attention import routed
from dspark_hf.training import block_attention_mask
from dspark_hf.utils.prompts import encode


BUCKETS = [(32, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8100)]
WINDOWS = [None, 2048, 1024, 512, 256, 128]
DISTANCES = [(1, 64), (65, 256), (257, 512), (513, 1024), (1025, 10**6)]
LENGTHS = [256, 1024, 2048, 4096, 8000]
ANCHORS_PER_BUCKET = 100


_MODELS = []


def load(args):
    """(target, tokenizer, drafter), loaded once per process."""
    if not _MODELS:
        torch.set_num_threads(2)
        _MODELS.extend(load_default())
    return tuple(_MODELS)


def cached_features(args):
    path = Path(args.work) / "features.pt"
    return torch.load(path)


def part_features(args):
    target, tokenizer, drafter = load(args)
    out = []
    for index in range(2):
        record = long_context_prompt(tokenizer, 8100, index)
        ids = encode(tokenizer, record)
        start = time.perf_counter()
        with torch.no_grad():
            res = target(input_ids=ids, output_hidden_states=True, logits_to_keep=0)
        taps = [i + 1 for i in drafter.config.target_layer_ids]
        feats = torch.cat([res.hidden_states[i] for i in taps], dim=-1)
        out.append(
            {
                "source": record["source"],
                "ids": ids,
                "features": feats.to(torch.bfloat16),
                "argmax": res.logits.argmax(-1),
                "prefill_s": time.perf_counter() - start,
            }
        )
        print(record["source"], ids.shape, f"prefill {out[-1]['prefill_s']:.1f}s")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    torch.save(out, Path(args.work) / "features.pt")


def anchors_in(bucket, length, seed, count=ANCHORS_PER_BUCKET):
    lo, hi = bucket
    hi = min(hi, length - 8)
    g = torch.Generator().manual_seed(seed)
    return (lo + torch.randperm(hi - lo, generator=g)[:count]).sort().values


@torch.no_grad()
def block_pass(drafter, target, item, anchors, window, eager=False):
    """Teacher-forced block hidden states (N, γ, d) for anchors (N,), under the training mask with `window`."""
    gamma = drafter.config.block_size
    end = int(anchors.max()) + 1
    ids = item["ids"][:, :end]
    feats = item["features"][:, :end]
    noise = drafter.block_input_embeds(ids[:, anchors], target.get_input_embeddings())
    positions = torch.cat([torch.arange(end), (anchors[:, None] + torch.arange(gamma)).flatten()])[None]
    mask = block_attention_mask(end, anchors[None], gamma, window)
    saved = drafter.config._attn_implementation
    if eager:
        drafter.config._attn_implementation = "eager"
    try:
        out = drafter(noise_embeds=noise, context_hidden_states=feats, position_ids=positions, attention_mask=mask)
    finally:
        drafter.config._attn_implementation = saved
    return out.last_hidden_state.view(len(anchors), gamma, -1)


def part_accuracy(args):
    target, tokenizer, drafter = load(args)
    items = cached_features(args)
    lm_head = target.get_output_embeddings()
    table = {}
    for window in WINDOWS:
        row = []
        for b, bucket in enumerate(BUCKETS):
            hits = total = 0
            for item in items:
                anchors = anchors_in(bucket, item["ids"].shape[1], seed=b)
                hidden = block_pass(drafter, target, item, anchors, window)
                logits = drafter.draft_base_logits(hidden[:, :1], lm_head)[:, 0]  # (N, V)
                bias, _ = drafter.draft_sequential_bias(item["ids"][0, anchors][:, None], hidden[:, :1])
                if bias is not None:
                    logits = logits + bias[:, 0]
                hits += int((logits.argmax(-1) == item["argmax"][0, anchors]).sum())
                total += len(anchors)
            row.append(hits / total)
        table[str(window)] = row
        print(f"window {window}: " + " ".join(f"{x:.3f}" for x in row), flush=True)
    save(args, "accuracy", {"buckets": BUCKETS, "anchors": ANCHORS_PER_BUCKET * len(items), "acc1": table})


def part_attention(args):
    target, tokenizer, drafter = load(args)
    items = cached_features(args)
    gamma = drafter.config.block_size
    result = {}
    for window in (None, 512):
        grabbed = []
        hooks = [
            layer.self_attn.register_forward_hook(lambda m, a, o, grabbed=grabbed: grabbed.append(o[1].float()))
            for layer in drafter.layers
        ]
        per_bucket = []
        for b, bucket in enumerate(BUCKETS):
            masses = torch.zeros(len(drafter.layers), len(DISTANCES) + 2)
            for item in items:
                anchors = anchors_in(bucket, item["ids"].shape[1], seed=b, count=30)
                grabbed.clear()
                block_pass(drafter, target, item, anchors, window, eager=True)
                end = int(anchors.max()) + 1
                distance = anchors.repeat_interleave(gamma)[:, None] - torch.arange(end)[None]  # (N·γ, L)
                for layer, weights in enumerate(grabbed):
                    w = weights[0].mean(0)  # (N·γ, L + N·γ), averaged over heads
                    ctx = w[:, :end]
                    for j, (lo, hi) in enumerate(DISTANCES):
                        masses[layer, j] += ((distance >= lo) & (distance <= hi)).float().mul(ctx).sum(1).mean()
                    masses[layer, -2] += w[:, end:].sum(1).mean()  # the block's own slots
                    masses[layer, -1] += ctx[:, 0].mean()  # position 0 alone (an attention sink?)
            per_bucket.append((masses / len(items)).tolist())
        for h in hooks:
            h.remove()
        result[str(window)] = per_bucket
        for b, bucket in enumerate(BUCKETS):
            cells = " | ".join(" ".join(f"{x:.2f}" for x in layer) for layer in per_bucket[b])
            print(f"window {window} anchors {bucket}: {cells}", flush=True)
    columns = [f"distance {lo}-{hi}" for lo, hi in DISTANCES] + ["own block", "position 0"]
    save(args, "attention", {"buckets": BUCKETS, "columns": columns, "by_layer_mass": result})


def part_stats(args):
    target, tokenizer, drafter = load(args)
    items = cached_features(args)
    d = drafter.config.hidden_size
    spans = [(0, 1), (1, 32), *BUCKETS]
    rows = []
    with torch.no_grad():
        for lo, hi in spans:
            feats = torch.cat([item["features"][0, lo:hi].float() for item in items])  # (n, m·d)
            per_layer = feats.view(len(feats), -1, d).norm(dim=-1).mean(0).tolist()
            fused = drafter.fc(feats.to(drafter.fc.weight.dtype)).float()
            normed = drafter.hidden_norm(fused.to(drafter.fc.weight.dtype)).float()
            mean = torch.cat([item["features"][0, 32:].float() for item in items]).mean(0)
            cos = torch.nn.functional.cosine_similarity(feats, mean[None], dim=-1).mean().item()
            k = drafter.layers[0].self_attn.k_proj(normed.to(drafter.fc.weight.dtype)).float()
            rows.append(
                {
                    "positions": [lo, hi],
                    "raw_norm_by_tap": per_layer,
                    "fused_norm": fused.norm(dim=-1).mean().item(),
                    "key_norm_layer0": k.norm(dim=-1).mean().item(),
                    "cosine_to_mean": cos,
                }
            )
            print(
                f"positions {lo}-{hi}: raw norms " + " ".join(f"{x:.1f}" for x in per_layer)
                + f", fused {rows[-1]['fused_norm']:.1f}, layer-0 key {rows[-1]['key_norm_layer0']:.1f}, "
                f"cos to mean {cos:.2f}", flush=True,
            )  # fmt: skip
    save(args, "stats", rows)


def part_kernels(args):
    """Log every SDPA call of a real generate() with the drafter on a 2k prompt and of plain decoding: which pass
    (target verify / target plain step / draft), the mask it got, and the kernel PyTorch picks for it."""
    from torch.nn.attention import SDPBackend

    target, tokenizer, drafter = load(args)
    ids = encode(tokenizer, long_context_prompt(tokenizer, 2048, 0))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    who = {"model": "?"}

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        choice = torch._fused_sdp_choice(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
        mask = None if attn_mask is None else f"{tuple(attn_mask.shape)} {str(attn_mask.dtype)[6:]}"
        calls.append((who["model"], query.shape[-2], key.shape[-2], mask, is_causal, SDPBackend(choice).name))
        return real(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    def tag(name):
        return lambda module, args: who.update(model=name)

    hooks = [target.register_forward_pre_hook(tag("target")), drafter.register_forward_pre_hook(tag("draft"))]
    torch.nn.functional.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
            who["model"] = "plain"
            hooks[0].remove()
            target.generate(ids, max_new_tokens=4, do_sample=False)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
        for h in hooks:
            h.remove()
    seen = {}
    for model, q, _, mask, causal, kernel in calls:
        kind = f"{model} prefill" if q > 64 else f"{model} q={q}"
        seen.setdefault((kind, mask is not None and mask.split(")")[0] + ")", causal, kernel), 0)
        seen[(kind, mask is not None and mask.split(")")[0] + ")", causal, kernel)] += 1
    rows = []
    for (kind, _, causal, kernel), n in seen.items():
        example = next(c for c in calls if (f"{c[0]} prefill" if c[1] > 64 else f"{c[0]} q={c[1]}") == kind)
        rows.append({"pass": kind, "mask": example[3], "is_causal": causal, "kernel": kernel, "calls": n})
        print(rows[-1], flush=True)
    save(args, "kernels", rows)


def crop_to(cache, length):
    """Keep the first `length` positions of a DynamicCache (its `crop` takes the number to remove, negated)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def timed(fn, repeats=5):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.no_grad()
def part_cost(args):
    """ms of one plain step (1 token, as generate() runs it), a verify of 8 tokens with the 2-D mask the round
    passes (through transformers' "sdpa", which repeats the key/value heads for GQA whenever there is a mask, and
    through `verify_attention.routed`, SDPA's own GQA), and the drafter's block pass with 2 new context entries, over
    caches of each length; the draft pass with the whole context and with a 512 window."""
    target, tokenizer, drafter = load(args)
    items = cached_features(args)
    item = items[0]
    ids, feats = item["ids"], item["features"]
    gamma = drafter.config.block_size
    embed = target.get_input_embeddings()
    cache = DynamicCache()
    target(input_ids=ids[:, : max(LENGTHS)], cache=cache, use_cache=True, logits_to_keep=1)
    dcache = DynamicCache()
    top = max(LENGTHS)
    drafter(
        noise_embeds=drafter.block_input_embeds(ids[:, top : top + 1], embed),
        context_hidden_states=feats[:, :top],
        position_ids=torch.arange(top + gamma)[None],
        cache=dcache,
    )
    crop_to(dcache, top)
    rows = []
    for length in sorted(LENGTHS, reverse=True):
        crop_to(cache, length)

        def plain(length=length):
            target(input_ids=ids[:, length : length + 1], attention_mask=torch.ones(1, length + 1, dtype=torch.long),
                   position_ids=torch.tensor([[length]]), cache=cache, use_cache=True)  # fmt: skip
            crop_to(cache, length)

        def verify(length=length, gqa=False):
            mask = torch.ones(1, length + 8, dtype=torch.long)
            with routed(target) if gqa else contextlib.nullcontext():
                target(input_ids=ids[:, length : length + 8], attention_mask=mask, cache=cache, use_cache=True,
                       position_ids=torch.arange(length, length + 8)[None], output_hidden_states=True)  # fmt: skip
            crop_to(cache, length)

        def draft(window, length=length):
            layers = [(k[:, :, -(window - 2) :], v[:, :, -(window - 2) :]) for k, v, *_ in dcache] if window else None
            c = DynamicCache(ddp_cache_data=layers) if window else dcache
            start = length - 2
            drafter(
                noise_embeds=drafter.block_input_embeds(ids[:, length : length + 1], embed),
                context_hidden_states=feats[:, start:length],
                position_ids=torch.arange(start, length + gamma)[None],
                cache=c,
            )
            crop_to(c, length - 2) if not window else None

        crop_to(dcache, length - 2)
        row = {"length": length, "plain_ms": timed(plain), "verify8_ms": timed(verify),
               "verify8_gqa_ms": timed(lambda: verify(gqa=True)),
               "draft_full_ms": timed(lambda: draft(None)), "draft_w512_ms": timed(lambda: draft(512))}  # fmt: skip
        rows.append(row)
        print({k: round(v, 1) for k, v in row.items()}, flush=True)
    save(args, "cost", rows)


def part_routing(args):
    """The shipped drafter on the two 4k prompts (48 new tokens) with the verify's attention routed through SDPA's
    own GQA whatever the kernel choice (now) and with it bundled with the products (`OPTIONS.verify_attention`
    False stands for the old behaviour where the choice drops the products), back to back in one process."""
    from dspark_hf.evaluation.harness import run_evaluation

    target, tokenizer, drafter = load(args)
    records = [long_context_prompt(tokenizer, 4096, i) for i in range(2)]
    rows = {}
    for label, enabled in (("bundled", False), ("routed", True)):
        OPTIONS.verify_attention = enabled
        run = run_evaluation(target, tokenizer, {"d": drafter}, {"ctx-4k": records}, 48, progress=False)["runs"][0]
        rows[label] = {k: run[k] for k in ("acceptance_length", "speedup", "round_ms", "all_identical")}
        print(label, rows[label], flush=True)
    OPTIONS.verify_attention = True
    from dspark_hf.kernels.verify_linears import kernel_choice

    table = kernel_choice(target).table
    rows["products_chosen_by_rows"] = table.to_json()["choice"] if table is not None else {}
    print(rows["products_chosen_by_rows"])
    save(args, "routing", rows)


def save(args, key, value):
    path = Path(args.out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    data.setdefault("cpu", _cpu())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _cpu():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parts = ["features", "accuracy", "attention", "stats", "kernels", "cost", "rest", "routing"]
    parser.add_argument("part", choices=parts)
    parser.add_argument("--work", default="/tmp/long_context_work", help="cached target features (~200 MB)")
    parser.add_argument("--out", default="docs/results/long-context/analysis.json")
    args = parser.parse_args()
    parts = ["cost", "attention"] if args.part == "rest" else [args.part]
    for part in parts:  # "rest": the four after accuracy in one process (one model load)
        globals()[f"part_{part}"](args)
