"""Time the target's verify forward with and without the few-rows products (`dspark_hf.kernels.verify_head`) and the
grouped-query attention on the unrepeated cache (`dspark_hf.kernels.verify_attention`) on the embedded SmolLM2
target, side by side (median of 15 rounds, each round visiting every case once).

    python benchmarks/time_verify_head.py

Prints, per verify width (anchor + drafts), the milliseconds of the LM-head product alone and of a whole target
forward over a 256-token cache: as `nn.Linear` and transformers' sdpa compute them, with the few-rows products, and
with both (what a verify pass runs).
"""

import contextlib
import statistics
import time

import torch
from transformers import DynamicCache

from dspark_hf.default import load_default_target
from dspark_hf.kernels import verify_head
from dspark_hf.kernels.options import OPTIONS


WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8)


@torch.no_grad()
def main() -> None:
    target, _ = load_default_target()
    head = target.get_output_embeddings()
    if not verify_head.eligible(target):
        raise SystemExit("The target has no float32 CPU nn.Linear: the few-rows products do not apply.")
    generator = torch.Generator().manual_seed(0)
    vocab, hidden_size = head.weight.shape
    cache = DynamicCache(config=target.config)
    target(input_ids=torch.randint(0, vocab, (1, 256), generator=generator), cache=cache, use_cache=True)
    hidden = {k: torch.randn(1, k, hidden_size, generator=generator) for k in WIDTHS}
    ids = {k: torch.randint(0, vocab, (1, k), generator=generator) for k in WIDTHS}
    modes = {"head": ("linear", "few rows"), "forward": ("linear", "few rows", "both")}
    times = {(what, k, mode): [] for what, kinds in modes.items() for k in WIDTHS for mode in kinds}

    def run(what, k, mode):
        OPTIONS.verify_attention = mode == "both"
        scope = verify_head.verify_kernels(target) if mode != "linear" else contextlib.nullcontext()
        start = time.perf_counter()
        with scope:
            if what == "head":
                head(hidden[k])
            else:
                target(input_ids=ids[k], cache=cache, use_cache=True)
                cache.crop(-k)
        times[what, k, mode].append(1e3 * (time.perf_counter() - start))

    for i in range(17):  # 2 warm-up rounds
        for case in times:
            run(*case)
        if i == 1:
            for values in times.values():
                values.clear()
    OPTIONS.verify_attention = True
    print(
        f"{'width':>5}  {'LM head: linear':>15}  {'few rows':>8}  {'forward: linear':>15}  {'few rows':>8}  "
        f"{'+ GQA':>8}"
    )
    for k in WIDTHS:
        med = {key: statistics.median(v) for key, v in times.items() if key[1] == k}
        print(
            f"{k:5d}  {med['head', k, 'linear']:12.1f} ms  {med['head', k, 'few rows']:5.1f} ms  "
            f"{med['forward', k, 'linear']:12.1f} ms  {med['forward', k, 'few rows']:5.1f} ms  "
            f"{med['forward', k, 'both']:5.1f} ms"
        )


if __name__ == "__main__":
    main()
