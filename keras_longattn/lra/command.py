"""The ``keras-longattn lra`` command line, a thin wrapper of
:func:`keras_longattn.lra.run_suite`.

Exit status: 0 when every (layer, task, seed) trained, 1 when one failed
(``error``, ``oom`` or ``timeout``; the table shows which), 2 for invalid
arguments, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys

from keras_longattn.specs import registry
from keras_longattn.specs.arguments import ArgumentError, argument_type, parse_option
from keras_longattn.specs.progress import make_progress

from .report import SPREADS
from .runner import DEFAULT_OUTPUT_DIR, parse_seeds, parse_tasks, run_suite
from .tasks import OVERRIDABLE, SIZES, TASKS

__all__ = ["EPILOG", "add_arguments", "run_from_args"]

EPILOG = """\
Tasks (offline stand-ins for LRA's, far smaller): listops, text, retrieval,
image, pathfinder (see --list-tasks). Every model has 2 layers, embedding 64,
feed-forward 128 and 2 heads (a layer config setting num_heads keeps it);
every (layer, task) trains in a fresh subprocess, one model per seed.

Layers are given as for `keras-longattn bench`: registered short names
(all: every one), 'package>Class', 'package.module:Class', or a Keras layer
config as JSON or @FILE.json. In configs "${seq_len}", "${window}" (n/8 per
task unless --window), "${num_heads}" and "${key_dim}" are evaluated per task.
An option a layer's constructor does not accept is an error.

The table: accuracy in % per task (mean ± sample std over the seeds, or
--spread range for [min-max]), the average, the median training step in ms
(averaged over the tasks), the peak memory increase in MiB (largest over the
tasks) and ratios against full (else the first layer). Reports go to
OUTPUT/lra-<size>-<time>.json/.csv and OUTPUT/latest.json/.csv.

examples:
  keras-longattn lra --size ci --layers full --seeds 1
  keras-longattn lra --size full --layers full,local,routing --seeds 3
  keras-longattn lra --tasks listops,image --layers \\
      '{"class_name": "LocalAttention", "config": {"window": 16}}'
"""


def _override(text: str):
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or name not in OVERRIDABLE:
        raise argparse.ArgumentTypeError(
            f"expected NAME=VALUE with NAME among {', '.join(OVERRIDABLE)}, got {text!r}")
    try:
        value = float(raw) if name in ("learning_rate", "dropout") else int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value in {text!r}") from None
    return name, value


def _positive(kind):
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``lra`` options to ``parser`` and return it."""
    known = ", ".join(registry.available_layers())
    what = parser.add_argument_group("what to run")
    what.add_argument("--layers", action="append", default=None, metavar="LAYERS",
                      help=f"comma-separated short names (known: {known}; all: every one), "
                           "class references, or a Keras layer config as JSON or "
                           "@FILE.json; repeatable; default full")
    what.add_argument("--tasks", type=argument_type(parse_tasks, "--tasks"), default=None,
                      metavar="TASKS",
                      help=f"comma-separated among {', '.join(TASKS)}; default all")
    what.add_argument("--seeds", type=argument_type(parse_seeds, "--seeds"), default=[0],
                      metavar="N|S,S",
                      help="number of seeds (3: seeds 0,1,2) or a comma-separated list; "
                           "default 1")
    what.add_argument("--size", choices=SIZES, default="ci",
                      help="tiny (seconds, for tests), ci (a few minutes for one layer) "
                           "or full (several minutes per task and layer); default ci")
    what.add_argument("--backend", default=None, metavar="NAME",
                      help="jax, tensorflow or torch; default $KERAS_BACKEND or jax")
    what.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                      type=argument_type(parse_option, "--option"),
                      help="layer constructor argument, repeatable; LAYER.NAME for one layer")
    what.add_argument("--window", type=_positive(int), default=None,
                      help='value of "${window}" in layer configs (default n/8 per task)')
    what.add_argument("--set", dest="overrides", action="append", default=[],
                      type=_override, metavar="NAME=VALUE",
                      help=f"override every task's size: {', '.join(OVERRIDABLE)} "
                           "(e.g. --set steps=50), repeatable")

    how = parser.add_argument_group("limits and output")
    how.add_argument("--timeout", type=_positive(float), default=3600.0, metavar="SECONDS",
                     help="wall-clock limit per (layer, task) subprocess (3600)")
    how.add_argument("--memory-limit-gb", type=_positive(float), default=16.0, metavar="GIB",
                     help="kill a subprocess whose RSS exceeds this: status oom (16)")
    how.add_argument("--output", default=DEFAULT_OUTPUT_DIR, metavar="DIR",
                     help=f"directory of the JSON and CSV reports ({DEFAULT_OUTPUT_DIR})")
    how.add_argument("--spread", choices=SPREADS, default="std",
                     help="spread over seeds in the table: std (sample standard "
                          "deviation, default) or range (min-max)")
    how.add_argument("--quiet", action="store_true", help="no progress lines")
    how.add_argument("--plain", action="store_true",
                     help="plain text progress even when rich is installed")
    how.add_argument("--list-tasks", action="store_true",
                     help="list the tasks and their sizes and exit")
    return parser


def _list_tasks() -> int:
    for task in TASKS.values():
        print(f"{task.name:<11} {task.description} ({task.num_classes} classes; "
              f"LRA length {task.lra_seq_len})")
        for name, size in task.sizes.items():
            print(f"    {name:<5} n={size.seq_len}, {size.train_examples} train / "
                  f"{size.test_examples} test, {size.steps} steps of {size.batch_size}, "
                  f"lr {size.learning_rate:g}, dropout {size.dropout:g}")
    return 0


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run the ``lra`` command from parsed arguments; returns the exit status."""
    if args.list_tasks:
        return _list_tasks()
    try:
        results = run_suite(
            layers=args.layers if args.layers else "full",
            tasks=args.tasks,
            seeds=args.seeds,
            size=args.size,
            backend=args.backend,
            options=dict(args.option),
            overrides=dict(args.overrides),
            window=args.window,
            timeout=args.timeout,
            memory_limit_gb=args.memory_limit_gb,
            output_dir=args.output,
            progress=make_progress(not args.quiet, use_rich=False if args.plain else None),
        )
    except ArgumentError as exc:
        if parser is not None:
            parser.error(f"argument {exc.flag}: {exc.detail}")
        print(f"error: argument {exc.flag}: {exc.detail}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        partial = getattr(interrupt, "results", None)
        if partial is not None and len(partial):
            print(partial.table(spread=args.spread))
        print("interrupted", file=sys.stderr)
        return 130
    print(results.table(spread=args.spread))
    for key in ("json", "csv"):
        if key in results.paths:
            print(f"{key.upper()}: {results.paths[key]}", file=sys.stderr)
    return 1 if any(row.get("status") != "ok" for row in results) else 0
