"""The ``bench`` command line, shared by ``keras-longattn bench`` and
``python -m keras_longattn.benchmarks``.

Exit status: 0 when every configuration ran or ended in ``oom``, ``timeout``
or ``skipped`` (those are results), 1 when one ended in ``error``, 2 for
invalid arguments, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from keras_longattn.specs import registry
from keras_longattn.specs.arguments import argument_type, parse_layers, parse_option
from keras_longattn.specs.progress import make_progress

from . import peers
from .config import (
    MODES,
    BenchmarkArgumentError,
    default_backend,
    parse_backends,
    parse_lengths,
    parse_modes,
)
from .efficiency import format_efficiency
from .report import print_table
from .runner import DEFAULT_OUTPUT_DIR, run_benchmark

__all__ = ["add_arguments", "run_from_args", "build_parser", "main"]

EPILOG = """\
Layers: a registered short name (see --list-layers), a class reference
('keras_longattn>LocalAttention', 'my_package.layers:MyAttention') or a Keras
layer config as JSON (also the keras.saving.serialize_keras_object form, or
@file.json); --layers may be repeated. A config value "${...}" is evaluated
per configuration (variables seq_len, batch, num_heads, key_dim, window).
num_heads and key_dim come from --heads and --head-dim unless the config sets
them (to the same values). An option that a layer's constructor does not
accept is an error.

A layer config is code: a class reference 'PACKAGE.MODULE:CLASS' or
'PACKAGE>CLASS', or a config with a "module" entry, makes the benchmark import
that module (here and in every worker), which runs whatever it contains. Pass
only configs and @files from sources you trust. "${...}" values are not
Python: arithmetic on those variables only, every integer within +-2**64.

Every configuration runs in a fresh subprocess. Reported: the median of the
timed calls, the peak memory (increase of the worker's peak RSS over the RSS
after the inputs and the layer are built; device allocator peak on GPUs), and
ratios against the baseline layer on the same backend, length and mode:
speed-up = baseline time / layer time, memory ratio = layer peak / baseline
peak. A layer that runs out of memory or time at length n is skipped at longer
lengths. Results go to OUTPUT_DIR/bench-<time>.json/.csv and latest.json/.csv.

examples:
  keras-longattn bench --layers full,local --lengths 4096,16384 \\
      --backends jax,torch --window 256 --modes fwdbwd
  keras-longattn bench --lengths 4096 --layers \\
      '{"class_name": "LocalAttention", "config": {"window": 128, "dropout": 0.1}}'
  keras-longattn bench --layers full,routing --option routing.num_clusters=32
