"""What compiling the target's step would buy on this machine: the package's round forward, the same arithmetic as one
hand-written eager function over a static cache, and that function compiled by inductor, side by side, beside the
memory floor.

    python benchmarks/time_compiled_step.py [--widths 1,4,16] [--repeats 9] [--context 256] [--dynamic | --freeze]
                                            [--json out.json]

The study behind issue 50 ("a round at the memory floor"). Three ways of one target forward of `width` tokens over a
prefilled cache of `--context` tokens, fp32 SmolLM2-135M, each round of timing visiting every (width, way) once so
that a burst of load lands on all alike:

- "round": what decode rounds run today, `lean_forward.run_target` over the package's `AppendCache` with a 2-D mask,
  its linears the way the kernel table measured fastest for that width (`verify_linears`: oneDNN's packed weights on
  most CPUs), without the table's retries of the other ways;
- "round, F.linear": the same forward with transformers' own `F.linear` products (what this study compared until
  2026-12-07: the compiled ways below run their linears through `F.linear` too, unless `--freeze`);
- "eager": one function, a layer in a dozen operators (RMSNorm, one rotary embedding, SDPA with grouped keys, the
  MLP), over a static key/value buffer of `--capacity` slots written with `index_copy_` and masked;
- "compiled": that function through `torch.compile` (inductor, `dynamic=False`, one graph per width; `--dynamic`:
  `dynamic=True`, one graph for one token and one for every other width, as a round of any width would need), the
  compile time printed per width (inductor caches its kernels on disk: a second run compiles in seconds). With
  `--freeze`, inductor's freezing: the weights become constants of the graph and its linears run through oneDNN's
  packed weights, as the round's do (a packed copy of every weight, made at compile time).

Logits of "eager" and "compiled" are compared with "round" (max |difference|, and whether every argmax agrees).
The floor is the bytes of weights a step reads over the read bandwidth measured in the same process. Prints the CPU
model; nothing here is a test.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import dspark_hf
from dspark_hf.decoding.profiling import cpu_model, memory_floor_ms, run_facts, weight_bytes
from dspark_hf.decoding.ragged_cache import AppendCache
from dspark_hf.kernels.lean_forward import run_target
from dspark_hf.kernels.options import OPTIONS
from dspark_hf.kernels.verify_head import eligible_linears
from dspark_hf.kernels.verify_linears import kernel_choice


def static_step(target, capacity: int):
    """(step(ids, positions, slots, mask) -> logits, the key/value buffers): the target's forward as one function over
    static buffers (B = 1, a Llama-shaped fp32 target without q/k norms)."""
    config, base = target.config, target.model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    inv_freq = base.rotary_emb.inv_freq
    layers = [
        (
            layer.input_layernorm.weight,
            layer.self_attn.q_proj.weight,
            layer.self_attn.k_proj.weight,
            layer.self_attn.v_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.post_attention_layernorm.weight,
            layer.mlp.gate_proj.weight,
            layer.mlp.up_proj.weight,
            layer.mlp.down_proj.weight,
        )
        for layer in base.layers
    ]
    keys = [torch.zeros(1, kv_heads, capacity, head_dim) for _ in layers]
    values = [torch.zeros(1, kv_heads, capacity, head_dim) for _ in layers]
    eps = config.rms_norm_eps

    def norm(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(x, cos, sin):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def step(ids, positions, slots, mask):
        width = ids.shape[1]
        x = base.embed_tokens(ids)
        freqs = positions[:, None].float() * inv_freq[None]
        angles = torch.cat((freqs, freqs), -1)
        cos, sin = angles.cos()[None, None], angles.sin()[None, None]
        for i, (ln1, wq, wk, wv, wo, ln2, wg, wu, wd) in enumerate(layers):
            h = norm(x, ln1)
            q = F.linear(h, wq).view(1, width, heads, head_dim).transpose(1, 2)
            k = F.linear(h, wk).view(1, width, kv_heads, head_dim).transpose(1, 2)
            v = F.linear(h, wv).view(1, width, kv_heads, head_dim).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            keys[i].index_copy_(2, slots, k)
            values[i].index_copy_(2, slots, v)
            out = F.scaled_dot_product_attention(q, keys[i], values[i], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(out.transpose(1, 2).reshape(1, width, -1), wo)
            h = norm(x, ln2)
            x = x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
        return F.linear(norm(x, base.norm.weight), target.lm_head.weight)

    return step, keys, values


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--dynamic", action="store_true", help="dynamic shapes: one graph for widths > 1")
    parser.add_argument("--freeze", action="store_true", help="inductor's freezing: weights as packed constants")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    target, _, _ = dspark_hf.load_default()
    vocab, context = target.config.vocab_size, args.context
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, context), generator=generator)

    cache = AppendCache()
    run_target(target, input_ids=prompt, position_ids=torch.arange(context)[None], cache=cache, use_cache=True)
    step, keys, values = static_step(target, args.capacity)
    for i, layer in enumerate(cache.layers):  # the same prompt in the static buffers
        keys[i][:, :, :context] = layer.keys
        values[i][:, :, :context] = layer.values

    def inputs(width):
        ids = torch.randint(0, vocab, (1, width), generator=generator)
        positions = torch.arange(context, context + width)
        mask = torch.zeros(width, args.capacity, dtype=torch.bool)
        mask[:, :context] = True
        mask[:, context : context + width] = torch.ones(width, width, dtype=torch.bool).tril()
        return ids, positions, mask

    linears = eligible_linears(target)
    kernels = kernel_choice(target)
    table = kernels.ensure(target, linears) if linears else None

    def round_way(ids, positions, mask, way=None):
        width = ids.shape[1]
        OPTIONS.verify_way = way or (table.way(width)[0] if table is not None else "linear")
        try:
            with kernels.verify(target, width, linears):
                out = run_target(
                    target, input_ids=ids, position_ids=positions[None], cache=cache, use_cache=True,
                    attention_mask=torch.ones(1, context + width, dtype=torch.long),
                )  # fmt: skip
        finally:
            OPTIONS.verify_way = None
        cache.crop(-width)
        return out.logits

    if args.freeze:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
        holder = torch.nn.Module()
        holder.target = target  # freezing folds the parameters of the compiled module into the graph
        holder.forward = step
        compiled = torch.compile(holder, dynamic=args.dynamic)
    else:
        compiled = torch.compile(step, dynamic=args.dynamic)
    ways = {
        "round": round_way,
        "round, F.linear": lambda ids, positions, mask: round_way(ids, positions, mask, "linear"),
        "eager": lambda ids, positions, mask: step(ids, positions, positions, mask),
        "compiled": lambda ids, positions, mask: compiled(ids, positions, positions, mask),
    }
    compile_s, agreement = {}, {}
    for width in widths:
        ids, positions, mask = inputs(width)
        reference = round_way(ids, positions, mask)
        start = time.perf_counter()
        logits = {"compiled": ways["compiled"](ids, positions, mask), "eager": ways["eager"](ids, positions, mask)}
        compile_s[width] = time.perf_counter() - start
        agreement[width] = {
            way: {
                "max_abs_diff": (out - reference).abs().max().item(),
                "same_argmax": bool(torch.equal(out.argmax(-1), reference.argmax(-1))),
            }
            for way, out in logits.items()
        }
        print(f"width {width}: compiled in {compile_s[width]:.1f} s; vs the round's logits {agreement[width]}")
    times = {(w, way): [] for w in widths for way in ways}
    for i in range(args.repeats + 2):
        for width in widths:
            ids, positions, mask = inputs(width)
            for way, run in ways.items():
                start = time.perf_counter()
                run(ids, positions, mask)
                if i >= 2:
                    times[width, way].append((time.perf_counter() - start) * 1e3)
    nbytes = weight_bytes(target)
    floor, _ = memory_floor_ms(nbytes, torch.device("cpu"))
    medians = {key: statistics.median(v) for key, v in times.items()}
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, cache {context} tokens")
    print(f"memory floor {floor:.1f} ms ({nbytes / 1e6:.0f} MB of weights)")
    print("width" + "".join(f"{way:>17}" for way in ways) + "   (ms; x the floor)")
    for width in widths:
        cells = "".join(f"{medians[width, way]:12.1f} {medians[width, way] / floor:3.1f}x" for way in ways)
        print(f"{width:5d} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    **run_facts(),
                    "context": context,
                    "dynamic": args.dynamic,
                    "freeze": args.freeze,
                    "round_ways": {w: table.way(w)[0] for w in widths} if table is not None else None,
                    "floor_ms": floor,
                    "compile_s": compile_s,
                    "agreement": agreement,
                    "ms": {f"{w},{way}": v for (w, way), v in medians.items()},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
