"""Every configuration we accept against its own plain decoding: the "never slower than plain" matrix.

Each cell runs the embedded pair (SmolLM2-135M-Instruct and the shipped drafter) in one configuration, plain and with
the drafter, alternating, and reports the drafter's speed as a ratio of that cell's own plain decoding
(transformers' `generate()` in the same configuration), with token identity where it is promised: greedy on fp32
and weight-only targets (a sampled row's tokens are fixed by its seed along this package's paths, but transformers'
own sampling draws differently, so T=1 cells compare speed only). The axes:

  target   fp32, bf16, int8-weight, int4-weight (torchao), dynamic-int8 (PyTorch)
  batch    1 or 4 prompts per generate() call (left-padded)
  mode     greedy or T=1 (seeded)
  prompt   256 or 4k tokens (a document and a question, `evaluation/long_context.py`)
  load     quiet, or beside a one-thread matmul process (a CPU hog)
  draft    chain, a tree of 16 nodes, or "auto" (the shipped setting: trees where the profile pays for them)

Cells are appended to a JSON file as they finish (`--out`), and a rerun skips the cells already there, so a long
matrix can be stopped and resumed. Run a subset with the axis options, e.g.

    python benchmarks/matrix.py --targets fp32 --batches 1 --modes greedy --prompts 256 --loads quiet,hog

Time nothing else on the machine while it runs (two torch processes on two cores slow each other tenfold).
"""

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


AXES = {
    "targets": ("fp32", "bf16", "int8-weight", "int4-weight", "dynamic-int8"),
    "batches": ("1", "4"),
    "modes": ("greedy", "t1"),
    "prompts": ("256", "4k"),
    "loads": ("quiet", "hog"),
    "drafts": ("chain", "tree", "auto"),
}
IDENTITY_PROMISED = {"fp32", "int8-weight", "int4-weight"}  # bf16 and dynamic int8 may flip near-ties
HOG = "import torch; torch.set_num_threads(1); a = torch.randn(1500, 1500)\nwhile True: a @ a"


def cpu_name() -> str:
    """The CPU's model name and its widest matmul extension: VMs sold under one name differ in them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    widest = next((f for f in ("amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags), "")
    return f"{name or platform.processor() or 'unknown CPU'}" + (f" ({widest})" if widest else "")


def load_target(kind: str):
    import torch

    import dspark_hf
    from dspark_hf.integrations.quantization import quantize_target

    target, tokenizer, drafter = dspark_hf.load_default()
    if kind == "bf16":
        target = target.to(torch.bfloat16)
    elif kind != "fp32":
        target = quantize_target(target, kind)
    return target.eval(), tokenizer, drafter


def prompts_for(tokenizer, length: str, batch: int) -> list:
    from dspark_hf.evaluation.long_context import long_context_prompt
    from dspark_hf.utils.prompts import encode

    tokens = 4096 if length == "4k" else int(length)
    return [encode(tokenizer, long_context_prompt(tokenizer, tokens, index=i))[0].tolist() for i in range(batch)]


def padded_batch(tokenizer, prompts: list[list[int]]):
    """Left-padded input_ids and attention mask of `prompts`."""
    import torch

    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def generated_tokens(out, prompt_length: int, eos) -> int:
    """Tokens generated over the rows of `out` (B, L + n): each row's up to and including its first stop token."""
    stops = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    total = 0
    for row in out[:, prompt_length:].tolist():
        ends = [i for i, token in enumerate(row) if token in stops]
        total += ends[0] + 1 if ends else len(row)
    return total