"""


def _int_at_least(minimum: int):
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    convert.__name__ = "integer"
    return convert


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _peer_names(text: str) -> str:
    try:
        peers.peer_specs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` options to ``parser`` and return it."""
    known = ", ".join(registry.available_layers())
    what = parser.add_argument_group("what to measure")
    what.add_argument("--layers", type=argument_type(parse_layers, "--layers"),
                      action="extend", default=None, metavar="LAYERS",
                      help=f"comma-separated short names (known: {known}), class references "
                           "(PACKAGE>CLASS, PACKAGE.MODULE:CLASS), or a Keras layer config as "
                           "JSON or @FILE.json; repeatable; default full,local")
    what.add_argument("--peers", nargs="?", const="all", default=None, metavar="PEERS",
                      type=_peer_names,
                      help="also run public PyTorch peers, all or the comma-separated "
                           f"ones ({', '.join(peers.PEERS)}); torch only, installed "
                           "separately: a peer that is not importable is reported as "
                           "skipped")
    what.add_argument("--lengths", type=argument_type(parse_lengths, "--lengths"),
                      default=[1024, 4096], metavar="N,N",
                      help="comma-separated sequence lengths ('16k' = 16384); default 1024,4096")
    what.add_argument("--backends", type=argument_type(parse_backends, "--backends"),
                      default=None, metavar="NAMES",
                      help="comma-separated among jax, tensorflow, torch; default "
                           f"$KERAS_BACKEND or jax (now: {default_backend()})")
    what.add_argument("--modes", type=argument_type(parse_modes, "--modes"),
                      default=list(MODES), metavar="MODES",
                      help="fwd (forward) and/or fwdbwd (forward+backward); default both")
    what.add_argument("--batch", type=_int_at_least(1), default=1, help="batch size B (1)")
    what.add_argument("--heads", type=_int_at_least(1), default=4, help="number of heads H (4)")
    what.add_argument("--head-dim", type=_int_at_least(1), default=64,
                      help="size d of each head (64); inputs are (B, n, H*d)")
    what.add_argument("--window", type=_int_at_least(1), default=256,
                      help="value of \"${window}\" in layer configs: the window of the "
                           "short name local (256)")
    what.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                      help="causal attention (default: causal)")
    what.add_argument("--scope", choices=("layer", "attention"), default="layer",
                      help="what is timed: the whole layer, projections included "
                           "(default), or only the attention between the projections "
                           "(BaseAttention.attend on projected heads; keras_longattn "
                           "layers only)")
    what.add_argument("--efficiency", action="store_true",
                      help="also time a 4096x4096 float32 matmul in every worker and "
                           "report each row's useful-FLOP throughput as a fraction of it "
                           "(keras_longattn.benchmarks.efficiency)")
    what.add_argument("--no-settle-allocator", dest="settle_allocator", action="store_false",
                      help="time with glibc's malloc as a fresh small process has it, "
                           "which gives freed memory back to the system between calls "
                           "(default: settle it first, as in a process with large "
                           "tensors; keras_longattn.benchmarks.worker.settle_allocator)")
    what.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                      type=argument_type(parse_option, "--option"),
                      help="layer constructor argument set in the layer configs, "
                           "repeatable; LAYER.NAME applies to the layer labelled LAYER "
                           "(e.g. local.window=128), a bare NAME to every layer; a layer "
                           "whose constructor does not accept NAME is an error")
    what.add_argument("--baseline", default="full", metavar="LAYER",
                      help="layer the ratios compare with: a label of --layers, or a layer "
                           "given like them, added when missing (full)")
    what.add_argument("--no-baseline", dest="baseline", action="store_const", const=None,
                      help="no baseline layer and no ratio columns")

    how = parser.add_argument_group("how to measure")
    how.add_argument("--repeats", type=_int_at_least(1), default=5,
                     help="timed calls per configuration; the median is reported (5)")
    how.add_argument("--warmup", type=_int_at_least(0), default=1,
                     help="untimed calls first; the first one compiles (1)")
    how.add_argument("--timeout", type=_positive_float, default=600.0, metavar="SECONDS",
                     help="wall-clock limit per configuration (600)")
    how.add_argument("--memory-limit-gb", type=_positive_float, default=16.0, metavar="GIB",
                     help="kill a worker whose RSS exceeds this: status oom (16)")
    how.add_argument("--tf-jit", action=argparse.BooleanOptionalAction, default=True,
                     help="XLA-compile the TensorFlow tf.function (default: on)")
    how.add_argument("--seed", type=_int_at_least(0), default=0, help="random seed (0)")

    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, metavar="DIR",
                     help=f"where the JSON and CSV reports go ({DEFAULT_OUTPUT_DIR})")
    out.add_argument("--quiet", action="store_true", help="no progress display")
    out.add_argument("--plain", action="store_true",
                     help="plain text output even when rich is installed")
    out.add_argument("--list-layers", action="store_true",
                     help="list the registered layers and exit")
    return parser


def _list_layers() -> int:
    for name in registry.available_layers():
        entry = registry.get_entry(name)
        description = f"{entry.description}: " if entry.description else ""
        print(f"{name:<15} {description}{json.dumps(entry.config)}")
    return 0


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run the ``bench`` command from parsed arguments; returns the exit status."""
    if args.list_layers:
        return _list_layers()
    use_rich = False if args.plain else None
    try:
        results = run_benchmark(
            layers=(args.layers if args.layers is not None else ["full", "local"])
            + (peers.peer_specs(args.peers) if args.peers else []),
            lengths=args.lengths,
            backends=args.backends,
            modes=args.modes,
            batch=args.batch,
            num_heads=args.heads,
            head_dim=args.head_dim,
            window=args.window,
            causal=args.causal,
            scope=args.scope,
            repeats=args.repeats,
            warmup=args.warmup,
            timeout=args.timeout,
            memory_limit_gb=args.memory_limit_gb,
            options=dict(args.option),
            tf_jit=args.tf_jit,
            baseline=args.baseline,
            seed=args.seed,
            output_dir=args.output_dir,
            progress=make_progress(not args.quiet, use_rich=use_rich),
            efficiency=args.efficiency,
            settle_allocator=args.settle_allocator,
        )
    except BenchmarkArgumentError as exc:
        if parser is not None:
            parser.error(f"argument {exc.flag}: {exc.detail}")
        print(f"error: argument {exc.flag}: {exc.detail}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        partial = getattr(interrupt, "results", None)
        if partial is not None:
            print_table(partial, file=sys.stdout, use_rich=use_rich)
        print("interrupted", file=sys.stderr)
        return 130
    if results.paths:
        from . import record

        record.annotate(results, results.metadata)
        record.rewrite(results, results.paths)
    print_table(results, file=sys.stdout, use_rich=use_rich)
    if args.efficiency:
        print("\n" + format_efficiency(results), file=sys.stdout)
    for key in ("json", "csv"):
        if key in results.paths:
            print(f"{key.upper()}: {results.paths[key]}", file=sys.stderr)
    return 1 if any(row.get("status") == "error" for row in results) else 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """A standalone parser for ``python -m keras_longattn.benchmarks``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark keras_longattn attention layers: time and peak memory.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return add_arguments(parser)


def main(argv: Sequence[str] | None = None, prog: str = "python -m keras_longattn.benchmarks") -> int:
    """Entry point of ``python -m keras_longattn.benchmarks``."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    return run_from_args(args, parser)
