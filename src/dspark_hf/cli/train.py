"""`dspark-hf train`: a DSpark drafter trained online against its target, or offline from a feature cache."""

from pathlib import Path

from .checks import at_least, check_dataset, check_file, check_model_path, require
from .loading import load_target


def add_parser(subparsers):
    train = subparsers.add_parser("train", help="train a DSpark drafter (online, or offline from a feature cache)")
    train.add_argument("--config", help="training config (JSON or YAML); see DSparkTrainingConfig")
    train.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config fields")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a non-empty output_dir: it replaces the earlier run there once it has its first "
        "checkpoint (without --resume or --overwrite, a non-empty output_dir is refused)",
    )
    train.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after N more steps")
    return train


def run(args) -> int:
    from ..training.config import DSparkTrainingConfig
    from ..training.trainer import DSparkTrainer, check_output_dir, check_resume

    at_least(args, 1, "stop_after")
    config = DSparkTrainingConfig.from_file(args.config, args.set)
    require(bool(config.data), "train needs a token dataset: --set data=FILE.npz (from `dspark-hf data`).")
    _check_paths(config)
    check_output_dir(config.output_dir, args.resume, args.overwrite)  # an earlier run is never trained over
    if args.resume:
        check_resume(config)  # a refused change or damaged checkpoints fail before the target loads
    target, _ = load_target(config.target)
    trainer = DSparkTrainer(config, target)
    drafter = trainer.train(resume=args.resume, stop_after=args.stop_after, overwrite=args.overwrite)
    print(f"step {trainer.step}/{config.max_steps}; checkpoints in {config.output_dir}")
    return 0 if drafter is not None else 1


def _check_paths(config) -> None:
    """The files and folders a training config names must exist before the target loads."""
    check_model_path(config.target, "target")
    check_model_path(config.init_drafter, "init_drafter", drafter=True)
    check_file(config.drafter_config, "drafter_config")
    for key in ("data", "heldout"):
        if getattr(config, key):
            check_dataset(getattr(config, key), key)
    if config.features is not None and not Path(config.features).is_dir():
        raise FileNotFoundError(
            f"features {config.features}: no such feature cache; build it with `dspark-hf features`."
        )
