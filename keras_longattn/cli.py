"""The ``keras-longattn`` command line.

Subcommands:

* ``bench``: time and peak memory of attention layers
  (:mod:`keras_longattn.benchmarks`).
* ``decode-bench``: time per generated token and cache memory of the
  cached layers and keras-hub's ``CachedMultiHeadAttention``
  (:mod:`keras_longattn.benchmarks.decode`).
* ``lra``: the offline Long-Range-Arena-style suite: accuracy, time per
  step and peak memory of attention layers on five tasks
  (:mod:`keras_longattn.lra`).

A subcommand is one ``add_<name>_command(subparsers)`` function, listed in
:data:`SUBCOMMANDS`, that adds its parser and sets the defaults ``handler`` (a
callable ``(args, parser) -> int`` returning the exit status) and
``command_parser`` (its parser, for ``parser.error``). Heavy imports belong inside the handler, so that
``keras-longattn --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

__all__ = ["SUBCOMMANDS", "add_bench_command", "add_decode_bench_command", "add_lra_command",
           "build_parser", "main"]


def add_bench_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``keras-longattn bench``: see :mod:`keras_longattn.benchmarks.command`."""
    from keras_longattn.benchmarks import command

    parser = subparsers.add_parser(
        "bench",
        help="time and peak memory of attention layers (one subprocess per configuration)",
        description="Benchmark keras_longattn attention layers: time and peak memory.",
        epilog=command.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_arguments(parser)
    parser.set_defaults(handler=command.run_from_args, command_parser=parser)
    return parser


def add_decode_bench_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``keras-longattn decode-bench``: see :mod:`keras_longattn.benchmarks.decode`."""
    from keras_longattn.benchmarks import decode

    parser = subparsers.add_parser(
        "decode-bench",
        help="time per generated token and cache memory (one subprocess per layer and context)",
        description=decode.__doc__.split("\n\n")[0] + " One-token decode steps with a cache, "
                    "per layer and context, against FullAttention and keras-hub's "
                    "CachedMultiHeadAttention with a dense sliding-window mask.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    decode.add_arguments(parser)
    parser.set_defaults(handler=decode.run_from_args, command_parser=parser)
    return parser


def add_lra_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``keras-longattn lra``: see :mod:`keras_longattn.lra.command`."""
    from keras_longattn.lra import command

    parser = subparsers.add_parser(
        "lra",
        help="offline LRA-style suite: accuracy, time per step and peak memory per layer",
        description="Train attention layers on five offline Long-Range-Arena-style tasks "
                    "and print accuracy per task, time per step and peak memory.",
        epilog=command.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_arguments(parser)
    parser.set_defaults(handler=command.run_from_args, command_parser=parser)
    return parser


from keras_longattn.reproduce import add_parser as add_reproduce_command  # noqa: E402

#: Functions adding one subcommand each, in the order ``--help`` lists them.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = [
    add_bench_command,
    add_decode_bench_command,
    add_lra_command,
    add_reproduce_command,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``keras-longattn`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="keras-longattn",
        description="Long-sequence attention layers for Keras 3: command-line tools.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``keras-longattn``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args, args.command_parser) or 0)


if __name__ == "__main__":
    sys.exit(main())
