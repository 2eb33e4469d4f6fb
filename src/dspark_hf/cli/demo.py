"""`dspark-hf demo`: one reply from the embedded default (or --target/--drafter), coloured by how each token was
committed, then τ and the speedup over plain decoding from alternating timed runs."""

import os
import sys

import torch

from .checks import at_least, check_model_path
from .loading import add_model_args, load_models


DEMO_PROMPT = "Explain in three sentences why the sky is blue."


def add_parser(subparsers):
    demo = subparsers.add_parser("demo", help="reply to one prompt with the embedded default; print τ and speedup")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--repeats", type=int, default=3, help="timed runs of plain and drafted decoding, alternating")
    demo.add_argument(
        "--no-color",
        action="store_true",
        help="print the reply as plain text (as when stdout is no terminal or NO_COLOR is set), not coloured by "
        "how each token was committed",
    )
    add_model_args(demo)
    return demo


def run(args) -> int:
    from ..evaluation.harness import run_bench, timed_generate
    from ..utils.prompts import encode

    at_least(args, 1, "repeats", "max_new_tokens")
    check_model_path(args.target, "--target")
    check_model_path(args.drafter, "--drafter", drafter=True)
    target, tokenizer, drafter = load_models(args)
    record = {"messages": [{"role": "user", "content": args.prompt}]}
    out, _ = timed_generate(target, encode(tokenizer, record), args.max_new_tokens, drafter)
    reply = picture(tokenizer, out.tolist(), drafter.generation_stats, color=use_color(args))
    print(f"User: {args.prompt}\nAssistant: {reply}\n", flush=True)
    # timing: the prompt `repeats` times, plain and drafted in alternating order (as in `bench`), totals compared
    result = run_bench(target, tokenizer, drafter, [record] * args.repeats, args.max_new_tokens, progress=False)
    _report(result, drafter, args.repeats)
    return 0 if result["all_identical"] else 1


def use_color(args) -> bool:
    """Colours only for a terminal, and neither `--no-color` nor `NO_COLOR` (https://no-color.org) set."""
    return not args.no_color and not os.environ.get("NO_COLOR") and sys.stdout.isatty()


def picture(tokenizer, token_ids: list[int], stats, color: bool) -> str:
    """The reply's text, each token coloured by how it was committed, and a legend line with τ
    (`evaluation.view.render_reply`); the stop token that ended it (a special token) is not shown."""
    from ..evaluation.view import render_reply

    origins, rounds = stats.token_origins(), list(stats.committed)
    if token_ids and token_ids[-1] in tokenizer.all_special_ids:
        token_ids, origins = token_ids[:-1], origins[:-1]
        rounds[-1:] = [rounds[-1] - 1] if rounds else []  # its verify pass stays counted
    return render_reply(tokenizer, token_ids, origins, color=color, rounds=rounds)


def _report(result: dict, drafter, repeats: int) -> None:
    """τ and the speedups of `run_bench`'s result, and what the padded baseline or the thread count say of them."""
    label = " (UNTRAINED drafter: expect no speedup)" if getattr(drafter, "is_untrained", False) else ""
    print(
        f"timed runs: identical to plain greedy: {result['all_identical']}   τ = {result['acceptance_length']:.2f}   "
        f"speedup over plain decoding: {result['speedup']:.2f}x "
        f"({result['tokens_per_second_dspark']:.1f} vs {result['tokens_per_second_plain']:.1f} tok/s, "
        f"{repeats} alternating runs each){label}"
    )
    padded = result["tokens_per_second_padded"]
    fewer, rounds = result["fewer_threads_rounds"], result["num_target_forwards"]
    if fewer:  # the padded baseline keeps every thread: it says nothing of what speculation buys here
        print(
            f"{fewer} of {rounds} rounds ran at fewer threads than torch's {torch.get_num_threads()}, which measured "
            "faster: another process is probably busy on these cores, and part of the speedup is the thread count, "
            "not speculation (plain generate() keeps every thread)"
        )
    elif padded is not None and padded > result["tokens_per_second_plain"]:
        print(
            f"speedup over plain decoding through the same verify kernels (one-token steps, no drafts): "
            f"{result['speedup_vs_padded']:.2f}x ({padded:.1f} tok/s), what speculation itself buys here"
        )
    elif padded is not None:
        print(
            f"the verify kernels do not make plain steps faster on this CPU ({padded:.1f} tok/s), so the speedup "
            "above is what speculation itself buys"
        )
