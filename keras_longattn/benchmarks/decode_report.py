"""The decoding benchmark's criteria (time per token flat in the context,
Local against the peer) and its committed results file
(``docs/benchmarks/decode.json``, :func:`write_decode_results`), with the
Markdown tables the decoding guide shows."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from .decode_layers import LAYERS
from .decode_layers import PEER

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
