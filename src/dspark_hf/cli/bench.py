"""`dspark-hf bench`: drafters against plain decoding on prompt sets (`evaluation/harness.py`), or with `--serve` the
load benchmark of an Engine or a running server (`serving/load_bench.py`)."""

import argparse
from pathlib import Path

from .checks import at_least, check_model_path, check_server, holds_a_causal_lm, int_list, require
from .loading import VERIFY_POLICIES, add_model_args, drafter_dtype, load_models, load_target, quantized


def add_parser(subparsers):
    bench = subparsers.add_parser("bench", help="evaluate drafters against plain decoding on benchmark prompt sets")
    bench.add_argument(
        "--prompts",
        action="append",
        help='JSONL with "prompt", "messages" or "turns" per line, named by its file stem; repeatable',
    )
    bench.add_argument("--datasets", help="name=FILE.jsonl,... (e.g. mt-bench=mt-bench.jsonl,gsm8k=gsm8k.jsonl)")
    bench.add_argument(
        "--long-context",
        metavar="LENGTHS",
        help="also build long-prompt sets at these lengths (e.g. 256,1k,2k,4k,8k; CPython docs and source + a "
        "question, --limit prompts each, default 2) and report τ, speed and round time per length",
    )
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--limit", type=int, default=None, help="use only the first N prompts of each dataset")
    bench.add_argument("--temperature", default="0", help="comma-separated, e.g. 0,1 (0 = greedy, checked lossless)")
    bench.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    bench.add_argument("--verify-policy", choices=VERIFY_POLICIES, default=None)
    bench.add_argument(
        "--tree-budget",
        help="comma-separated draft-tree budgets run side by side, e.g. 0,8,16,32 (0: the chain)",
    )
    bench.add_argument(
        "--latency-lengths", default="1,2,4,6,8,12,16", help="draft lengths for the latency sweep, e.g. 1-16 ('' off)"
    )
    bench.add_argument("--latency-new-tokens", type=int, default=48, help="tokens decoded per latency-sweep length")
    bench.add_argument(
        "--padded-baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time plain decoding through the verify kernels, the kernel-neutral baseline (speedup_vs_padded); "
        "default: on where the target's verifies can use them (float32 on the CPU)",
    )
    bench.add_argument(
        "--compiled-baseline",
        action="store_true",
        help="also time transformers' compiled static-cache plain decoding (speedup_vs_compiled); compiles once, "
        "about a minute on 2 CPU cores",
    )
    bench.add_argument(
        "--own-baseline",
        action="store_true",
        help="also time this package's own plain decoding, its decode round with no drafter (speedup_vs_own: what "
        "speculation itself buys over the same forward, cache and kernels)",
    )
    bench.add_argument("--out", help="folder for evaluation.json and the PNG plots")
    bench.add_argument("--json", help="write the full result JSON here")
    add_model_args(bench, many_drafters=True)
    _add_load_bench_args(bench)
    return bench


def _add_load_bench_args(bench) -> None:
    group = bench.add_argument_group("load benchmark (--serve)")
    group.add_argument("--serve", action="store_true", help="drive an HTTP server with concurrent clients instead")
    group.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated numbers of concurrent clients")
    group.add_argument(
        "--configs",
        default="plain,fixed,scheduled",
        help="comma-separated: plain, fixed (γ = the drafter's block), fixed:K (γ = K), scheduled (Algorithm 1 with "
        "the draft gate), scheduled:ungated (Algorithm 1 drafting every round)",
    )
    group.add_argument("--requests-per-client", type=int, default=2, help="closed-loop requests per client")
    group.add_argument("--png", default="load_bench.png", help="per-user vs aggregate tok/s plot ('' for none)")
    group.add_argument("--url", default=None, help="drive an already running server (one curve) instead")


def run(args) -> int:
    _check_args(args)
    if args.serve:
        if len(args.prompts or []) > 1 or len(args.drafter or []) > 1:
            raise ValueError("bench --serve takes at most one --prompts file and one --drafter.")
        args.prompts = args.prompts[0] if args.prompts else None
        args.drafter = args.drafter[0] if args.drafter else None
        return run_load_bench(args)

    from ..evaluation.harness import format_evaluation, parse_datasets, run_evaluation
    from ..utils.prompts import read_prompts

    files = parse_datasets(args.prompts, args.datasets)
    temperatures, lengths, budgets, context_lengths = _sweeps(args)
    if not files and not context_lengths:
        raise ValueError(
            "dspark-hf bench needs prompts: --prompts FILE.jsonl (repeatable) or --datasets name=FILE.jsonl,... "
            "(see docs/evaluation.md), --long-context 256,1k,... or --serve for the load benchmark."
        )
    datasets = {name: read_prompts(path)[: args.limit] for name, path in files.items()}
    target, tokenizer, drafters = _load_drafters(args)
    if context_lengths:
        from ..evaluation.long_context import long_context_sets

        room = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        cap = room - args.max_new_tokens - 1 if room else None
        datasets.update(long_context_sets(tokenizer, context_lengths, args.limit or 2, cap))
    result = run_evaluation(
        target,
        tokenizer,
        drafters,
        datasets,
        max_new_tokens=args.max_new_tokens,
        temperatures=temperatures,
        seed=args.seed,
        latency_lengths=lengths,
        latency_new_tokens=args.latency_new_tokens,
        # long prompts: the padded baseline would add a third long prefill per prompt; ask for it explicitly
        padded_baseline=False if context_lengths and args.padded_baseline is None else args.padded_baseline,
        tree_budgets=budgets,
        verify_policy=args.verify_policy,
        compiled_baseline=args.compiled_baseline,
        own_baseline=args.own_baseline,
    )
    result["target"] = args.target or "SmolLM2-135M-Instruct (embedded default)"
    for name, path in files.items():
        result["datasets"][name]["path"] = str(path)
    print(format_evaluation(result))
    if context_lengths:
        from ..evaluation.long_context import format_long_context, python_version

        result["long_context"] = {"lengths": context_lengths, "python": python_version()}
        print(format_long_context(result))
    _write(result, args.out, args.json)
    return 1 if result["all_identical"] is False else 0


