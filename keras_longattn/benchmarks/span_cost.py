"""Whether AdaptiveSpanAttention's cost follows its spans: the project's
benchmark (:func:`keras_longattn.benchmarks.runner.run_benchmark`) on the
layer with every span at ``max_span`` and at ``max_span / 8``, beside full
attention, in the same run.

The registered layers ``adaptive-span-max`` and ``adaptive-span-8th``
(:mod:`keras_longattn.specs.registry`) differ only in ``span_init`` (1.0 and
0.125). The layer computes a band of ``ceil(max_h z_h + R) - 1`` keys, read
from the spans at each eager call: the benchmark's torch worker calls the
layer eagerly, so the band there follows the spans. Compiled calls (the
jax and tensorflow workers) cannot read the spans while tracing and use
the static band of ``max_span``: on those backends both rows cost the same,
and :func:`span_criteria` reports them as ``not applicable``.

Criterion (issue #34): with the spans at 1/8 of ``max_span`` the layer is
at least :data:`SPEEDUP_LIMIT` times faster than with the spans at
``max_span``, in the same run: the ratio of the two medians, per length and
mode; the run is repeated ``rounds`` times and the criterion reads the
median ratio over the rounds (each round's ratio is recorded).

Command line::

    python -m keras_longattn.benchmarks.span_cost --lengths 8192,16384 \\
        --window 1024 --rounds 3 --write docs/benchmarks/adaptive_span.json

``--write`` records the rows, the criteria, their Markdown tables and the
provenance (:mod:`keras_longattn.provenance`) into the
committed file, whose tables ``docs/guides/adaptive_span_attention.md``
shows (``python -m keras_longattn.reproductions.pages --write``), under the source name
``span_cost``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["LAYERS", "SPEEDUP_LIMIT", "run_span_cost", "span_criteria", "criteria_table",
           "rows_table", "write_results", "main"]

#: Full attention (the baseline of the ratios), the spans at max, at max / 8.
LAYERS = ("full", "adaptive-span-max", "adaptive-span-8th")
AT_MAX, AT_EIGHTH = LAYERS[1], LAYERS[2]
#: Smallest speed-up of the spans at max / 8 over the spans at max.
SPEEDUP_LIMIT = 4.0
#: Backends whose benchmark worker calls the layer eagerly (the band follows
#: the spans there).
EAGER_BACKENDS = ("torch",)
#: The committed results (``--write``).
RESULTS_PATH = os.path.join("docs", "benchmarks", "adaptive_span.json")


def run_span_cost(lengths: Sequence[int] = (8192, 16384), window: int = 1024,
                  backends: Sequence[str] = ("torch",), modes: Sequence[str] = ("fwd", "fwdbwd"),
                  rounds: int = 3, repeats: int = 5, num_heads: int = 4, head_dim: int = 64,
                  batch: int = 1, timeout: float = 600.0, output_dir: str | None = None,
                  progress: bool = False) -> dict[str, Any]:
    """Runs the benchmark ``rounds`` times on :data:`LAYERS` (``max_span`` =
    ``window``, causal) and returns ``{"settings", "machine", "rows"}``:
    every row of every round, with its ``round``."""
    from .runner import run_benchmark

    if int(rounds) < 1:
        raise ValueError(f"`rounds` must be an integer >= 1. Received: rounds={rounds!r}")
    rows, machine = [], None
    for index in range(int(rounds)):
        results = run_benchmark(list(LAYERS), list(lengths), list(backends), modes=list(modes),
                                batch=batch, num_heads=num_heads, head_dim=head_dim,
                                window=window, causal=True, repeats=repeats, timeout=timeout,
                                baseline="full", output_dir=output_dir, progress=progress)
        machine = results.metadata.get("machine", machine)
        for row in results:
            rows.append(dict(row, round=index))
    settings = {"lengths": list(lengths), "max_span": window, "ramp": 32,
                "backends": list(backends), "modes": list(modes), "rounds": int(rounds),
                "repeats": repeats, "num_heads": num_heads, "head_dim": head_dim,
                "batch": batch, "causal": True, "layers": list(LAYERS)}
    return {"settings": settings, "machine": machine, "rows": rows}


def _median_ms(rows, layer, backend, n, mode, index):
    for row in rows:
        if (row.get("layer"), row.get("backend"), row.get("seq_len"), row.get("mode"),
                row.get("round")) == (layer, backend, n, mode, index):
            if row.get("status") == "ok" and row.get("median_ms"):
                return float(row["median_ms"])
            return None
    return None


def span_criteria(report: dict[str, Any], limit: float = SPEEDUP_LIMIT) -> list[dict[str, Any]]:
    """One criterion per (backend, length, mode): the median over rounds of
    ``time(spans at max) / time(spans at max / 8)``, ``passed`` when at
    least ``limit``; ``not applicable`` on a compiled backend,
    ``not measured`` when a row is missing or failed."""
    rows = report["rows"]
    rounds = sorted({row.get("round", 0) for row in rows})
    keys = sorted({(row["backend"], row["seq_len"], row["mode"]) for row in rows
                   if row.get("layer") == AT_EIGHTH})
    criteria = []
    for backend, n, mode in keys:
        ratios = []
        for index in rounds:
            at_max = _median_ms(rows, AT_MAX, backend, n, mode, index)
            at_eighth = _median_ms(rows, AT_EIGHTH, backend, n, mode, index)
            if at_max is not None and at_eighth is not None:
                ratios.append(at_max / at_eighth)
        item = {"backend": backend, "seq_len": n, "mode": mode, "limit": limit,
                "ratios": ratios}
        if backend not in EAGER_BACKENDS:
            item["verdict"] = "not applicable"
            item["measured"] = ("compiled worker: the band is the static max_span + ramp - 1 "
                                "for any spans")
        elif not ratios:
            item["verdict"] = "not measured"
            item["measured"] = "a row is missing or did not run"
        else:
            ratio = statistics.median(ratios)
            item["ratio"] = ratio
            item["verdict"] = "passed" if ratio >= limit else "failed"
            spread = ", ".join(f"{r:.2f}x" for r in ratios)
            item["measured"] = f"{ratio:.2f}x (median of {len(ratios)} rounds: {spread})"
        criteria.append(item)
    return criteria


def criteria_table(criteria: Sequence[dict[str, Any]]) -> str:
    """The criteria as a Markdown table."""
    lines = ["| backend | n | mode | spans at max / spans at max/8, time | needs | verdict |",
             "|---|---|---|---|---|---|"]
    for item in criteria:
        lines.append(f"| {item['backend']} | {item['seq_len']:,} | {item['mode']} | "
                     f"{item['measured']} | >= {item['limit']:g}x | {item['verdict']} |")
    return "\n".join(lines)


def rows_table(report: dict[str, Any]) -> str:
    """Median time and peak memory per layer, length and mode (the median
    over rounds of each round's median), as a Markdown table."""
    rows = report["rows"]
    keys = []
    for row in rows:
        key = (row["backend"], row["seq_len"], row["mode"], row["layer"])
        if key not in keys:
            keys.append(key)
    lines = ["| backend | n | mode | layer | time (ms) | peak memory (MiB) | status |",
             "|---|---|---|---|---|---|---|"]
    for backend, n, mode, layer in sorted(keys, key=lambda k: (k[0], k[1], k[2],
                                                               LAYERS.index(k[3])
                                                               if k[3] in LAYERS else 99)):
        mine = [r for r in rows if (r["backend"], r["seq_len"], r["mode"], r["layer"])
                == (backend, n, mode, layer)]
        ok = [r for r in mine if r.get("status") == "ok" and r.get("median_ms")]
        if ok:
            ms = statistics.median(float(r["median_ms"]) for r in ok)
            peaks = [r["peak_memory_bytes"] for r in ok if r.get("peak_memory_bytes")]
            peak = f"{statistics.median(peaks) / 2 ** 20:,.1f}" if peaks else "—"
            lines.append(f"| {backend} | {n:,} | {mode} | {layer} | {ms:,.1f} | {peak} | "
                         f"ok ({len(ok)} rounds) |")
        else:
            status = mine[0].get("status") if mine else "missing"
            lines.append(f"| {backend} | {n:,} | {mode} | {layer} | — | — | {status} |")
    return "\n".join(lines)


def write_results(report: dict[str, Any], path: str | os.PathLike = RESULTS_PATH,
                  command: str | None = None) -> str:
    """Writes ``report`` with its criteria, tables and provenance to
    ``path`` (JSON); returns the path."""
    from keras_longattn import provenance

    # The sources the workers ran: the layer and the band machinery.
    import keras_longattn.layers.adaptive_span_attention  # noqa: F401
    import keras_longattn.layers.full_attention  # noqa: F401

    criteria = span_criteria(report)
    results = dict(report, command=command, criteria=criteria,
                   criteria_table=criteria_table(criteria), table=rows_table(report))
    record = provenance.collect()
    record["backend"] = ",".join(report["settings"]["backends"])
    results[provenance.PROVENANCE_KEY] = record
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=repr) + "\n", encoding="utf-8")
    return str(path)


