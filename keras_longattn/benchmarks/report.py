"""Ratios against the baseline layer, the summary table, JSON and CSV files.

A *row* is the dict of one configuration produced by the runner: its
settings (``backend``, ``layer``: the layer's label, ``layer_spec``: the
Keras layer config it was built from, ``seq_len``, ``mode``, ...), its ``status``
(``"ok"``, ``"oom"``, ``"timeout"``, ``"error"`` or ``"skipped"``), a
``message`` for the others, and when ok the timings (``median_ms``,
``times_ms``, ...) and ``peak_memory_bytes``.

Ratios compare every row with the baseline layer (``full`` by default) at the
same backend, length and mode, from the same run:

* ``time_ratio = baseline median / row median``: a speed-up, > 1 means faster
  than the baseline;
* ``memory_ratio = row peak / baseline peak``: < 1 means less memory.

When the baseline did not give a number there, both are ``None`` and
``ratio_note`` says why (``"full oom"``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TextIO

__all__ = [
    "STATUSES",
    "compute_ratios",
    "format_table",
    "format_notes",
    "print_table",
    "to_csv",
    "to_json",
    "write_reports",
    "CSV_COLUMNS",
]

#: Every status a row can have.
STATUSES = ("ok", "oom", "timeout", "error", "skipped")

MIB = float(1 << 20)

#: Columns of the CSV file, in order.
CSV_COLUMNS = (
    "backend",
    "layer",
    "seq_len",
    "mode",
    "batch",
    "num_heads",
    "head_dim",
    "causal",
    "scope",
    "status",
    "median_ms",
    "mean_ms",
    "min_ms",
    "max_ms",
    "first_call_ms",
    "repeats",
    "times_ms",
    "page_faults",
    "peak_memory_mib",
    "memory_method",
    "baseline",
    "time_ratio",
    "memory_ratio",
    "ratio_note",
    "device",
    "backend_version",
    "keras_version",
    "layer_class",
    "layer_spec",
    "num_params",
    "options",
    "allocator",
    "allocator_settled",
    "wall_s",
    "message",
    "useful_gflop",
    "useful_gflops_per_s",
    "matmul_peak_gflops",
    "peak_fraction",
)

_DASH = "\u2014"


def _key(row: Mapping[str, Any]) -> tuple:
    return (row.get("backend"), row.get("seq_len"), row.get("mode"))


def _positive_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def compute_ratios(rows: Sequence[dict[str, Any]], baseline: str | None = "full") -> list[dict]:
    """Add ``time_ratio``, ``memory_ratio``, ``ratio_note`` and ``baseline``.

    Modifies the rows in place and returns them. With ``baseline=None`` the
    ratios are all ``None`` (and ``ratio_note`` is empty).
    """
    references: dict[tuple, dict[str, Any]] = {}
    if baseline is not None:
        for row in rows:
            if row.get("layer") == baseline:
                references.setdefault(_key(row), row)
    for row in rows:
        row["baseline"] = baseline
        row["time_ratio"] = None
        row["memory_ratio"] = None
        row["ratio_note"] = ""
        if baseline is None:
            continue
        if row.get("status") != "ok":
            row["ratio_note"] = row.get("status", "")
            continue
        reference = references.get(_key(row))
        if reference is None:
            row["ratio_note"] = f"{baseline} not run"
            continue
        if reference.get("status") != "ok":
            row["ratio_note"] = f"{baseline} {reference.get('status')}"
            continue
        notes = []
        if _positive_finite(row.get("median_ms")) and _positive_finite(reference.get("median_ms")):
            row["time_ratio"] = reference["median_ms"] / row["median_ms"]
        else:
            notes.append("no time")
        peak, reference_peak = row.get("peak_memory_bytes"), reference.get("peak_memory_bytes")
        if row.get("memory_method") != reference.get("memory_method"):
            notes.append("memory methods differ")
        elif _positive_finite(reference_peak) and isinstance(peak, (int, float)):
            row["memory_ratio"] = peak / reference_peak
        else:
            notes.append(f"{baseline} peak 0")
        row["ratio_note"] = "; ".join(notes)
    return list(rows)


# ---------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------


def _fmt_ms(value: Any) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return _DASH
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _fmt_mib(value: Any) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return _DASH
    return f"{value / MIB:.1f}"


def _fmt_ratio(value: Any, suffix: str = "") -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return _DASH
    if value >= 100:
        return f"{value:.0f}{suffix}"
    if value >= 10:
        return f"{value:.1f}{suffix}"
    return f"{value:.2f}{suffix}"


def _ratio_cell(row: Mapping[str, Any], field: str, suffix: str = "") -> str:
    value = row.get(field)
    if value is not None:
        return _fmt_ratio(value, suffix)
    note = row.get("ratio_note") or ""
    # The row's own failure is in the status column; explain only the rest.
    if row.get("status") != "ok" or not note:
        return _DASH
    return f"{_DASH} ({note})"


def table_columns(baseline: str | None) -> list[str]:
    """Header of the summary table."""
    columns = ["layer", "backend", "n", "mode", "median ms"]
    if baseline is not None:
        columns.append(f"speed-up vs {baseline}")
    columns.append("peak MiB")
    if baseline is not None:
        columns.append(f"mem ratio vs {baseline}")
    columns.append("status")
    return columns


def table_rows(rows: Iterable[Mapping[str, Any]], baseline: str | None) -> list[list[str]]:
    """The table's cells, one list of strings per row."""
    cells = []
    for row in rows:
        line = [
            str(row.get("layer", "")),
            str(row.get("backend", "")),
            str(row.get("seq_len", "")),
            str(row.get("mode", "")),
            _fmt_ms(row.get("median_ms")) if row.get("status") == "ok" else _DASH,
        ]
        if baseline is not None:
            line.append(_ratio_cell(row, "time_ratio", "x"))
        line.append(_fmt_mib(row.get("peak_memory_bytes")) if row.get("status") == "ok" else _DASH)
        if baseline is not None:
            line.append(_ratio_cell(row, "memory_ratio"))
        line.append(str(row.get("status", "")))
        cells.append(line)
    return cells


