"""Decode benchmark: time per generated token and cache memory.

Runs as ``keras-longattn decode-bench`` (a subcommand of its own, since its
options differ from ``bench``'s: contexts instead of lengths, no modes, no
layer configs), or from Python with :func:`run_decode_benchmark`.

For every backend, context and layer, a fresh subprocess (this module run
as ``python -m keras_longattn.benchmarks.decode '<json job>'``, through
:func:`keras_longattn.benchmarks.runner.run_job`, with its timeout and
memory guard) builds the layer, makes an empty cache for ``context``
positions and compiles one decode step: one new token at position
``context - 1`` (the cache full), the cache threaded from step to step
(``jax.jit`` with the cache donated; ``tf.function(jit_compile=True)`` on
TensorFlow; eager on torch). After the warm-up calls, the median over the
timed calls is the time per token. Cache memory is the sum of the bytes of
the cache tensors the layer actually returns.

Layers (:data:`LAYERS`): ``full``, ``local`` (a ring of the window),
``linear``, ``performer`` (recurrent states) and ``sparse`` (strided,
``block_length`` = the window) of this package; ``longformer`` (causal,
``window`` the window, the first :data:`LONGFORMER_GLOBAL_TOKENS` = 16
positions global: a ring of the window plus the global tokens); ``bigbird`` (causal,
``block_size`` = window / 4, 64 at the default window 256 as in the
paper, 3 window, 2 global and 3 random blocks); ``routing`` (causal token
routing, chunks of ``window`` members, :func:`routing_clusters` =
``round(sqrt(context))`` centroids per head, every head routing);
``synthesizer`` (``kind="dense+vanilla"``, ``max_length`` = the context);
and the peer
``hub_sliding_window``: keras-hub's ``CachedMultiHeadAttention`` with a
full-length cache and a dense sliding-window mask of width ``window``
(position ``p`` reads ``p - window < j <= p``), as keras-hub's Mistral
decodes. Without keras-hub installed (``pip install keras-longattn[hub]``)
its rows have status ``unavailable`` and the reason.

Ratios against ``full`` on the same backend and context and in the same
run: ``speedup`` = full time / layer time and ``cache_ratio`` = layer cache
bytes / full cache bytes; ``speedup_vs_peer`` = the peer's time / the
layer's time at the same context; ``growth`` = a layer's time per token at the
largest context / at the smallest. Results go to
``OUTPUT_DIR/decode-<time>.json`` and ``decode-latest.json`` with the
machine, the device, the backend and the package versions, and a table is
printed, followed by issue #31's criteria (:func:`decode_criteria`: Local
and Linear time per token at most 1.3x from the smallest to the largest
context, Local's cache at most window / context of Full's, Local at least
10x faster per token than the peer at 32K), each ``passed``, ``failed`` or
``not measured``. ``--write PATH`` also writes the committed form
(:func:`keras_longattn.benchmarks.decode_report.write_decode_results`, ``docs/benchmarks/decode.json``): the rows,
the criteria, the Markdown tables of ``docs/guides/decoding.md`` (made from
it by ``python -m keras_longattn.reproductions.pages --write``) and the
provenance record of the sources the workers imported.

Exit status: 0 when every row is ``ok``, ``unavailable``, ``oom``,
``timeout`` or ``skipped``, 1 when one is ``error``, 2 for invalid
arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from typing import Any, Sequence

from .command import _int_at_least
from .decode_layers import LAYERS
from .decode_layers import PEER
from .decode_layers import _build
from .decode_layers import _call
from .decode_layers import _init_cache
from .decode_layers import build_layer
from .decode_layers import decode_step_function
from .decode_layers import full_forward
from .decode_report import RESULTS_PATH
from .decode_report import decode_criteria
from .decode_report import write_decode_results

__all__ = [
    "DEFAULT_CONTEXTS",
    "parse_contexts",
    "parse_decode_layers",
    "check_step",
    "run_decode_config",
    "run_decode_benchmark",
    "format_table",
    "add_arguments",
    "run_from_args",
]

DEFAULT_LAYERS = LAYERS
DEFAULT_CONTEXTS = (1024, 8192, 32768, 131072)
BACKENDS = ("jax", "tensorflow", "torch")
DEFAULT_OUTPUT_DIR = os.path.join("build", "benchmarks")
#: Statuses that are results rather than failures of the benchmark.
RESULT_STATUSES = ("ok", "unavailable", "oom", "timeout", "skipped")


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------


def _parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = 1
    if text.endswith("k"):
        text, scale = text[:-1], 1024
    try:
        return int(text) * scale
    except ValueError:
        raise ValueError(f"expected an integer such as 8192 or 8k, got {text!r}") from None


def parse_contexts(value: str | Sequence[int], window: int | None = None) -> list[int]:
    """Context lengths from ``"1024,8k"`` or a sequence of integers.

    Raises:
        ValueError: naming ``contexts`` and the value, for an empty list, a
            non-integer, or a context below 2 or below ``window``.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        contexts = [_parse_size(str(item)) for item in items if str(item).strip()]
    except ValueError as exc:
        raise ValueError(f"`contexts`: {exc}. Received: contexts={value!r}") from None
    if not contexts:
        raise ValueError(f"`contexts` must name at least one context. Received: contexts={value!r}")
    for context in contexts:
        if context < 2:
            raise ValueError(f"Every context must be at least 2. Received: contexts={value!r}")
        if window is not None and context < window:
            raise ValueError(
                f"Every context must be at least the window ({window}), or the band "
                f"mask and the ring are not exercised. Received: contexts={value!r}"
            )
    return sorted(dict.fromkeys(contexts))