def _ints(text: str) -> list[int]:
    values = []
    for part in str(text).split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        number = int(part[:-1] if part.endswith("k") else part) * scale
        if number < 1:
            raise argparse.ArgumentTypeError(f"lengths must be >= 1; received {text!r}")
        values.append(number)
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keras_longattn.benchmarks.span_cost",
        description="AdaptiveSpanAttention with every span at max_span and at max_span / 8, "
                    "beside full attention, in the same benchmark run (issue #34's criterion).")
    parser.add_argument("--lengths", type=_ints, default=[8192, 16384], metavar="N,N")
    parser.add_argument("--window", type=int, default=1024,
                        help="max_span of the layer (the benchmark's --window; 1024)")
    parser.add_argument("--backends", default="torch",
                        help="comma-separated; the band follows the spans only on torch (eager)")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--output-dir", default=None, metavar="DIR",
                        help="also keep each round's benchmark report there")
    parser.add_argument("--write", default=None, metavar="PATH",
                        help=f"write the committed results (the committed file is {RESULTS_PATH})")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1; received {args.rounds}")
    report = run_span_cost(lengths=args.lengths, window=args.window,
                           backends=[b.strip() for b in args.backends.split(",") if b.strip()],
                           modes=[m.strip() for m in args.modes.split(",") if m.strip()],
                           rounds=args.rounds, repeats=args.repeats, num_heads=args.heads,
                           head_dim=args.head_dim, output_dir=args.output_dir, progress=True)
    print(rows_table(report))
    print()
    criteria = span_criteria(report)
    print(criteria_table(criteria))
    if args.write:
        command = shlex.join(["python", "-m", "keras_longattn.benchmarks.span_cost"]
                             + list(sys.argv[1:] if argv is None else argv))
        print(f"results: {write_results(report, args.write, command)}", file=sys.stderr)
    failed = any(item["verdict"] == "failed" for item in criteria)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
