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
(:func:`write_decode_results`, ``docs/benchmarks/decode.json``): the rows,
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
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .command import _int_at_least

__all__ = [
    "LAYERS",
    "PEER",
    "DEFAULT_CONTEXTS",
    "parse_contexts",
    "parse_decode_layers",
    "build_layer",
    "routing_clusters",
    "decode_step_function",
    "check_step",
    "run_decode_config",
    "run_decode_benchmark",
    "format_table",
    "decode_criteria",
    "criteria_table",
    "results_table",
    "write_decode_results",
    "add_arguments",
    "run_from_args",
]

#: The peer: keras-hub's cached multi-head attention with a dense band mask.
PEER = "hub_sliding_window"
#: Layers this benchmark knows, in report order.
LAYERS = ("full", "local", "linear", "performer", "sparse", "longformer", "bigbird", "routing",
          "synthesizer", PEER)
#: Global tokens of the ``longformer`` layer (the first positions).
LONGFORMER_GLOBAL_TOKENS = 16
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
# In the worker: the layer, its step, its check
# ---------------------------------------------------------------------------


def routing_clusters(context: int) -> int:
    """Centroids per head of the ``routing`` layer at ``context`` positions:
    ``max(1, round(sqrt(context)))``, the Routing Transformer's choice
    (O(n^1.5) for its forward pass)."""
    return max(1, round(context ** 0.5))