def parse_decode_layers(value: str | Sequence[str]) -> list[str]:
    """Layer names from ``"full,local"`` or a sequence; ``all`` = :data:`LAYERS`.

    Raises:
        ValueError: naming ``layers`` and the value for an unknown name.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(item).strip() for item in items if str(item).strip()]
    if names == ["all"]:
        return list(LAYERS)
    unknown = [name for name in names if name not in LAYERS]
    if unknown or not names:
        raise ValueError(
            f"`layers` must be names among {', '.join(LAYERS)} (or all). "
            f"Received: layers={value!r}" + (f" (unknown: {', '.join(unknown)})" if unknown else "")
        )
    return list(dict.fromkeys(names))


def _parse_backends(value: str | Sequence[str]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(item).strip() for item in items if str(item).strip()]
    bad = [name for name in names if name not in BACKENDS]
    if bad or not names:
        raise ValueError(f"`backends` must be names among {', '.join(BACKENDS)}. "
                         f"Received: backends={value!r}")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------------
# In the worker: the measured step and its check
# ---------------------------------------------------------------------------


def _nbytes(cache) -> int:
    import keras
    import numpy as np

    total = 0
    for tensor in keras.tree.flatten(cache):
        size = int(np.prod(tuple(int(s) for s in tensor.shape)))
        total += size * np.dtype(keras.backend.standardize_dtype(tensor.dtype)).itemsize
    return total


def _shapes(cache) -> list[list[int]]:
    import keras

    return [[int(s) for s in tensor.shape] for tensor in keras.tree.flatten(cache)]


def _device_name(backend: str) -> str:
    try:
        if backend == "jax":
            import jax

            device = jax.devices()[0]
            return f"{device.platform}:{getattr(device, 'device_kind', '')}"
        if backend == "tensorflow":
            import tensorflow as tf

            gpus = tf.config.list_logical_devices("GPU")
            return gpus[0].name if gpus else "cpu"
        import torch

        return f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"
    except Exception as exc:  # the device name is informative only
        return f"unknown ({type(exc).__name__})"


def _block(value) -> None:
    import keras

    keras.ops.convert_to_numpy(value)


def check_step(name: str, context: int, *, batch: int = 1, num_heads: int = 2,
               head_dim: int = 8, window: int = 16, seed: int = 0) -> dict[str, Any]:
    """Checks the benchmarked step: prefill ``context - 1`` random tokens in
    one cached call, run the compiled step on the last token at index
    ``context - 1``, and compare with the last row of the layer's forward
    pass over all ``context`` tokens (same weights). Runs in this process on
    the current backend; for small contexts.

    Returns:
        ``{"max_abs_error", "cache_bytes", "cache_shapes", "output_shape"}``.
    """
    import keras
    import numpy as np

    backend = keras.backend.backend()
    dim = num_heads * head_dim
    layer = build_layer(name, num_heads, head_dim, window, seed, context)
    x = np.random.default_rng(seed + 1).normal(size=(batch, context, dim)).astype("float32")
    expected = keras.ops.convert_to_numpy(full_forward(layer, name, x, window))[:, -1:]
    cache = _init_cache(layer, name, batch, context, num_heads, head_dim)
    _, cache = _call(layer, name, x[:, :-1], cache, 0, context, window)
    step, _ = decode_step_function(layer, name, context, window, backend)
    out, cache = step(keras.ops.convert_to_tensor(x[:, -1:]), cache,
                      keras.ops.convert_to_tensor(context - 1, "int32"))
    got = keras.ops.convert_to_numpy(out)
    return {
        "max_abs_error": float(np.max(np.abs(got - expected))),
        "cache_bytes": _nbytes(cache),
        "cache_shapes": _shapes(cache),
        "output_shape": list(got.shape),
    }


def run_decode_config(job: dict[str, Any]) -> dict[str, Any]:
    """Times one (layer, context) in this process; the worker's body.

    ``job`` has ``layer``, ``context``, ``backend``, ``batch``,
    ``num_heads``, ``head_dim``, ``window``, ``warmup``, ``repeats``,
    ``seed``. Returns the row (``status`` ``ok``, ``unavailable`` or
    ``error`` with ``message``).
    """
    from .worker import _is_oom

    result: dict[str, Any] = {k: job[k] for k in ("layer", "context", "backend")}
    name, context = job["layer"], int(job["context"])
    batch, heads, head_dim, window = (
        int(job[k]) for k in ("batch", "num_heads", "head_dim", "window"))
    stage = "import"
    try:
        import keras
        import numpy as np

        result["device"] = _device_name(job["backend"])
        stage = "build"
        try:
            layer = build_layer(name, heads, head_dim, window, int(job.get("seed", 0)),
                                context)
        except ImportError as exc:
            result.update(status="unavailable", message=f"keras-hub is not importable: {exc}")
            return result
        _build(layer, name, batch, heads * head_dim, window, int(job.get("seed", 0)))
        stage = "cache"
        cache = _init_cache(layer, name, batch, context, heads, head_dim)
        result["cache_bytes"] = _nbytes(cache)
        result["cache_shapes"] = _shapes(cache)
        step, compiled = decode_step_function(layer, name, context, window, job["backend"])
        result["compiled"] = compiled
        token = keras.ops.convert_to_tensor(
            np.random.default_rng(1).normal(size=(batch, 1, heads * head_dim)).astype("float32"))
        index = keras.ops.convert_to_tensor(context - 1, "int32")
        stage = "compile"
        start = time.perf_counter()
        out, cache = step(token, cache, index)
        _block(out)
        result["first_call_s"] = time.perf_counter() - start
        stage = "warmup"
        for _ in range(int(job["warmup"])):
            out, cache = step(token, cache, index)
            _block(out)
        stage = "timing"
        times = []
        for _ in range(int(job["repeats"])):
            start = time.perf_counter()
            out, cache = step(token, cache, index)
            _block(out)
            times.append(time.perf_counter() - start)
        if _nbytes(cache) != result["cache_bytes"]:
            raise RuntimeError(f"the cache changed size from {result['cache_bytes']} to "
                               f"{_nbytes(cache)} bytes during decoding")
        result["times_s"] = times
        result["time_per_token_s"] = statistics.median(times)
        result["status"] = "ok"
        result["modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "keras_longattn")
    except Exception as exc:  # reported as a row, like the bench worker
        oom = _is_oom(exc)
        result["status"] = "oom" if oom else "error"
        result["message"] = f"{stage}: {type(exc).__name__}: {str(exc)[:500]}"
    return result


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    full = {(r["backend"], r["context"]): r for r in rows
            if r["layer"] == "full" and r.get("status") == "ok"}
    for row in rows:
        base = full.get((row["backend"], row["context"]))
        if row.get("status") != "ok" or base is None:
            continue
        row["speedup"] = base["time_per_token_s"] / row["time_per_token_s"]
        row["cache_ratio"] = row["cache_bytes"] / base["cache_bytes"]
    peer = {(r["backend"], r["context"]): r for r in rows
            if r["layer"] == PEER and r.get("status") == "ok"}
    for row in rows:
        other = peer.get((row["backend"], row["context"]))
        if row.get("status") == "ok" and other is not None:
            row["speedup_vs_peer"] = other["time_per_token_s"] / row["time_per_token_s"]
    by_layer: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("status") == "ok":
            by_layer.setdefault((row["backend"], row["layer"]), []).append(row)
    for group in by_layer.values():
        group.sort(key=lambda r: r["context"])
        for row in group:
            row["growth"] = row["time_per_token_s"] / group[0]["time_per_token_s"]


def run_decode_benchmark(
    layers: Sequence[str] | str = DEFAULT_LAYERS,
    contexts: Sequence[int] | str = DEFAULT_CONTEXTS,
    backends: Sequence[str] | str | None = None,
    batch: int = 1,
    num_heads: int = 8,
    head_dim: int = 64,
    window: int = 256,
    warmup: int = 3,
    repeats: int = 20,
    timeout: float = 600.0,
    memory_limit_gb: float = 16.0,
    seed: int = 0,
    output_dir: str | None = DEFAULT_OUTPUT_DIR,
    in_process: bool = False,
    log=None,
) -> dict[str, Any]:
    """Runs every (backend, context, layer) and returns the report
    (``settings``, ``machine``, ``rows``, ``paths``).

    A layer that runs out of memory or time at one context is skipped at
    longer ones. ``in_process=True`` runs the jobs here (for tests; no
    timeout nor memory guard).

    Raises:
        ValueError: naming the argument and the value for unknown layers or
            backends, contexts below the window, sizes below 1.
    """
    from .runner import machine_info, memory_limit_bytes, run_job

    layers = parse_decode_layers(layers)
    for arg, value in (("batch", batch), ("num_heads", num_heads), ("head_dim", head_dim),
                       ("window", window), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{arg}` must be an integer >= 1. Received: {arg}={value!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"`warmup` must be an integer >= 0. Received: warmup={warmup!r}")
    contexts = parse_contexts(contexts, window)
    backends = _parse_backends(backends or os.environ.get("KERAS_BACKEND", "jax"))
    limit, _ = memory_limit_bytes(memory_limit_gb)
    settings = dict(layers=layers, contexts=contexts, backends=backends, batch=batch,
                    num_heads=num_heads, head_dim=head_dim, window=window, warmup=warmup,
                    repeats=repeats, timeout=timeout, memory_limit_gb=memory_limit_gb, seed=seed)
    rows: list[dict[str, Any]] = []
    for backend in backends:
        failed: dict[str, str] = {}
        for context in contexts:
            for layer in layers:
                job = dict(layer=layer, context=context, backend=backend, batch=batch,
                           num_heads=num_heads, head_dim=head_dim, window=window,
                           warmup=warmup, repeats=repeats, seed=seed)
                if layer in failed:
                    row = dict(job, status="skipped",
                               message=f"{failed[layer]} at a shorter context")
                elif in_process:
                    row = dict(job, **run_decode_config(job))
                else:
                    row = dict(job, **run_job(job, timeout, limit,
                                              module="keras_longattn.benchmarks.decode"))
                if row.get("status") in ("oom", "timeout"):
                    failed[layer] = row["status"]
                rows.append(row)
                if log is not None:
                    log(_row_line(row))
    _add_ratios(rows)
    modules = sorted({m for row in rows for m in row.pop("modules", None) or ()})
    machine = machine_info()
    machine["versions"]["keras_hub"] = _version("keras-hub")
    report = {"benchmark": "decode", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "settings": settings, "machine": machine, "rows": rows, "modules": modules,
              "paths": {}}
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for filename in (f"decode-{stamp}.json", "decode-latest.json"):
            path = os.path.join(output_dir, filename)
            report["paths"].setdefault("json", path)
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(report, handle, indent=1, default=repr)
    return report


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fmt(value: Any, scale: float = 1.0, digits: int = 3, suffix: str = "") -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value * scale:.{digits}g}{suffix}"


def _row_line(row: dict[str, Any]) -> str:
    return (f"{row['backend']} {row['layer']} context={row['context']}: {row.get('status')}"
            + (f" {_fmt(row.get('time_per_token_s'), 1e3)} ms/token" if row.get("status") == "ok"
               else f" ({row.get('message', '')})"))


def format_table(report: dict[str, Any]) -> str:
    """The rows as a plain-text table."""
    header = ("backend", "context", "layer", "status", "ms/token", "cache MiB",
              "speedup", "vs peer", "cache ratio", "growth", "device")
    lines = [header]
    for row in report["rows"]:
        lines.append((
            row["backend"], str(row["context"]), row["layer"], str(row.get("status")),
            _fmt(row.get("time_per_token_s"), 1e3), _fmt(row.get("cache_bytes"), 1 / (1 << 20)),
            _fmt(row.get("speedup"), suffix="x"), _fmt(row.get("speedup_vs_peer"), suffix="x"),
            _fmt(row.get("cache_ratio")),
            _fmt(row.get("growth"), suffix="x"), str(row.get("device", "-")),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
            for line in lines]
    notes = [f"{r['layer']} at {r['context']}: {r.get('message')}" for r in report["rows"]
             if r.get("status") not in ("ok", None)]
    return "\n".join(text + ([""] + notes if notes else []))


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _arg_type(parse, flag):
    def convert(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = flag
    return convert


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``decode-bench`` options to ``parser`` and return it."""
    parser.add_argument("--layers", type=_arg_type(parse_decode_layers, "layers"),
                        default=list(DEFAULT_LAYERS), metavar="NAMES",
                        help=f"comma-separated among {', '.join(LAYERS)}, or all (default all)")
    parser.add_argument("--contexts", type=_arg_type(parse_contexts, "contexts"),
                        default=list(DEFAULT_CONTEXTS), metavar="N,N",
                        help="comma-separated context lengths ('8k' = 8192); default "
                             + ",".join(map(str, DEFAULT_CONTEXTS)))
    parser.add_argument("--backends", type=_arg_type(_parse_backends, "backends"), default=None,
                        metavar="NAMES", help="among jax, tensorflow, torch; default "
                                              "$KERAS_BACKEND or jax")
    parser.add_argument("--batch", type=_int_at_least(1), default=1, help="batch size (1)")
    parser.add_argument("--heads", type=_int_at_least(1), default=8, help="heads (8)")
    parser.add_argument("--head-dim", type=_int_at_least(1), default=64, help="head size (64)")
    parser.add_argument("--window", type=_int_at_least(1), default=256,
                        help="window of local and of the peer's band mask, block length of "
                             "sparse (256)")
    parser.add_argument("--warmup", type=_int_at_least(0), default=3, help="untimed steps (3)")
    parser.add_argument("--repeats", type=_int_at_least(1), default=20,
                        help="timed steps; the median is reported (20)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="wall-clock limit per (layer, context) (600)")
    parser.add_argument("--memory-limit-gb", type=float, default=16.0, metavar="GIB",
                        help="kill a worker whose RSS exceeds this (16)")
    parser.add_argument("--seed", type=_int_at_least(0), default=0, help="random seed (0)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, metavar="DIR",
                        help=f"where decode-<time>.json goes ({DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--write", default=None, metavar="PATH",
                        help="also write the results with their provenance, issue #31's "
                             "criteria and the tables of docs/guides/decoding.md to PATH "
                             f"(the committed file is {RESULTS_PATH})")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run ``decode-bench`` from parsed arguments; returns the exit status."""
    try:
        report = run_decode_benchmark(
            layers=args.layers, contexts=args.contexts, backends=args.backends,
            batch=args.batch, num_heads=args.heads, head_dim=args.head_dim, window=args.window,
            warmup=args.warmup, repeats=args.repeats, timeout=args.timeout,
            memory_limit_gb=args.memory_limit_gb, seed=args.seed, output_dir=args.output_dir,
            log=None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True)),
        )
    except ValueError as exc:
        if parser is not None:
            parser.error(str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    print()
    for item in decode_criteria(report):
        print(f"{item['backend']} {item['name']}: {item['verdict']}: {item['measured']}")
    if "json" in report["paths"]:
        print(f"JSON: {report['paths']['json']}", file=sys.stderr)
    if getattr(args, "write", None):
        command = shlex.join(["keras-longattn", "decode-bench"] + sys.argv[2:]) \
            if sys.argv[1:2] == ["decode-bench"] else None
        print(f"results: {write_decode_results(report, args.write, command)}", file=sys.stderr)
    return 1 if any(r.get("status") not in RESULT_STATUSES for r in report["rows"]) else 0


def _worker_main(argv: Sequence[str]) -> int:
    """``python -m keras_longattn.benchmarks.decode '<json job>'``: one row,
    printed after the bench worker's result marker."""
    from .worker import RESULT_MARKER

    if len(argv) != 1:
        print("usage: python -m keras_longattn.benchmarks.decode '<json job>'", file=sys.stderr)
        return 2
    result = run_decode_config(json.loads(argv[0]))
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(result, default=repr), flush=True)
    return 0 if result["status"] in RESULT_STATUSES else 1


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
