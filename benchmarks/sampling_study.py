"""Sampling with the drafter, two ways: the seeded Gumbel-max coupling (chains and trees) against standard speculative
(rejection) sampling of chains, beside plain sampling's speed (issue 51, deliverable 3).

On the embedded pair (SmolLM2-135M-Instruct and the shipped drafter), for each eval set, temperature and prompt,
one generate() per way and verify policy, in an order rotated from prompt to prompt so that a change of machine load
hits every way alike:

  plain            transformers' own sampling, no drafter (the speed baseline)
  coupled-chain    sampling="coupled" (the default), drafter.config.tree_budget = 0
  coupled-tree4/8/16   the same with a draft tree of 4, 8 or 16 nodes
  coupled-auto     the shipped default: drafter.config.tree_budget = "auto" (16-node trees where this machine's
                   profile pays for them, chains elsewhere)
  standard-chain   sampling="standard": rejection sampling against the draft distributions, chains only (its
                   rows take no lookup drafts)
  coupled-chain-no-lookup   the coupled chain with drafter.config.context_lookup = 0: the standard chain's like
                   for like (the other ways keep the drafter's own lookup drafts)

each under `--policies`: "scheduler" (the shipped drafter's: Algorithm 1 and the draft gate, on an SPS profile of
this machine taken once and kept beside `--out`, so every run of the study prices verifies alike) and "fixed"
(every drafted position or tree node verified: τ then measures the acceptance rule itself, as issue 34 did). The
draft gate carries what it measured across generate() calls (`gate.GateMemory`: the draft pass's cost, whether it
was shut); each way keeps its own, swapped in before its calls, so a tree's dearer draft pass never shuts the gate
of the chain run after it.

Each cell (set, temperature, way, policy, prompt) records its new tokens, seconds, verify rounds and accepted drafts
(τ as the package's stats count it: committed tokens per round, the bonus included) and a short hash of its tokens,
so that the coupled ways can be checked to give one output per seed. Cells are appended to `--out` as they finish
and a rerun skips those there, so the study can run one set at a time and resume. No prompt text is written.

    python benchmarks/sampling_study.py --sets gsm8k --out docs/results/sampling/sampling_study.json
    python benchmarks/sampling_study.py --table --out docs/results/sampling/sampling_study.json

Time nothing else on the machine while it runs.
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path


WAYS = {  # way -> (sampling mode, tree budget, lookup drafts); None: plain sampling without the drafter
    "plain": None,
    "coupled-chain": ("coupled", 0, True),
    "coupled-tree4": ("coupled", 4, True),
    "coupled-tree8": ("coupled", 8, True),
    "coupled-tree16": ("coupled", 16, True),
    "coupled-auto": ("coupled", "auto", True),  # the shipped drafter's setting
    "standard-chain": ("standard", 0, False),  # its rows never take lookup drafts (decoding/lookup.py)
    "coupled-chain-no-lookup": ("coupled", 0, False),  # the standard chain's like for like
}
POLICIES = ("scheduler", "fixed")
SETS = ("mt-bench", "humaneval", "gsm8k", "math500", "mbpp", "arena-hard-v2")
WARMUP_TOKENS = 16
PROFILE_TOKENS = 17  # verifies up to a 16-node tree and its anchor


def load_prompts(eval_dir: Path, name: str, count: int, tokenizer) -> list:
    """The first `count` prompts of a set as token ids (1, L), through the package's own reader and chat template."""
    from dspark_hf.utils.prompts import encode, read_prompts

    return [encode(tokenizer, record) for record in read_prompts(eval_dir / f"{name}.jsonl")[:count]]


def machine_profile(target, path: Path) -> dict:
    """The SPS table of this CPU, profiled once (widths 1..PROFILE_TOKENS on a 256-token cache) and kept at `path`."""
    from dspark_hf.decoding.profiling import cpu_model, load_profile, profile_target, save_profile, sps_table

    if path.exists():
        profile = load_profile(path)
        if profile.get("cpu") == cpu_model():
            return sps_table(profile)
    profile = profile_target(target, lengths=range(1, PROFILE_TOKENS + 1), repeats=3, progress=False)
    save_profile(profile, path)
    return sps_table(profile)


def ways_and_policies(policies: list[str], ways: list[str] | None = None) -> list[tuple[str, str]]:
    """(way, policy) pairs to run per prompt: plain once (its policy "-"), every drafted way of `ways` (default:
    all) under each policy."""
    drafted = [w for w in WAYS if WAYS[w] is not None and (ways is None or w in ways)]
    return [("plain", "-")] + [(w, p) for p in policies for w in drafted]


