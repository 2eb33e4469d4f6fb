"""`dspark-hf` command line: `demo`, `bench`, `data`, `features`, `train`, `export` and more, one module per command
(`add_parser(subparsers)` declares its options, `run(args)` runs it); `checks.py` holds the argument checks they share
and `loading.py` the model options and their loading.

User errors (bad arguments, missing or malformed files, an unreachable server) end as one line on stderr and exit
status 2, without a traceback; `--debug` or `DSPARK_DEBUG=1` shows it. Arguments and input files are checked before
any model loads. The process is ours, so glibc's malloc keeps freed memory for the next forward
(`kernels.allocator.keep_freed_memory`; `DSPARK_SYSTEM_MALLOC=1` leaves it as it is).
"""

import argparse
import os
import sys

from . import bench, calibrate, data, demo, export, features, profile, serve, train
from .profile import parse_lengths


COMMANDS = (demo, bench, serve, train, features, data, profile, calibrate, export)  # in the order --help lists them
# What a user's mistake raises (bad values, missing or unreadable files, refused connections, a missing package)
USER_ERRORS = (ValueError, OSError, ImportError)
DEBUG_HELP = "on an error, show the traceback instead of one line (also: DSPARK_DEBUG=1)"


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error rule: one line on stderr, exit status 2 (no usage block). Subcommand parsers are
    made by `add_subparsers` with the parent's class, so every command's parser is one too."""

    commands: dict = {}  # the root's: command name -> its parser

    def error(self, message: str):
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        """Unknown options are named by the command they were given to (argparse's root would claim them)."""
        args, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self.commands.get(getattr(args, "command", None), self)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args


def build_parser() -> argparse.ArgumentParser:
    """The root parser, with each command's subparser (`COMMANDS`), and `--debug` on the root and on each command."""
    parser = _Parser(
        prog="dspark-hf",
        description="DSpark speculative decoding for transformers.",
        epilog="Errors are one line; --debug (or DSPARK_DEBUG=1) shows the traceback.",
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub).set_defaults(func=command.run)
    parser.commands = dict(sub.choices)
    for command in sub.choices.values():  # `dspark-hf bench ... --debug` as well as `dspark-hf --debug bench ...`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def _debug(args) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("DSPARK_DEBUG", "").strip() not in ("", "0")


def main(argv=None) -> int:
    """Run one command; a user error prints one line on stderr and returns 2 (`--debug` / DSPARK_DEBUG=1: raise)."""
    args = build_parser().parse_args(argv)
    from ..kernels.allocator import keep_freed_memory

    keep_freed_memory()  # a long prompt's prefill without millions of page faults (this process only)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if _debug(args):
            raise
        print(f"dspark-hf {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if _debug(args):
            raise
        message = str(err) or type(err).__name__
    print(f"dspark-hf {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


__all__ = ["build_parser", "main", "parse_lengths"]