def run_cell(target, tokenizer, drafter, cell: dict, new_tokens: int, repeats: int, greedy_min: bool = False) -> dict:
    import torch

    ids, mask = padded_batch(tokenizer, prompts_for(tokenizer, cell["prompt"], int(cell["batch"])))
    # sampled rows draw other tokens than transformers' sampling: every row makes all its tokens (no early stop token),
    # so that both sides decode as many rows for as many steps; greedy rows too with `greedy_min`
    full = {"min_new_tokens": new_tokens}
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, **full}
    greedy = {"do_sample": False, **(full if greedy_min else {})}
    settings = {"max_new_tokens": new_tokens, **(sampling if cell["mode"] == "t1" else greedy)}
    drafter.config.tree_budget = {"chain": 0, "tree": 16, "auto": "auto"}[cell["draft"]]

    def generate(with_drafter: bool):
        torch.manual_seed(0)
        extra = {"assistant_model": drafter} if with_drafter else {}
        start = time.perf_counter()
        out = target.generate(input_ids=ids, attention_mask=mask, **settings, **extra)
        return out, time.perf_counter() - start

    generate(False), generate(True)  # warm-up: kernels, profiles, the drafter's first pass
    plain_s, drafted_s, identical = [], [], True
    for _ in range(repeats):  # alternating, so a change of load affects both alike
        plain, seconds = generate(False)
        plain_s.append(seconds)
        drafted, seconds = generate(True)
        drafted_s.append(seconds)
        identical &= torch.equal(plain, drafted)
    stats = drafter.generation_stats
    eos = target.generation_config.eos_token_id
    plain_tokens = generated_tokens(plain, ids.shape[1], eos)
    drafted_tokens = generated_tokens(drafted, ids.shape[1], eos)
    return {
        **cell,
        **(full if greedy_min and cell["mode"] == "greedy" else {}),  # said in the cell: not the matrix's default
        "plain_s": min(plain_s),
        "drafted_s": min(drafted_s),
        "plain_tokens": plain_tokens,
        "drafted_tokens": drafted_tokens,
        # tokens per second against tokens per second: where the outputs differ (bf16, dynamic int8, sampling) one
        # may stop long before the other
        "ratio": (drafted_tokens / min(drafted_s)) / (plain_tokens / min(plain_s)),
        "tau": stats.acceptance_length,
        "gated_rounds": stats.gated_rounds,
        "rounds": stats.num_target_forwards,
        "identical": identical,
        # sampled tokens match our own decoding under the same seed, not transformers' multinomial draws
        "identity_promised": cell["target"] in IDENTITY_PROMISED and cell["mode"] == "greedy",
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for axis, values in AXES.items():
        parser.add_argument(f"--{axis}", default=",".join(values), help=f"comma-separated, of {', '.join(values)}")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="timed plain/drafted pairs per cell (fastest kept)")
    parser.add_argument("--out", default="matrix.json", help="results, appended cell by cell (resumable)")
    parser.add_argument(
        "--greedy-min-new-tokens",
        action="store_true",
        help="greedy rows also make all --new-tokens (min_new_tokens), for a target that stops at once on a prompt",
    )
    args = parser.parse_args(argv)
    chosen = {}
    for axis, values in AXES.items():
        chosen[axis] = [v for v in getattr(args, axis).split(",") if v]
        bad = [v for v in chosen[axis] if v not in values]
        if bad:
            parser.error(f"--{axis}: unknown {bad}; choose from {list(values)}")
    out = Path(args.out)
    done = json.loads(out.read_text()) if out.exists() else {"cpu": cpu_name(), "cells": []}
    if done["cpu"] != cpu_name():
        parser.error(f"{out} was measured on {done['cpu']!r}, this machine is {cpu_name()!r}: pass a new --out")
    keys = ("target", "batch", "mode", "prompt", "load", "draft")
    seen = {tuple(c[k] for k in keys) for c in done["cells"]}
    for target_kind in chosen["targets"]:
        cells = [
            dict(zip(keys, (target_kind, *rest)))
            for rest in itertools.product(*(chosen[a] for a in ("batches", "modes", "prompts", "loads", "drafts")))
        ]
        cells = [c for c in cells if tuple(c[k] for k in keys) not in seen]
        if not cells:
            continue
        target, tokenizer, drafter = load_target(target_kind)
        for cell in cells:
            hog = subprocess.Popen([sys.executable, "-c", HOG]) if cell["load"] == "hog" else None
            try:
                result = run_cell(
                    target, tokenizer, drafter, cell, args.new_tokens, args.repeats, args.greedy_min_new_tokens
                )
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            done["cells"].append(result)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(done, indent=1))
            os.replace(tmp, out)  # a stop mid-matrix keeps every finished cell
            flag = "" if result["identical"] or not result["identity_promised"] else "  NOT IDENTICAL"
            print(
                " ".join(f"{cell[k]:>12}" for k in keys),
                f"{result['ratio']:.2f}x  τ {result['tau']:.2f}  gated {result['gated_rounds']}/{result['rounds']}"
                f"{flag}",
                flush=True,
            )
    slow = [c for c in done["cells"] if c["ratio"] < 0.97]
    print(f"{len(done['cells'])} cells on {done['cpu']}; {len(slow)} below 0.97x of their own plain decoding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
