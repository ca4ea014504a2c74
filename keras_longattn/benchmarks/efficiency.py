"""Useful-FLOP throughput of a benchmark row, against a matmul peak measured
in the same worker.

**Useful FLOPs** are the floating-point operations of the two products of
attention over the (query, key) pairs the mechanism allows, and nothing
else: with ``P`` the number of allowed pairs summed over the heads and the
batch, ``d`` the query/key head size and ``dv`` the value head size, one
multiply-add counting 2 FLOPs,

* forward (``fwd``): scores ``Q K^T`` and weighted values ``P V`` on the
  allowed pairs: ``2 P (d + dv)``;
* forward and backward (``fwdbwd``): that plus the four products of the
  backward pass (``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K``,
  ``dK = dS^T Q``): ``6 P (d + dv)`` in all.

Softmax, masking, padding, recomputation of the scores in a backward pass
and pairs computed only to be masked are not useful work, so a path that
computes more than the allowed pairs has a lower throughput than its raw
FLOP rate. With ``scope="layer"`` the four projections of
``MultiHeadAttention`` are added (``2 n D H d`` FLOPs each forward for an
input of ``D`` features, three times that forward and backward).

``P`` per layer (:func:`allowed_pairs`), per head, for a sequence of ``n``
positions (queries = keys):

* ``FullAttention`` and ``MultiHeadAttention``: ``n (n + 1) / 2`` causal,
  ``n^2`` bidirectional;
* ``LocalAttention``: ``sum_i (min(i, look_back) + min(n - 1 - i,
  look_ahead) + 1)`` with the layer's extents (causal window ``w``:
  ``look_back = w - 1``, ``look_ahead = 0``);
* ``SparseAttention`` (``combination="multihead"``: ``ceil(H / 2)`` heads
  with pattern A, the others B; ``"first"`` / ``"second"``: every head A /
  B; ``"merged"``: every head A or B): strided A is a window of ``l`` keys
  (as local), strided B the keys ``j = i mod l`` (``j <= i`` causal); fixed A
  the own block of ``l``, fixed B the last ``c`` cells of every block.

Other layers have no definition here: their rows get no efficiency.

**Peak**: with ``efficiency=True`` (``--efficiency``) each worker also times
a ``4096 x 4096`` float32 matrix product on its backend with the same
threads, after the layer's timed calls (:func:`measure_matmul_peak`: the
best of several calls, compiled on JAX and TensorFlow), and the row reports
``useful_gflops_per_s`` and ``peak_fraction`` = throughput / that peak.

This module imports no backend except inside :func:`measure_matmul_peak`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

__all__ = [
    "PEAK_MATRIX_SIZE",
    "allowed_pairs",
    "useful_flops",
    "measure_matmul_peak",
    "annotate",
    "format_efficiency",
]

#: Size of the square float32 matrices of the peak measurement.
PEAK_MATRIX_SIZE = 4096
#: Timed products of the peak measurement (the fastest counts).
PEAK_REPEATS = 5


# ---------------------------------------------------------------------------
# Allowed pairs
# ---------------------------------------------------------------------------


def _band_pairs(n: int, look_back: int, look_ahead: int) -> int:
    """``sum_i (min(i, b) + min(n - 1 - i, a) + 1)`` in closed form."""

    def side(extent: int) -> int:  # sum_i min(i, extent), i = 0 .. n - 1
        e = min(extent, n - 1)
        return e * (e + 1) // 2 + (n - 1 - e) * e if n > 0 else 0

    return n + side(look_back) + side(look_ahead)


def _local_extents(config: Mapping[str, Any], causal: bool) -> tuple[int, int]:
    """The extents of a ``LocalAttention`` config (as
    ``keras_longattn.ops.resolve_window``)."""
    window = config.get("window", 128)
    look_back = config.get("look_back")
    look_ahead = config.get("look_ahead")
    if look_back is None:
        look_back = window - 1 if causal else window // 2
    if look_ahead is None:
        look_ahead = (0 if causal else look_back) if window is None else (
            0 if causal else window // 2)
    return int(look_back), 0 if causal else int(look_ahead)


def _column_pairs(n: int, l: int, causal: bool) -> int:
    """Pairs ``(i, j)`` with ``i = j mod l`` (``j <= i`` when causal)."""
    total = 0
    full, rest = divmod(n, l)
    for c in range(l):
        m = full + (1 if c < rest else 0)  # positions of column c
        total += m * (m + 1) // 2 if causal else m * m
    return total


def _block_pairs(n: int, l: int, causal: bool) -> int:
    full, rest = divmod(n, l)
    per = (lambda b: b * (b + 1) // 2) if causal else (lambda b: b * b)
    return full * per(l) + per(rest)


def _summary_pairs(n: int, l: int, c: int, causal: bool) -> int:
    """Pairs with ``j mod l >= l - c`` (and ``j <= i`` causal)."""
    summaries = [j for start in range(0, n, l) for j in range(start + l - c, min(start + l, n))]
    if not causal:
        return n * len(summaries)
    return sum(n - j for j in summaries)


def _sparse_pairs(config: Mapping[str, Any], n: int, num_heads: int,
                  causal: bool) -> int | None:
    pattern = config.get("pattern", "strided")
    l = config.get("block_length") or max(2, int(math.floor(math.sqrt(n) + 0.5)))
    l = int(l)
    if pattern == "strided":
        a = _band_pairs(n, l - 1, 0 if causal else l - 1)
        b = _column_pairs(n, l, causal)
        both = n  # the only key both allow is the query itself
    else:
        c = config.get("summary_width") or max(1, min(l // 8, 32))
        a = _block_pairs(n, l, causal)
        b = _summary_pairs(n, l, int(c), causal)
        # The summaries of the own block are in both.
        own = 0
        for start in range(0, n, l):
            stop = min(start + l, n)
            for j in range(max(start, start + l - int(c)), stop):
                own += (stop - j) if causal else (stop - start)
        both = own
    combination = config.get("combination", "multihead")
    if combination == "multihead":
        heads_a = num_heads - num_heads // 2
        return heads_a * a + (num_heads - heads_a) * b
    if combination == "first":
        return num_heads * a
    if combination == "second":
        return num_heads * b
    return num_heads * (a + b - both)


def allowed_pairs(class_name: str, config: Mapping[str, Any], seq_len: int,
                  num_heads: int, causal: bool) -> int | None:
    """Allowed (query, key) pairs of one example, summed over the heads, or
    None when this module has no definition for the layer."""
    n = int(seq_len)
    name = class_name.rsplit(">", 1)[-1].rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    if name in ("FullAttention", "MultiHeadAttention"):
        return num_heads * (n * (n + 1) // 2 if causal else n * n)
    if name == "LocalAttention":
        return num_heads * _band_pairs(n, *_local_extents(config, causal))
    if name == "SparseAttention":
        return _sparse_pairs(config, n, num_heads, causal)
    return None


def useful_flops(row: Mapping[str, Any]) -> float | None:
    """Useful FLOPs of one benchmark row (see the module docstring), or
    None."""
    spec = row.get("layer_spec") or {}
    config = dict(spec.get("config") or {})
    heads = int(config.get("num_heads") or row.get("num_heads") or 1)
    d = int(config.get("key_dim") or row.get("head_dim") or 1)
    dv = int(config.get("value_dim") or d)
    pairs = allowed_pairs(str(spec.get("class_name", "")), config, row.get("seq_len", 0),
                          heads, bool(row.get("causal", True)))
    if pairs is None:
        return None
    batch = int(row.get("batch") or 1)
    forward = 2.0 * batch * pairs * (d + dv)
    if row.get("scope", "layer") == "layer":
        features = heads * int(row.get("head_dim") or d)
        n = int(row.get("seq_len", 0))
        forward += 2.0 * batch * n * features * heads * (3 * d + dv)
    return forward * (3.0 if row.get("mode") == "fwdbwd" else 1.0)


# ---------------------------------------------------------------------------
# Peak
# ---------------------------------------------------------------------------


def measure_matmul_peak(backend: str, size: int = PEAK_MATRIX_SIZE,
                        repeats: int = PEAK_REPEATS) -> float:
    """GFLOP/s of the fastest of ``repeats`` float32 ``size x size``
    products on ``backend`` in this process (``2 size^3`` FLOPs each)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((size, size), dtype=np.float32)
    b_np = rng.standard_normal((size, size), dtype=np.float32)
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        a, b = jnp.asarray(a_np), jnp.asarray(b_np)
        product = jax.jit(jnp.matmul)

        def run():
            jax.block_until_ready(product(a, b))
    elif backend == "tensorflow":
        import tensorflow as tf

        a, b = tf.constant(a_np), tf.constant(b_np)
        product = tf.function(tf.matmul, jit_compile=True)

        def run():
            product(a, b).numpy()
    elif backend == "torch":
        import torch

        a, b = torch.from_numpy(a_np), torch.from_numpy(b_np)
        if torch.cuda.is_available():
            a, b = a.cuda(), b.cuda()

        def run():
            torch.matmul(a, b)
            if a.is_cuda:
                torch.cuda.synchronize()
    else:
        raise ValueError(f"unknown backend {backend!r}")
    run()  # compile and warm up
    best = math.inf
    for _ in range(int(repeats)):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best / 1e9