def decode(target, drafter, ids, way: str, policy: str, temperature: float, new_tokens: int, seed: int, lookup: int):
    """One generate() of `way` under `policy` (`lookup`: the drafter's own `context_lookup`): its tokens' count and
    hash, seconds, and the round statistics."""
    import torch

    settings = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0, "max_new_tokens": new_tokens}
    if WAYS[way] is not None:
        mode, budget, lookups = WAYS[way]
        drafter.config.tree_budget = budget
        drafter.config.context_lookup = lookup if lookups else 0
        drafter.generation_stats = None
        settings |= {"assistant_model": drafter, "sampling": mode, "verify_policy": policy}
    torch.manual_seed(seed)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), **settings)
    seconds = time.perf_counter() - start
    tokens = out[0, ids.shape[1] :].tolist()
    cell = {"new_tokens": len(tokens), "seconds": seconds, "hash": hashlib.sha1(str(tokens).encode()).hexdigest()[:12]}
    if WAYS[way] is not None:
        stats = drafter.generation_stats
        cell |= {
            "rounds": stats.num_target_forwards,
            "accepted": sum(stats.accepted_lengths),
            "verified": sum(stats.verify_lengths),
            "gated_rounds": stats.gated_rounds,
            "lookup_rounds": stats.lookup_rounds,
        }
    return cell


def save(out: Path, done: dict) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(done, indent=1))
    os.replace(tmp, out)  # a stop mid-run keeps every finished cell


KEYS = ("set", "temperature", "way", "policy", "prompt")


def run(args) -> None:
    import dspark_hf
    from dspark_hf.decoding.profiling import cpu_model

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = json.loads(out.read_text()) if out.exists() else {"cpu": cpu_model(), "cells": []}
    seen = {tuple(c[k] for k in KEYS) for c in done["cells"]}
    target, tokenizer, drafter = dspark_hf.load_default()
    drafter.sps_profile = machine_profile(target, out.with_name("sps_profile.json"))
    done["settings"] = {
        "new_tokens": args.new_tokens,
        "seed": args.seed,
        "draft_gate": drafter.config.draft_gate,
        "context_lookup": drafter.config.context_lookup,
        "block_size": drafter.config.block_size,
        "draft_vocab_size": drafter.config.draft_vocab_size,
    }
    ways = ways_and_policies(args.policies, args.ways)
    lookup, budget = drafter.config.context_lookup, drafter.config.tree_budget
    done["settings"]["gate_memory"] = "one per way"
    from dspark_hf.decoding.gate import GateMemory
    from dspark_hf.evaluation.harness import gate_memory

    memories = {way: GateMemory() for way in ways}
    warm = False
    for name in args.sets:
        prompts = load_prompts(Path(args.eval_dir), name, args.prompts, tokenizer)
        for temperature in args.temperatures:
            for index, ids in enumerate(prompts):
                turn = (index + SETS.index(name) if name in SETS else index) % len(ways)
                order = ways[turn:] + ways[:turn]  # rotated per prompt: drift hits every way alike
                todo = [(w, p) for w, p in order if (name, temperature, w, p, index) not in seen]
                if not todo:
                    continue
                if not warm:  # kernels, thread counts, the drafter's first pass: every way once
                    with gate_memory(target, drafter, GateMemory()):  # a cold call's measurements kept by no way
                        for way, policy in ways:
                            decode(
                                target, drafter, ids[:, -64:], way, policy, temperature, WARMUP_TOKENS, args.seed,
                                lookup,
                            )  # fmt: skip
                    warm = True
                for way, policy in todo:
                    with gate_memory(target, drafter, memories[way, policy]):
                        cell = decode(
                            target, drafter, ids, way, policy, temperature, args.new_tokens, args.seed, lookup
                        )
                    cell |= {"set": name, "temperature": temperature, "way": way, "policy": policy, "prompt": index}
                    done["cells"].append(cell)
                    save(out, done)
                    tau = f"τ {(cell['accepted'] + cell['rounds']) / cell['rounds']:.2f}" if "rounds" in cell else ""
                    print(
                        f"{name:>14} T={temperature} {way:>15} {policy:>9} #{index}: {cell['new_tokens']} tokens "
                        f"{cell['new_tokens'] / cell['seconds']:.1f} tok/s {tau}",
                        flush=True,
                    )
    drafter.config.tree_budget, drafter.config.context_lookup = budget, lookup


def pooled(cells: list[dict]) -> dict:
    """τ over the cells' rounds (committed per round, bonus included) and tokens/s over their total time."""
    tokens, seconds = sum(c["new_tokens"] for c in cells), sum(c["seconds"] for c in cells)
    row = {"tokens_per_second": tokens / seconds if seconds else 0.0, "n": len(cells)}
    rounds = sum(c.get("rounds", 0) for c in cells)
    if rounds:
        row["tau"] = (sum(c["accepted"] for c in cells) + rounds) / rounds
    return row


