"""`dspark-hf features`: a cache of the target's features for offline training (`training/features.py`)."""

from .checks import at_least, check_dataset, check_model_path
from .loading import load_target


def add_parser(subparsers):
    features = subparsers.add_parser(
        "features", help="cache target features for offline training (resumable; --dry-run)"
    )
    features.add_argument("--config", help="the training config (its target, drafter layers and data are used)")
    features.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config fields")
    features.add_argument("--data", help="token dataset (.npz); default: the config's `data`")
    features.add_argument("--out", help="cache folder (rerun to resume); default: the config's `features`")
    features.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    features.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    features.add_argument("--shard-tokens", type=int, default=65_536, help="tokens per shard file")
    features.add_argument("--sample-batches", type=int, default=3, help="--dry-run: timed target forwards")
    features.add_argument("--dry-run", action="store_true", help="print the cache size and build time; write nothing")
    return features


def run(args) -> int:
    from ..training.config import DSparkTrainingConfig
    from ..training.features import build_features, estimate_features
    from ..training.trainer import build_drafter

    at_least(args, 1, "batch_size", "shard_tokens", "sample_batches")
    config = DSparkTrainingConfig.from_file(args.config, args.set)
    data, out = args.data or config.data, args.out or config.features
    if not data or not out:
        raise ValueError("features needs a dataset (--data or `data` in the config) and --out (or `features`).")
    dataset = check_dataset(data, "--data")
    check_model_path(config.target, "target")
    target = load_target(config.target)[0].eval()
    layer_ids = build_drafter(config, target).config.target_layer_ids  # the layers training will read
    settings = dict(dtype=args.dtype, shard_tokens=args.shard_tokens, batch_size=args.batch_size)
    if args.dry_run:
        estimate = estimate_features(target, dataset, layer_ids, sample_batches=args.sample_batches, **settings)
        print(f"dry run, nothing written; layers {layer_ids}: {estimate.summary()}")
        return 0
    build_features(target, dataset, out, layer_ids, **settings)
    print(f"feature cache of {data} in {out}; train offline with --set features={out}")
    return 0