# ---------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------


def annotate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds ``useful_gflop`` (per call), ``useful_gflops_per_s`` and, where
    the worker measured a peak (``matmul_peak_gflops``), ``peak_fraction``
    to every ok row with a definition. Modifies the rows in place."""
    for row in rows:
        flops = useful_flops(row) if row.get("status") == "ok" else None
        row["useful_gflop"] = None if flops is None else flops / 1e9
        median = row.get("median_ms")
        rate = None
        if flops is not None and isinstance(median, (int, float)) and median > 0:
            rate = flops / (median / 1e3) / 1e9
        row["useful_gflops_per_s"] = rate
        peak = row.get("matmul_peak_gflops")
        row["peak_fraction"] = (rate / peak if rate is not None
                                and isinstance(peak, (int, float)) and peak > 0 else None)
    return rows


def format_efficiency(rows: list[Mapping[str, Any]]) -> str:
    """The efficiency of the rows that have one, as a plain-text table (empty
    string when none has)."""
    chosen = [r for r in rows if r.get("useful_gflops_per_s") is not None]
    if not chosen:
        return ""
    header = ["layer", "backend", "n", "mode", "useful GFLOP", "GFLOP/s", "matmul peak",
              "of peak"]
    body = []
    for r in chosen:
        peak = r.get("matmul_peak_gflops")
        fraction = r.get("peak_fraction")
        body.append([str(r.get("layer")), str(r.get("backend")), str(r.get("seq_len")),
                     str(r.get("mode")), f"{r['useful_gflop']:.2f}",
                     f"{r['useful_gflops_per_s']:.1f}",
                     "-" if peak is None else f"{peak:.1f}",
                     "-" if fraction is None else f"{100 * fraction:.0f}%"])
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) if i in (0, 1, 3) else c.rjust(w)
                        for i, (c, w) in enumerate(zip(line, widths))) for line in body]
    return "useful-FLOP throughput (keras_longattn.benchmarks.efficiency):\n" + "\n".join(lines)
