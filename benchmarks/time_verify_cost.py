"""The embedded target's verify cost by width beside the memory floor, every kernel mode side by side in one run.

    python benchmarks/time_verify_cost.py [--widths 1,2,3,4,6,8,16,32] [--repeats 7] [--json out.json]

For each width (tokens per verify, anchor included) a forward of the fp32 SmolLM2 target on a 256-token cache, the
median of `--repeats` rounds, each round visiting every (width, mode) once so that a burst of load lands on all
alike. Modes: "off" (transformers' own linears), "few rows" (the few-row products of `kernels.verify_head`, on for
every verify), "choice" (the faster of those two per width: what the old `KernelChoice` kept) and, where available,
"packed" (the target's linears through oneDNN's packed weights, `kernels.verify_linears`, unpadded) and "measured"
(`verify_linears.kernel_choice`: per width the fastest way measured on this machine, what verifies run with).
Beside them: transformers' own plain decoding step (`generate()`, per token), and the memory floor, the bytes of
weights a step reads divided by the measured read bandwidth (a sum over a tensor of that size, median of 7; the best
is printed too). Prints the CPU model and thread count.
"""

import argparse
import contextlib
import json
import statistics
import time

import torch
from transformers import DynamicCache

import dspark_hf
from dspark_hf.decoding.profiling import cpu_model, weight_bytes
from dspark_hf.kernels import verify_head


def read_bandwidth(nbytes: int, repeats: int = 7) -> tuple[float, float]:
    """Bytes per second of a sum over a float32 tensor of `nbytes`: (median, best) of `repeats`."""
    big = torch.ones(nbytes // 4)
    times = [_timed(big.sum) for _ in range(repeats)]
    return nbytes / statistics.median(times), nbytes / min(times)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def modes(target) -> dict:
    """name -> context manager factory for one verify forward."""
    out = {
        "off": contextlib.nullcontext,
        "few rows": lambda: verify_head.verify_kernels(target),
    }
    try:  # the packed verify linears and the measured choice, where this version has them
        from dspark_hf.kernels import verify_linears
    except ImportError:
        return out
    packs = verify_linears.packs_for(target)
    out["packed"] = lambda: packs.scope(target)
    choice = verify_linears.kernel_choice(target)
    table = choice.ensure(target)
    print("measured kernel choice (rows: way, padded to):", table.choice)
    out["measured"] = lambda: _Scope(choice, target)
    return out


class _Scope:
    """`choice.verify(target, rows)` for the rows of the forward about to run (set by the caller)."""

    rows = 1

    def __init__(self, choice, target):
        self.scope = choice.verify(target, _Scope.rows)

    def __enter__(self):
        return self.scope.__enter__()

    def __exit__(self, *exc):
        return self.scope.__exit__(*exc)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="1,2,3,4,6,8,16,32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--plain-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    target, tokenizer, _ = dspark_hf.load_default()
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.randint(0, vocab, (1, args.context), generator=generator), cache=cache, use_cache=True)
    ways = modes(target)
    times = {(k, mode): [] for k in widths for mode in ways}
    for i in range(args.repeats + 2):  # 2 warm-up rounds
        for k in widths:
            for mode, scope in ways.items():
                ids = torch.randint(0, vocab, (1, k), generator=generator)
                _Scope.rows = k
                start = time.perf_counter()
                with scope():
                    target(input_ids=ids, cache=cache, use_cache=True)
                elapsed = time.perf_counter() - start
                cache.crop(-k)
                if i >= 2:
                    times[k, mode].append(1e3 * elapsed)
    # transformers' own plain step: generate() per token, prefill taken out (the same 256-token prompt)
    prompt = torch.randint(0, vocab, (1, args.context), generator=generator)
    mask = torch.ones_like(prompt)

    def gen(n):
        return _timed(
            lambda: target.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        )

    gen(4)
    plain = [(gen(1 + args.plain_tokens) - gen(1)) / args.plain_tokens * 1e3 for _ in range(3)]
    nbytes = weight_bytes(target)
    bandwidth, best_bandwidth = read_bandwidth(nbytes)
    floor_ms = nbytes / bandwidth * 1e3
    medians = {key: statistics.median(v) for key, v in times.items()}
    for k in widths:
        medians[k, "choice"] = min(medians[k, "off"], medians[k, "few rows"])
    names = list(ways) + ["choice"]
    one = medians[1, "off"]
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, cache {args.context} tokens")
    print(
        f"memory floor: {nbytes / 1e6:.0f} MB of weights / {bandwidth / 1e9:.1f} GB/s read = {floor_ms:.1f} ms "
        f"(best read {best_bandwidth / 1e9:.1f} GB/s: {nbytes / best_bandwidth * 1e3:.1f} ms); "
        f"transformers' plain step (generate, per token): {statistics.median(plain):.1f} ms"
    )
    print("width " + "".join(f"{n:>12}" for n in names) + "  (ms; x of a 1-token step, own linears)")
    for k in widths:
        print(f"{k:>5} " + "".join(f"{medians[k, n]:7.1f} {medians[k, n] / one:3.2f}x" for n in names))
    if args.json:
        report = {
            "cpu": cpu_model(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "context": args.context,
            "repeats": args.repeats,
            "weight_bytes": nbytes,
            "read_gb_s": bandwidth / 1e9,
            "best_read_gb_s": best_bandwidth / 1e9,
            "floor_ms": floor_ms,
            "plain_generate_step_ms": statistics.median(plain),
            "verify_ms": {n: {str(k): medians[k, n] for k in widths} for n in names},
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