def _check_args(args) -> None:
    """Everything `bench` can check before a model loads: numbers, model paths and drafter labels."""
    from ..evaluation.harness import parse_drafters

    at_least(args, 1, "limit", "max_new_tokens", "latency_new_tokens", "requests_per_client")
    check_model_path(args.target, "--target")
    for path in parse_drafters(args.drafter or []).values():
        # bench also times transformers' own assistants (any causal LM): only this package's drafters are read
        check_model_path(path, "--drafter", drafter=not holds_a_causal_lm(path))


def _sweeps(args) -> tuple[list[float], list[int], list[int], list[int] | None]:
    """(temperatures, latency-sweep lengths, tree budgets, long-context lengths or None), each option checked."""
    try:
        temperatures = [float(t) for t in args.temperature.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--temperature {args.temperature!r} must be comma-separated numbers, e.g. 0,1.") from None
    require(all(t >= 0 for t in temperatures), f"--temperature {args.temperature!r}: temperatures must be >= 0.")
    try:
        lengths = int_list(args.latency_lengths)
    except ValueError:
        raise ValueError(f"--latency-lengths {args.latency_lengths!r} must look like 1-16,24.") from None
    require(all(n >= 1 for n in lengths), f"--latency-lengths {args.latency_lengths!r}: lengths must be >= 1.")
    budgets = _tree_budgets(args.tree_budget)
    context_lengths = None
    if args.long_context:
        from ..evaluation.long_context import parse_context_lengths

        context_lengths = parse_context_lengths(args.long_context)
    return temperatures, lengths, budgets, context_lengths


def _tree_budgets(text: str | None) -> list[int | str]:
    """`--tree-budget 0,8,16,auto` -> [0, 8, 16, "auto"] (0: the chain); None -> []."""
    if text is None:
        return []
    from ..models.settings import MAX_TREE_BUDGET, check_tree_budget

    try:
        budgets = [b.strip() if b.strip() == "auto" else int(b) for b in text.split(",") if b.strip()]
        for budget in budgets:
            check_tree_budget(budget)
    except ValueError:
        budgets = []
    require(
        bool(budgets),
        f"--tree-budget {text!r} must be comma-separated ints in 0..{MAX_TREE_BUDGET} or auto, e.g. 0,16,auto "
        "(0: the chain).",
    )
    return budgets


def _load_drafters(args):
    """(target, tokenizer, {label: drafter}) for `bench`: every `--drafter [LABEL=]PATH`, else the default drafter
    (`--verify-policy` goes to `generate()` through `run_evaluation`, the drafters' configs stay as loaded)."""
    from ..evaluation.harness import load_assistant, parse_drafters

    specs = parse_drafters(args.drafter or [])
    if not specs:
        args.drafter = None
        target, tokenizer, drafter = load_models(args)
        drafters = {"default": drafter}
    else:
        target, tokenizer = load_target(args.target, with_tokenizer=True)
        target = quantized(target.eval(), args)
        dtype = drafter_dtype(args)
        drafters = {label: load_assistant(path, dtype) for label, path in specs.items()}
    return target, tokenizer, drafters


def _write(result: dict, out: str | None, json_path: str | None) -> None:
    """evaluation.json and the plots in `out`, the result JSON at `json_path`, each if given; says what it wrote."""
    from ..utils.files import atomic_write_json

    written = []
    if out:
        from ..evaluation.plots import plot_evaluation

        atomic_write_json(result, Path(out) / "evaluation.json")
        written += [Path(out) / "evaluation.json", *plot_evaluation(result, out)]
    if json_path:
        atomic_write_json(result, json_path)
        written.append(json_path)
    if written:
        print("wrote " + ", ".join(str(p) for p in written))


def run_load_bench(args) -> int:
    """`bench --serve`: concurrent clients against the Engine in this process (one curve per `--configs` entry), or
    against a running server (`--url`)."""
    from ..serving.load_bench import format_load_summary, run_curve, run_load_benchmark, write_load_result
    from ..utils.prompts import read_prompts

    records = read_prompts(args.prompts)[: args.limit] if args.prompts else None
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {args.concurrency!r} must be comma-separated client counts.") from None
    require(
        bool(concurrencies) and min(concurrencies) >= 1, f"--concurrency {args.concurrency!r}: counts must be >= 1."
    )
    if args.url:
        check_server(args.url)
        from ..serving.load_bench import BUILTIN_PROMPTS

        curve = run_curve(
            args.url, records or BUILTIN_PROMPTS, concurrencies, args.requests_per_client, args.max_new_tokens
        )
        result = {"url": args.url, "concurrencies": concurrencies, "curves": {"server": curve}, "targets": {}}
    else:
        target, tokenizer, drafter = load_models(args)
        result = run_load_benchmark(
            target,
            tokenizer,
            drafter,
            records,
            concurrencies,
            configurations=[c.strip() for c in args.configs.split(",") if c.strip()],
            requests_per_client=args.requests_per_client,
            max_tokens=args.max_new_tokens,
        )
    print(format_load_summary(result))
    write_load_result(result, args.json, args.png)
    print(" ".join(f"wrote {p}" for p in (args.json, args.png) if p))
    return 0