def table(done: dict) -> str:
    """Markdown: per temperature and policy, each set's τ and speed (a multiple of plain sampling's, same prompts,
    same run) per way, then all sets pooled; then whether a seed gave one output."""
    cells = done["cells"]
    lines = [f"CPU: {done['cpu']}; settings: {done.get('settings', {})}", ""]
    drafted = [w for w in WAYS if WAYS[w] is not None and any(c["way"] == w for c in cells)]
    for temperature in sorted({c["temperature"] for c in cells}):
        at = [c for c in cells if c["temperature"] == temperature]
        names = [s for s in SETS if any(c["set"] == s for c in at)] + ["all"]
        for policy in [p for p in POLICIES if any(c["policy"] == p for c in at)]:
            lines += [
                f"T = {temperature}, verify_policy={policy!r}: τ · speed against plain sampling",
                "",
                "| set | plain tok/s | " + " | ".join(drafted) + " |",
                "|---|---:|" + "---:|" * len(drafted),
            ]
            for name in names:
                mine = at if name == "all" else [c for c in at if c["set"] == name]
                plain = pooled([c for c in mine if c["way"] == "plain"])["tokens_per_second"]
                row = [name, f"{plain:.1f}"]
                for way in drafted:
                    p = pooled([c for c in mine if c["way"] == way and c["policy"] == policy])
                    row.append(f"{p.get('tau', 0):.2f} · {p['tokens_per_second'] / plain if plain else 0:.2f}x")
                lines.append("| " + " | ".join(row) + " |")
            lines.append("")
    lines.append(same_tokens(cells))
    return "\n".join(lines)


def same_tokens(cells: list[dict]) -> str:
    """On how many (set, temperature, prompt) the coupled ways (chain and trees, every policy) gave one output, and
    the standard chain one output under both policies."""
    groups: dict[tuple, dict] = {}
    for c in cells:
        groups.setdefault((c["set"], c["temperature"], c["prompt"]), {})[(c["way"], c["policy"])] = c["hash"]
    coupled = [g for g in groups.values() if any(w.startswith("coupled") for w, _ in g)]
    same = sum(len({h for (w, _), h in g.items() if w.startswith("coupled")}) == 1 for g in coupled)
    standard = [g for g in groups.values() if sum(w == "standard-chain" for w, _ in g) > 1]
    alike = sum(len({h for (w, _), h in g.items() if w == "standard-chain"}) == 1 for g in standard)
    line = (
        f"Same seed, same tokens: the coupled ways run (chain, trees, with and without lookup drafts, under every "
        f"policy run) gave one output on {same} of {len(coupled)} prompts"
    )
    if standard:
        line += f"; the standard chain gave the same output under both policies on {alike} of {len(standard)}"
    return line + "."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval-dir", default="/work/shared/data/eval", help="folder of the six sets' JSONL files")
    parser.add_argument("--sets", default=",".join(SETS), help="comma-separated set names (files NAME.jsonl)")
    parser.add_argument("--temperatures", default="0.6,1.0")
    parser.add_argument("--prompts", type=int, default=4, help="the first N prompts of each set")
    parser.add_argument("--policies", default=",".join(POLICIES), help="verify policies of the drafted ways")
    parser.add_argument("--ways", default=None, help=f"comma-separated drafted ways (default: all, {list(WAYS)[1:]})")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before every generate()")
    parser.add_argument("--out", default="sampling_study.json", help="results, appended cell by cell (resumable)")
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return 0
    args.sets = [s for s in args.sets.split(",") if s]
    args.temperatures = [float(t) for t in args.temperatures.split(",") if t]
    args.policies = [p for p in args.policies.split(",") if p]
    args.ways = None if args.ways is None else [w for w in args.ways.split(",") if w]
    if args.ways is not None and (not args.ways or any(w not in WAYS or WAYS[w] is None for w in args.ways)):
        parser.error(f"--ways: choose from {[w for w in WAYS if WAYS[w] is not None]}")
    if not args.policies or any(p not in POLICIES for p in args.policies):
        parser.error(f"--policies: choose from {list(POLICIES)}")
    if args.prompts < 1 or args.new_tokens < 1 or any(t <= 0 for t in args.temperatures):
        parser.error("--prompts and --new-tokens must be >= 1 and every temperature > 0")
    missing = [s for s in args.sets if not (Path(args.eval_dir) / f"{s}.jsonl").is_file()]
    if missing:
        parser.error(f"no {', '.join(missing)} JSONL in {args.eval_dir}; pass --eval-dir")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
