"""Where a one-token step of the round's target forward goes: the whole step, the target's linears alone, and
torch's profiler split of the step (the products against everything else).

    python benchmarks/where_a_step_goes.py [--context 256] [--repeats 20]

fp32 SmolLM2-135M over a prefilled `AppendCache` of `--context` tokens, as a decode round calls it
(`lean_forward.run_target`, a 2-D mask of ones). "Linears alone" runs every `nn.Linear` of the target once on a
one-row input, in module order, as plain `F.linear`. The profiler's self time per step is split into the matrix
products (`aten::mm`/`addmm`), SDPA and the rest; what the wall clock holds beyond the profiler's total is Python
between the operators. Prints the CPU model; nothing here is a test.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.profiler import profile

import dspark_hf
from dspark_hf.decoding.profiling import cpu_model
from dspark_hf.decoding.ragged_cache import AppendCache
from dspark_hf.kernels.lean_forward import run_target


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    target, _, _ = dspark_hf.load_default()
    vocab, context = target.config.vocab_size, args.context
    generator = torch.Generator().manual_seed(0)
    cache = AppendCache()
    prompt = torch.randint(0, vocab, (1, context), generator=generator)
    run_target(target, input_ids=prompt, position_ids=torch.arange(context)[None], cache=cache, use_cache=True)

    def step():
        ids = torch.randint(0, vocab, (1, 1), generator=generator)
        run_target(
            target, input_ids=ids, position_ids=torch.tensor([[context]]), cache=cache, use_cache=True,
            attention_mask=torch.ones(1, context + 1, dtype=torch.long),
        )  # fmt: skip
        cache.crop(-1)

    linears = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, 1, m.in_features) for m in linears]

    def linears_alone():
        for module, x in zip(linears, inputs):
            F.linear(x, module.weight, module.bias)

    for _ in range(3):
        step()
        linears_alone()
    times = {"step": [], "linears": []}
    for _ in range(args.repeats):
        for name, run in (("step", step), ("linears", linears_alone)):
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    with profile() as prof:
        for _ in range(10):
            step()
    events = prof.key_averages()
    per_step = {
        "products": sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm")),
        "sdpa": sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key and "flash" in e.key),
        "all": sum(e.self_cpu_time_total for e in events),
    }
    per_step = {k: v / 10 / 1e3 for k, v in per_step.items()}
    others = [e for e in events if e.key not in ("aten::mm", "aten::addmm") and "scaled_dot_product" not in e.key]
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, cache {context} tokens")
    print(f"one-token step {statistics.median(times['step']):.1f} ms (wall, median of {args.repeats})")
    print(f"the {len(linears)} linears alone {statistics.median(times['linears']):.1f} ms")
    print(
        f"profiler, per step: products {per_step['products']:.1f} ms, SDPA {per_step['sdpa']:.1f} ms, "
        f"{sum(e.count for e in others) // 10} other operators "
        f"{per_step['all'] - per_step['products'] - per_step['sdpa']:.1f} ms (self time, profiler overhead included)"
    )


if __name__ == "__main__":
    main()