def _baseline_of(rows: Sequence[Mapping[str, Any]], baseline: Any) -> str | None:
    if baseline != "auto":
        return baseline
    return rows[0].get("baseline") if rows else None


def format_table(rows: Sequence[Mapping[str, Any]], baseline: str | None | Any = "auto") -> str:
    """The summary table as plain text (numbers right-aligned).

    Args:
        rows: result rows (with ratios, see :func:`compute_ratios`).
        baseline: the baseline layer name, ``None`` for no ratio columns, or
            ``"auto"`` to take it from the rows.
    """
    baseline = _baseline_of(rows, baseline)
    header = table_columns(baseline)
    body = table_rows(rows, baseline)
    widths = [len(name) for name in header]
    for line in body:
        widths = [max(width, len(cell)) for width, cell in zip(widths, line)]
    left = {0, 1, 3, len(header) - 1}

    def render(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(width) if index in left else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    lines = [render(header), "  ".join("-" * width for width in widths)]
    lines.extend(render(line) for line in body)
    return "\n".join(lines)


def format_notes(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per row that did not run to completion, with its reason."""
    notes = []
    for row in rows:
        if row.get("status") == "ok":
            continue
        label = f"{row.get('layer')} n={row.get('seq_len')} {row.get('mode')} {row.get('backend')}"
        notes.append(f"  {label}: {row.get('status')}: {row.get('message') or '(no message)'}")
    return "\n".join(notes)


def print_table(
    rows: Sequence[Mapping[str, Any]],
    baseline: str | None | Any = "auto",
    file: TextIO | None = None,
    use_rich: bool | None = None,
) -> None:
    """Print the table and the notes; with ``rich`` when it is importable.

    Args:
        rows: result rows.
        baseline: as in :func:`format_table`.
        file: where to print (standard output by default).
        use_rich: ``None`` uses rich when importable, ``False`` never.
    """
    import sys

    file = sys.stdout if file is None else file
    baseline = _baseline_of(rows, baseline)
    notes = format_notes(rows)
    console = None
    if use_rich is not False:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            console = None
        else:
            is_terminal = getattr(file, "isatty", lambda: False)()
            console = Console(file=file, width=None if is_terminal else 160)
    if console is None:
        print(format_table(rows, baseline), file=file)
        if notes:
            print("\nnot completed:\n" + notes, file=file)
        return

    styles = {"ok": "green", "oom": "red", "timeout": "yellow", "error": "red", "skipped": "dim"}
    table = Table(title="keras_longattn benchmark", title_justify="left")
    for index, name in enumerate(table_columns(baseline)):
        justify = "left" if index in (0, 1, 3) or name == "status" else "right"
        table.add_column(name, justify=justify, no_wrap=name != "status")
    previous = None
    for row, cells in zip(rows, table_rows(rows, baseline)):
        group = (row.get("backend"), row.get("seq_len"))
        if previous is not None and group != previous:
            table.add_section()
        previous = group
        status = cells[-1]
        cells[-1] = f"[{styles.get(status, '')}]{status}[/]" if status in styles else status
        table.add_row(*cells)
    console.print(table)
    if notes:
        console.print("\nnot completed:", style="bold")
        console.print(notes, markup=False, highlight=False)


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def _csv_value(row: Mapping[str, Any], column: str) -> Any:
    if column == "peak_memory_mib":
        value = row.get("peak_memory_bytes")
        return f"{value / MIB:.3f}" if isinstance(value, (int, float)) else ""
    value = row.get(column)
    if value is None:
        return ""
    if column == "times_ms":
        return ";".join(f"{t:.4f}" for t in value)
    if column == "page_faults":
        return ";".join(str(int(t)) for t in value)
    if column in ("options", "layer_spec", "allocator"):
        return json.dumps(value, sort_keys=True, default=repr)
    if isinstance(value, float):
        return f"{value:.6g}"
    if column == "message":
        return " ".join(str(value).split())
    return value


def to_csv(rows: Iterable[Mapping[str, Any]]) -> str:
    """The rows as CSV text with :data:`CSV_COLUMNS`."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow([_csv_value(row, column) for column in CSV_COLUMNS])
    return buffer.getvalue()


def to_json(rows: Sequence[Mapping[str, Any]], metadata: Mapping[str, Any]) -> str:
    """The full report: ``metadata`` (config, machine, times) plus ``results``."""
    document = {"schema_version": 1, **metadata, "results": list(rows)}
    return json.dumps(_clean_nan(document), indent=2, default=repr, allow_nan=False) + "\n"


def _atomic_write(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def _clean_nan(value: Any) -> Any:
    """Non-finite floats become None (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _clean_nan(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean_nan(item) for item in value]
    return value


def write_reports(
    rows: Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any],
    output_dir: str | os.PathLike,
    timestamp: datetime | None = None,
) -> dict[str, Path]:
    """Write ``bench-<timestamp>.json/.csv`` and ``latest.json/.csv``.

    Returns:
        The paths, keyed ``"json"``, ``"csv"``, ``"latest_json"``,
        ``"latest_csv"``.
    """
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = (timestamp or datetime.now()).strftime("%Y%m%d-%H%M%S")
    stem = f"bench-{stamp}"
    suffix = 1
    while (directory / f"{stem}.json").exists() or (directory / f"{stem}.csv").exists():
        suffix += 1
        stem = f"bench-{stamp}-{suffix}"
    json_text = to_json(rows, metadata)
    csv_text = to_csv(rows)
    paths = {
        "json": directory / f"{stem}.json",
        "csv": directory / f"{stem}.csv",
        "latest_json": directory / "latest.json",
        "latest_csv": directory / "latest.csv",
    }
    for key, text in (
        ("json", json_text),
        ("csv", csv_text),
        ("latest_json", json_text),
        ("latest_csv", csv_text),
    ):
        _atomic_write(paths[key], text)
    return paths
