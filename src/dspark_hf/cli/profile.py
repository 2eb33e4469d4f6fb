"""`dspark-hf profile`: the target's verify steps per second at each verify size, the SPS profile Algorithm 1
weighs drafts against (`decoding/profiling.py`)."""

from pathlib import Path

import torch

from .checks import at_least, check_device, check_model_path, int_list
from .loading import QUANTIZE_CHOICES, TARGET_HELP, load_target, quantized


def add_parser(subparsers):
    profile = subparsers.add_parser(
        "profile", help="measure target verify steps/s per verify size (Algorithm 1's SPS)"
    )
    profile.add_argument("--target", help=TARGET_HELP)
    profile.add_argument("--max-tokens", type=int, default=16, help="profile verify batches of 1..N tokens")
    profile.add_argument(
        "--lengths",
        default=None,
        help="profile these verify sizes instead, e.g. 1-16,24,32,64,128 (an engine with batch b and block γ "
        "verifies up to b·(γ+1) tokens; sizes in between are looked up at the next profiled one)",
    )
    profile.add_argument("--context-len", type=int, default=256, help="prefilled KV cache length")
    profile.add_argument("--repeats", type=int, default=5, help="timed runs per size (median taken)")
    profile.add_argument("--device", default=None, help="where the target runs (default: cuda if available, else cpu)")
    profile.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    profile.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None, help="as for bench")
    profile.add_argument("--out", default="sps_profile.json")
    profile.add_argument(
        "--png", default=None, help="plot path (default: beside --out, as .png; '' for none; needs matplotlib)"
    )
    return profile


def parse_lengths(text: str) -> list[int]:
    """`profile --lengths`: "1-16,24,32" -> [1, ..., 16, 24, 32] (`int_list`), sorted, deduplicated, all >= 1."""
    try:
        lengths = int_list(text)
    except ValueError:
        raise ValueError(f"--lengths {text!r} is not a list of token counts and ranges like 1-16,24,32.") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths {text!r} must name token counts >= 1, e.g. 1-16,24,32,64.")
    return sorted(set(lengths))


def run(args) -> int:
    from ..decoding.profiling import plot_profile, profile_target, save_profile

    # before the target loads: a typo fails at once
    at_least(args, 1, "max_tokens", "context_len", "repeats")
    lengths = parse_lengths(args.lengths) if args.lengths else range(1, args.max_tokens + 1)
    device = check_device(args.device)
    check_model_path(args.target, "--target")
    target, _ = load_target(args.target, getattr(torch, args.dtype))
    target = quantized(target.eval().to(device), args)
    profile = profile_target(target, lengths=lengths, context_len=args.context_len, repeats=args.repeats)
    save_profile(profile, args.out)
    _print_profile(profile)
    print(f"wrote {args.out} (put it in the drafter checkpoint's folder for verify_policy='scheduler')")
    png = str(Path(args.out).with_suffix(".png")) if args.png is None else args.png
    if png:
        try:
            plot_profile(profile, png)
            print(f"wrote {png}")
        except ImportError as e:
            print(f"no plot: {e}")
    return 0


def _print_profile(profile: dict) -> None:
    """The machine, the linears' way per row count, and measured / padded ms and steps/s per verify size."""
    threads, context = profile["torch_threads"], profile["context_len"]
    machine = profile.get("cpu", profile["device"])
    print(f"{machine} ({profile['dtype']}, {threads} threads), verify on a cache of {context} tokens")
    kernels = profile.get("kernels")
    if kernels:  # the machine's way for the target's linears, per row count (kernels/verify_linears.py)
        print("linears per row count (way, padded to rows; ms of one pass over the target's linears per way):")
        for rows, (way, pad) in kernels["choice"].items():
            times = "  ".join(f"{w} {t[rows]:.1f}" for w, t in kernels["ms"].items() if rows in t)
            print(f"{rows:>4} {way:>8} {pad:>3}   {times}")
    floor = profile.get("floor")
    if floor:  # reading every weight once: what no step can beat
        print(
            f"memory floor: {floor['weight_bytes'] / 1e6:.0f} MB of weights at {floor['read_gb_per_s']:.1f} GB/s "
            f"read = {floor['ms']:.2f} ms a step"
        )
    rows = sorted((int(b), v) for b, v in profile["sps"].items())
    one = profile["verify_ms_measured"][str(rows[0][0])]
    # padded: the cheapest width >= B; x floor and x first: the measured ms over the floor and over the narrowest
    header = f"{'B':>4} {'measured ms':>12} {'padded ms':>10} {'steps/s':>9}"
    print(header + (f" {'x floor':>8}" if floor else "") + f" {f'x B={rows[0][0]}':>8}")
    for tokens, sps in rows:
        key = str(tokens)
        measured = profile["verify_ms_measured"][key]
        line = f"{tokens:>4} {measured:>12.2f} {profile['verify_ms'][key]:>10.2f} {sps:>9.1f}"
        print(line + (f" {measured / floor['ms']:>8.2f}" if floor else "") + f" {measured / one:>8.2f}")
