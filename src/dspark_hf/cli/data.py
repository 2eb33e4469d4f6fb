"""`dspark-hf data`: a drafter training set, the target's own answers to prompts plus plain text
(`training/generate_data.py`), built in resumable chunks."""

import json
from pathlib import Path

import torch

from .checks import at_least, check_device, check_file, check_model_path, require
from .loading import TARGET_HELP, load_target


def add_parser(subparsers):
    data = subparsers.add_parser(
        "data", help="build a drafter training set: target-regenerated responses + plain text"
    )
    data.add_argument("--out", required=True, help="output folder (rerun with the same arguments to resume)")
    data.add_argument("--target", help=TARGET_HELP)
    data.add_argument("--num-prompts", type=int, default=2000, help="prompts to answer with the target")
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--batch-size", type=int, default=16)
    data.add_argument("--chunk-size", type=int, default=None, help="prompts per resumable chunk (4 x batch size)")
    data.add_argument(
        "--sources",
        default="chat,math,code,text",
        help="comma-separated prompt sources: chat, math, code, text, and the opt-in human (people's own questions: "
        "FAQs and ShareGPT first turns; see docs/data.md)",
    )
    data.add_argument("--teacher-forced-tokens", type=int, default=0, help="tokens of plain text (no generation)")
    data.add_argument("--exclude-eval", nargs="*", default=[], metavar="FILE", help="eval JSONL files to keep out")
    data.add_argument("--heldout-fraction", type=float, default=0.05)
    data.add_argument("--sample", action="store_true", help="sample with the target's recommended settings")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--max-chunks", type=int, default=None, help="stop after N more chunks (resume later)")
    data.add_argument("--device", help="where the target generates (default: cuda when available, else cpu)")
    data.add_argument("--finalize", action="store_true", help="only merge the finished chunks into train/heldout")
    return data


def run(args) -> int:
    import logging as pylogging

    from ..training.generate_data import DataConfig, build_dataset, finalize_dataset

    at_least(args, 1, "num_prompts", "max_new_tokens", "batch_size", "chunk_size")
    at_least(args, 0, "teacher_forced_tokens", "max_chunks")
    require(0 <= args.heldout_fraction < 1, f"--heldout-fraction must lie in [0, 1), got {args.heldout_fraction}.")
    if args.device is not None:
        check_device(args.device)
    for path in args.exclude_eval:
        check_file(path, "--exclude-eval")
    check_model_path(args.target, "--target")
    log = pylogging.getLogger("dspark_hf")
    if not log.handlers:
        log.addHandler(pylogging.StreamHandler())
    log.setLevel(pylogging.INFO)
    if args.finalize:
        finalize_dataset(args.out)
    else:
        config = DataConfig(
            num_prompts=args.num_prompts,
            sources=tuple(s.strip() for s in args.sources.split(",") if s.strip()),
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            chunk_size=args.chunk_size or 4 * args.batch_size,
            teacher_forced_tokens=args.teacher_forced_tokens,
            heldout_fraction=args.heldout_fraction,
            seed=args.seed,
            do_sample=args.sample,
            exclude_eval=tuple(args.exclude_eval),
            target=args.target or "default",
        )
        target, tokenizer = load_target(args.target, with_tokenizer=True)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        build_dataset(target.eval().to(device), tokenizer, args.out, config, max_chunks=args.max_chunks)
    _summary(args.out)
    return 0


def _summary(out) -> None:
    """One line of the dataset's stats.json (sequences and tokens, complete or how far), if it has one yet."""
    stats_path = Path(out) / "stats.json"
    if stats_path.exists():
        stats = json.loads(stats_path.read_text())
        state = "complete" if stats["complete"] else f"partial: {stats['chunks_done']}/{stats['num_chunks']} chunks"
        print(
            f"{out}: train {stats['train_sequences']} sequences / {stats['train_tokens']} tokens, held-out "
            f"{stats['heldout_sequences']} / {stats['heldout_tokens']} ({state}); "
            f"{stats['generated_tokens_per_second']} generated tok/s"
        )