def build_layer(name: str, num_heads: int, head_dim: int, window: int, seed: int = 0,
                context: int | None = None):
    """An unbuilt layer for ``name`` (one of :data:`LAYERS`).

    ``context`` is the number of positions the layer decodes to: the
    ``routing`` layer's number of centroids (:func:`routing_clusters`) and
    the ``synthesizer``'s ``max_length`` (its dense projection has one
    output per position) depend on it; the other layers ignore it.

    Raises:
        ValueError: for an unknown ``name``, or no ``context`` for
            ``routing`` and ``synthesizer``.
        ImportError: for the peer when keras-hub is not installed.
    """
    import keras

    keras.utils.set_random_seed(seed)
    if name == PEER:
        import keras_hub

        return keras_hub.layers.CachedMultiHeadAttention(num_heads=num_heads, key_dim=head_dim)
    from keras_longattn import layers

    if name == "full":
        return layers.FullAttention(num_heads=num_heads, key_dim=head_dim)
    if name == "local":
        return layers.LocalAttention(num_heads=num_heads, key_dim=head_dim, window=window)
    if name == "linear":
        return layers.LinearAttention(num_heads=num_heads, key_dim=head_dim)
    if name == "performer":
        return layers.PerformerAttention(num_heads=num_heads, key_dim=head_dim, seed=seed)
    if name == "sparse":
        return layers.SparseAttention(num_heads=num_heads, key_dim=head_dim, pattern="strided",
                                      block_length=window)
    if name == "longformer":
        return layers.LongformerAttention(num_heads=num_heads, key_dim=head_dim, window=window,
                                          global_tokens=LONGFORMER_GLOBAL_TOKENS)
    if name == "bigbird":
        return layers.BigBirdAttention(num_heads=num_heads, key_dim=head_dim,
                                       block_size=max(1, window // 4), seed=seed)
    if name in ("routing", "synthesizer") and (not isinstance(context, int) or context < 2):
        raise ValueError(f"`context` must be an integer >= 2 for the {name} layer. "
                         f"Received: context={context!r}")
    if name == "routing":
        return layers.RoutingAttention(num_heads=num_heads, key_dim=head_dim, window=window,
                                       num_clusters=routing_clusters(context),
                                       causal_routing="token", seed=seed)
    if name == "synthesizer":
        return layers.SynthesizerAttention(num_heads=num_heads, key_dim=head_dim,
                                           kind="dense+vanilla", max_length=context)
    raise ValueError(f"`name` must be one of {', '.join(LAYERS)}. Received: name={name!r}")


def band_mask(batch: int, query_start, query_length: int, context: int, window: int):
    """keras-hub's dense sliding-window mask, ``(batch, query_length,
    context)``: query ``i`` (position ``query_start + i``) reads key ``j``
    when ``p - window < j <= p``; ``query_start`` may be a traced scalar."""
    from keras import ops

    positions = ops.arange(query_length, dtype="int32") + ops.cast(query_start, "int32")
    rows = ops.expand_dims(positions, 1)
    cols = ops.expand_dims(ops.arange(context, dtype="int32"), 0)
    mask = ops.logical_and(cols <= rows, cols > rows - window)
    return ops.broadcast_to(ops.expand_dims(mask, 0), (batch, query_length, context))


def _init_cache(layer, name: str, batch: int, context: int, num_heads: int, head_dim: int):
    from keras import ops

    if name == PEER:
        return ops.zeros((batch, 2, context, num_heads, head_dim), "float32")
    return layer.init_cache(batch, context)


def _call(layer, name: str, tokens, cache, index, context: int, window: int):
    """One cached call on ``tokens`` at ``index``: ``(output, cache)``."""
    if name == PEER:
        mask = band_mask(tokens.shape[0], index, tokens.shape[1], context, window)
        return layer(tokens, tokens, attention_mask=mask, cache=cache, cache_update_index=index)
    return layer(tokens, tokens, use_causal_mask=True, cache=cache, cache_update_index=index)


def full_forward(layer, name: str, x, window: int):
    """The layer's forward pass over all of ``x`` without a cache (causal;
    the band mask for the peer)."""
    if name == PEER:
        n = x.shape[1]
        return layer(x, x, attention_mask=band_mask(x.shape[0], 0, n, n, window))
    return layer(x, x, use_causal_mask=True)


def decode_step_function(layer, name: str, context: int, window: int, backend: str):
    """The compiled one-token step ``step(token, cache, index) -> (out, cache)``
    and how it was compiled (``"jax.jit"``, ``"tf.function(jit_compile)"``
    or ``"eager"``)."""

    def step(token, cache, index):
        return _call(layer, name, token, cache, index, context, window)

    if backend == "jax":
        import jax

        return jax.jit(step, donate_argnums=(1,)), "jax.jit"
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(step, jit_compile=True), "tf.function(jit_compile)"
    return step, "eager"


def _build(layer, name: str, batch: int, dim: int, window: int, seed: int):
    import numpy as np

    x = np.random.default_rng(seed).normal(size=(batch, min(window, 16) + 1, dim)).astype("float32")
    full_forward(layer, name, x, window)


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
# The criteria and the committed results
# ---------------------------------------------------------------------------

#: Largest growth of Local's and Linear's time per token from the smallest
#: to the largest context of a run (issue #31: "flat").
GROWTH_LIMIT = 1.3
#: Smallest speedup per token of Local over the peer at :data:`PEER_CONTEXT`.
PEER_SPEEDUP_LIMIT = 10.0
#: The context of the comparison with the peer.
PEER_CONTEXT = 32768
#: The committed results (``--write``), read by ``docs/guides/decoding.md``.
RESULTS_PATH = os.path.join("docs", "benchmarks", "decode.json")
#: The verdicts of :func:`decode_criteria`.
VERDICTS = ("passed", "failed", "not measured")


def _sig(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits, without an exponent."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def _ms(seconds: float) -> str:
    return f"{_sig(seconds * 1e3)} ms"


def _not_ok(row: dict[str, Any] | None, layer: str, context: int) -> tuple[str, str]:
    """The verdict and the text for a missing or failed row: ``not measured``
    when the row is absent or ``unavailable``, ``failed`` when the layer
    errored, ran out of memory or time, or was skipped after that."""
    if row is None:
        return "not measured", f"no {layer} row at {context:,}"
    status = row.get("status")
    verdict = "not measured" if status == "unavailable" else "failed"
    message = f" ({row['message']})" if row.get("message") else ""
    return verdict, f"{layer} at {context:,}: {status}{message}"


def decode_criteria(
    report: dict[str, Any],
    *,
    local: str = "local",
    linear: str = "linear",
    full: str = "full",
    peer: str = PEER,
    peer_context: int = PEER_CONTEXT,
    growth_limit: float = GROWTH_LIMIT,
    peer_speedup: float = PEER_SPEEDUP_LIMIT,
) -> list[dict[str, Any]]:
    """Issue #31's decode criteria, per backend, computed from a report's
    rows (:func:`run_decode_benchmark`, or a results file).

    * ``<local>_time_flat``, ``<linear>_time_flat``: the layer's time per
      token at the largest context of the run at most ``growth_limit``
      times its time at the smallest;
    * ``local_cache``: at every context, ``local``'s cache bytes at most
      ``window / context`` of ``full``'s (``window`` from the settings);
    * ``local_vs_peer``: at ``peer_context``, ``local`` at least
      ``peer_speedup`` times faster per token than ``peer``.

    The layer names are arguments so that a check can hand another layer's
    rows to a criterion (Full as if it were Local must fail the cache one).

    Returns:
        One dict per backend and criterion: ``name``, ``backend``,
        ``statement``, ``verdict`` (one of :data:`VERDICTS`: ``not
        measured`` when a row is absent or ``unavailable``, or the run lacks
        the contexts; ``failed`` when a layer errored, ran out of memory or
        time there), ``measured`` (the numbers, as text) and ``values``.
    """
    settings = report.get("settings", {})
    rows = report["rows"]
    contexts = sorted({int(c) for c in settings.get("contexts", [r["context"] for r in rows])})
    window = int(settings["window"])
    backends = list(dict.fromkeys(settings.get("backends") or [r["backend"] for r in rows]))
    found = []
    for backend in backends:
        table = {(r["layer"], int(r["context"])): r for r in rows if r["backend"] == backend}

        def ok(layer, context):
            row = table.get((layer, context))
            return row if row is not None and row.get("status") == "ok" else None

        for layer in (local, linear):
            item = dict(name=f"{layer}_time_flat", backend=backend,
                        statement=f"{layer}: time per token at the largest context at most "
                                  f"{growth_limit:g}x its time at the smallest",
                        values={})
            first, last = contexts[0], contexts[-1]
            if len(contexts) < 2:
                item.update(verdict="not measured", measured=f"one context only ({first})")
            elif ok(layer, first) is None or ok(layer, last) is None:
                context = first if ok(layer, first) is None else last
                verdict, text = _not_ok(table.get((layer, context)), layer, context)
                item.update(verdict=verdict, measured=text)
            else:
                t0 = ok(layer, first)["time_per_token_s"]
                t1 = ok(layer, last)["time_per_token_s"]
                growth = t1 / t0
                item["values"] = dict(smallest_context=first, largest_context=last,
                                      smallest_s=t0, largest_s=t1, growth=growth,
                                      limit=growth_limit)
                item.update(verdict="passed" if growth <= growth_limit else "failed",
                            measured=f"{_ms(t0)} at {first:,}, {_ms(t1)} at {last:,}: "
                                     f"{growth:.2f}x (limit {growth_limit:g}x)")
            found.append(item)

        item = dict(name="local_cache", backend=backend,
                    statement=f"{local}'s cache at most window / context of {full}'s "
                              f"(window {window}), at every context", values={})
        ratios, failures, missing = {}, [], []
        for context in contexts:
            mine, base = ok(local, context), ok(full, context)
            if mine is None or base is None:
                layer = local if mine is None else full
                verdict, text = _not_ok(table.get((layer, context)), layer, context)
                (failures if verdict == "failed" and layer == local else missing).append(text)
                continue
            ratio = mine["cache_bytes"] / base["cache_bytes"]
            ratios[context] = dict(ratio=ratio, limit=window / context,
                                   local_bytes=mine["cache_bytes"], full_bytes=base["cache_bytes"])
            if ratio > window / context:
                failures.append(f"{_sig(ratio)} > {_sig(window / context)} at {context:,}")
        item["values"] = {str(c): v for c, v in ratios.items()}
        shown = "; ".join(f"{_sig(v['ratio'])} at {c:,} (limit {_sig(v['limit'])})"
                          for c, v in ratios.items())
        if failures:
            item.update(verdict="failed", measured="; ".join(failures)
                        + (f" (all: {shown})" if shown else ""))
        elif not ratios or missing:
            item.update(verdict="not measured", measured="; ".join(missing or ["no rows"])
                        + (f" (measured: {shown})" if shown else ""))
        else:
            item.update(verdict="passed", measured=shown)
        found.append(item)

        item = dict(name="local_vs_peer", backend=backend,
                    statement=f"at {peer_context:,} positions {local} at least "
                              f"{peer_speedup:g}x faster per token than {peer}", values={})
        mine, other = ok(local, peer_context), ok(peer, peer_context)
        if peer_context not in contexts:
            item.update(verdict="not measured",
                        measured=f"the run has no context {peer_context:,} "
                                 f"(contexts {', '.join(f'{c:,}' for c in contexts)})")
        elif mine is None:
            verdict, text = _not_ok(table.get((local, peer_context)), local, peer_context)
            item.update(verdict=verdict, measured=text)
        elif other is None:
            _, text = _not_ok(table.get((peer, peer_context)), peer, peer_context)
            item.update(verdict="not measured", measured=text)
        else:
            speedup = other["time_per_token_s"] / mine["time_per_token_s"]
            item["values"] = dict(context=peer_context, local_s=mine["time_per_token_s"],
                                  peer_s=other["time_per_token_s"], speedup=speedup,
                                  limit=peer_speedup)
            item.update(verdict="passed" if speedup >= peer_speedup else "failed",
                        measured=f"{_ms(mine['time_per_token_s'])} against "
                                 f"{_ms(other['time_per_token_s'])}: {speedup:.1f}x "
                                 f"(limit {peer_speedup:g}x)")
        found.append(item)
    return found


def criteria_table(criteria: Sequence[dict[str, Any]]) -> str:
    """The criteria of :func:`decode_criteria` as a Markdown table."""
    lines = ["| backend | criterion | measured | verdict |", "|---|---|---|---|"]
    for item in criteria:
        lines.append(f"| {item['backend']} | {item['statement']} | {item['measured']} "
                     f"| {item['verdict']} |")
    return "\n".join(lines)


def results_table(report: dict[str, Any]) -> str:
    """The rows as a Markdown table, layer by layer (each layer's contexts
    together, so that its growth reads down the column), then a line with
    the settings and the devices."""
    order = {name: i for i, name in enumerate(LAYERS)}
    rows = sorted(report["rows"], key=lambda r: (r["backend"], order.get(r["layer"], len(order)),
                                                 r["context"]))
    lines = ["| backend | layer | context | time per token (ms) | cache (MiB) | Full's time / "
             "layer's | peer's time / layer's | cache / Full's | growth |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(row, key, scale=1.0, suffix=""):
        value = row.get(key)
        return "-" if not isinstance(value, (int, float)) else _sig(value * scale) + suffix

    for row in rows:
        if row.get("status") != "ok":
            time_cell = str(row.get("status"))
        else:
            time_cell = cell(row, "time_per_token_s", 1e3)
        lines.append(
            f"| {row['backend']} | {row['layer']} | {row['context']:,} | {time_cell} "
            f"| {cell(row, 'cache_bytes', 1 / (1 << 20))} | {cell(row, 'speedup', suffix='x')} "
            f"| {cell(row, 'speedup_vs_peer', suffix='x')} | {cell(row, 'cache_ratio')} "
            f"| {cell(row, 'growth', suffix='x')} |")
    settings = report.get("settings", {})
    devices = sorted({str(r["device"]) for r in report["rows"] if r.get("device")})
    lines += ["", (f"Batch {settings.get('batch')}, {settings.get('num_heads')} heads of "
                   f"{settings.get('head_dim')}, window {settings.get('window')}; the median of "
                   f"{settings.get('repeats')} steps after {settings.get('warmup')} warm-up steps; "
                   f"device {', '.join(devices) or 'not recorded'}.")]
    notes = [f"{r['layer']} at {r['context']:,}: {r.get('status')}: {r.get('message')}"
             for r in rows if r.get("status") not in ("ok", None) and r.get("message")]
    if notes:
        lines += [""] + [f"* {note}" for note in notes]
    return "\n".join(lines)


def write_decode_results(report: dict[str, Any], path: str | os.PathLike = RESULTS_PATH,
                         command: str | None = None) -> str:
    """Writes ``report`` as a committed results file: its settings, machine
    and rows, the criteria (:func:`decode_criteria`), the Markdown tables
    the decoding guide shows (``table``, ``criteria_table``) and the
    provenance record (:func:`keras_longattn.provenance.collect`:
    commit, and the hashes of every package source the workers imported,
    which this process imports before recording them; its ``backend`` is
    the run's backends). Returns the path."""
    import importlib

    from keras_longattn import provenance

    for module in report.get("modules", ()):
        try:
            importlib.import_module(module)
        except ImportError:  # a backend-specific module of another backend
            continue
    criteria = decode_criteria(report)
    results = {key: report[key] for key in ("benchmark", "created", "settings", "machine")}
    results.update(command=command, rows=report["rows"], criteria=criteria,
                   criteria_table=criteria_table(criteria), table=results_table(report))
    record = provenance.collect()
    # The backends the workers ran, not the one this process imported Keras with.
    record["backend"] = ",".join(report["settings"]["backends"])
    results[provenance.PROVENANCE_KEY] = record
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=repr) + "\n", encoding="utf-8")
    return str(path)


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
