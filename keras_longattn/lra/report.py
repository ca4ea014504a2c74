"""The suite's results: summary per layer, the table, JSON and CSV files.

A *row* is one (layer, task, seed): ``layer`` (its label), ``task``,
``seed``, ``backend``, ``seq_len``, ``steps``, ``batch_size``, ``status``
(``"ok"``, ``"oom"``, ``"timeout"`` or ``"error"``, with a ``message``), and
when ok ``accuracy`` (a fraction), ``final_loss``, ``step_ms``,
``first_step_ms``, ``train_s``, ``eval_s``, ``peak_memory_bytes``,
``peak_memory_mib``, ``memory_method`` and ``num_params``.

The summary has one entry per layer: per task the mean accuracy over the
seeds and its spread (the sample standard deviation, or the min-max range),
their average over the tasks, the time per training step (per task the
median step of each seed, averaged over the seeds, then averaged over the
tasks), the peak memory (the largest over tasks and seeds), and ratios against the baseline layer
(``full`` when it ran, else the first layer): ``speedup = baseline ms / layer
ms`` and ``memory_ratio = layer MiB / baseline MiB``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = ["SuiteResults", "CSV_COLUMNS", "SPREADS", "summarize", "format_table"]

#: How the spread over seeds is shown: the sample standard deviation
#: (``mean ± std``) or the range (``mean [min–max]``).
SPREADS = ("std", "range")

#: Columns of the CSV file (one line per layer, task and seed), in order.
CSV_COLUMNS = (
    "layer", "task", "seed", "backend", "seq_len", "steps", "batch_size", "status",
    "accuracy", "final_loss", "step_ms", "first_step_ms", "train_s", "eval_s",
    "peak_memory_bytes", "peak_memory_mib", "memory_method", "num_params", "message",
)

_INTEGER_COLUMNS = {"seed", "seq_len", "steps", "batch_size", "peak_memory_bytes", "num_params"}
_FLOAT_COLUMNS = {"accuracy", "final_loss", "step_ms", "first_step_ms", "train_s", "eval_s",
                  "peak_memory_mib"}

_TITLES = {"listops": "ListOps", "text": "Text", "retrieval": "Retrieval", "image": "Image",
           "pathfinder": "Pathfinder"}


def _mean(values):
    return statistics.fmean(values) if values else None


def summarize(rows: Iterable[Mapping[str, Any]], tasks: Iterable[str] | None = None,
              layers: Iterable[str] | None = None, baseline: str | None = None
              ) -> list[dict[str, Any]]:
    """One summary dict per layer (see the module docstring).

    Args:
        rows: the result rows.
        tasks: the task columns, in order. Defaults to those of ``rows``.
        layers: the layers, in order. Defaults to those of ``rows``.
        baseline: the layer of the ratios. Defaults to ``"full"`` when it
            ran, else the first layer.

    Returns:
        Dicts with ``layer``, ``tasks`` (task -> ``{"mean", "std", "min",
        "max", "seeds", "status"}``, accuracies as fractions), ``average``
        (``None`` unless every task has a mean), ``step_ms``,
        ``peak_memory_mib``, ``speedup``, ``memory_ratio`` and ``baseline``.
    """
    rows = list(rows)
    tasks = list(tasks) if tasks is not None else list(dict.fromkeys(r["task"] for r in rows))
    layers = list(layers) if layers is not None else list(dict.fromkeys(r["layer"]
                                                                         for r in rows))
    summary = []
    for layer in layers:
        entry: dict[str, Any] = {"layer": layer, "tasks": {}}
        step_ms, peaks = [], []
        for task in tasks:
            mine = [r for r in rows if r["layer"] == layer and r["task"] == task]
            ok = [r for r in mine if r.get("status") == "ok"]
            accuracies = [float(r["accuracy"]) for r in ok]
            failed = sorted({r.get("status") for r in mine if r.get("status") != "ok"})
            entry["tasks"][task] = {
                "mean": _mean(accuracies),
                "std": statistics.stdev(accuracies) if len(accuracies) > 1 else None,
                "min": min(accuracies) if accuracies else None,
                "max": max(accuracies) if accuracies else None,
                "seeds": len(accuracies),
                "status": "ok" if ok and not failed else ("/".join(failed) or "missing"),
            }
            if ok:
                step_ms.append(statistics.fmean(float(r["step_ms"]) for r in ok))
                peaks.extend(float(r["peak_memory_mib"]) for r in ok)
        means = [cell["mean"] for cell in entry["tasks"].values()]
        entry["average"] = _mean(means) if means and None not in means else None
        entry["step_ms"] = _mean(step_ms)
        entry["peak_memory_mib"] = max(peaks) if peaks else None
        summary.append(entry)
    names = [entry["layer"] for entry in summary]
    if baseline is None and names:
        baseline = "full" if "full" in names else names[0]
    base = next((entry for entry in summary if entry["layer"] == baseline), None)
    for entry in summary:
        entry["baseline"] = baseline
        entry["speedup"] = entry["memory_ratio"] = None
        if base is not None and entry["step_ms"] and base["step_ms"]:
            entry["speedup"] = base["step_ms"] / entry["step_ms"]
        if base is not None and entry["peak_memory_mib"] and base["peak_memory_mib"]:
            entry["memory_ratio"] = entry["peak_memory_mib"] / base["peak_memory_mib"]
    return summary


def _cell(cell: Mapping[str, Any], spread: str) -> str:
    if cell["mean"] is None:
        return cell["status"]
    text = f"{100 * cell['mean']:.1f}"
    if spread == "std" and cell["std"] is not None:
        text += f" ± {100 * cell['std']:.1f}"
    elif spread == "range" and cell["seeds"] > 1:
        text += f" [{100 * cell['min']:.1f}–{100 * cell['max']:.1f}]"
    if cell["status"] != "ok":
        text += f" ({cell['status']})"
    return text


def _number(value, digits=1, suffix=""):
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def format_table(summary: list[Mapping[str, Any]], tasks: Iterable[str] | None = None,
                 spread: str = "std", notes: bool = True,
                 metadata: Mapping[str, Any] | None = None) -> str:
    """The summary as a Markdown table, one row per layer.

    Columns: each task's accuracy in % (mean and spread over the seeds), the
    average over the tasks, ms per training step, peak MiB, and the
    speed-up and memory ratio against the baseline layer.

    Args:
        summary: from :func:`summarize`.
        tasks: the task columns. Defaults to those of the summary.
        spread: ``"std"`` (``mean ± sample std``) or ``"range"``
            (``mean [min–max]``). Defaults to ``"std"``.
        notes: add lines below the table that say what the columns are.
        metadata: the run's metadata, for the notes (size, backend, seeds).
    """
    if spread not in SPREADS:
        raise ValueError(f"unknown spread {spread!r}; choose from {', '.join(SPREADS)}")
    if tasks is None:
        tasks = list(summary[0]["tasks"]) if summary else []
    tasks = list(tasks)
    baseline = summary[0]["baseline"] if summary else None
    header = (["Layer"] + [_TITLES.get(task, task) for task in tasks]
              + ["Avg", "ms/step", "Peak MiB", f"Speed-up vs {baseline}",
                 f"Memory vs {baseline}"])
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for entry in summary:
        cells = [entry["layer"]] + [_cell(entry["tasks"][task], spread) for task in tasks]
        cells += [_number(None if entry["average"] is None else 100 * entry["average"]),
                  _number(entry["step_ms"]), _number(entry["peak_memory_mib"], 0),
                  _number(entry["speedup"], 2, "×"), _number(entry["memory_ratio"], 2, "×")]
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        seeds = (metadata or {}).get("seeds")
        what = ("mean ± sample standard deviation" if spread == "std"
                else "mean [min–max]")
        count = f"{len(seeds)} seed(s) {seeds}" if seeds else "the seeds"
        lines.append("")
        lines.append(f"Accuracy in % on the test sets, {what} over {count}. ms/step: the "
                     "median training step (the compiling first step left out), averaged "
                     "over the tasks; Peak MiB: the largest peak-memory increase over the "
                     f"tasks; ratios against {baseline} (speed-up = its ms / the layer's ms).")
        if metadata:
            lines.append(f"Size {metadata.get('size')!r}, backend {metadata.get('backend')}.")
    return "\n".join(lines)


class SuiteResults(list):
    """The result rows (a ``list`` of dicts, one per layer, task and seed)
    and the run's metadata.

    Attributes:
        metadata: the run's settings (size, tasks, layers, seeds, backend,
            task sizes, layer configs, machine, times).
        paths: the report files written by :meth:`write` (else empty).
    """

    def __init__(self, rows: Iterable[Mapping[str, Any]] = (),
                 metadata: Mapping[str, Any] | None = None):
        super().__init__(dict(row) for row in rows)
        self.metadata = dict(metadata or {})
        self.paths: dict[str, Path] = {}

    @property
    def tasks(self) -> list[str]:
        """The tasks of the run, in column order."""
        return list(self.metadata.get("tasks") or dict.fromkeys(r["task"] for r in self))

    @property
    def layers(self) -> list[str]:
        """The layers of the run, in row order."""
        return list(self.metadata.get("layers") or dict.fromkeys(r["layer"] for r in self))

    def summary(self, baseline: str | None = None) -> list[dict[str, Any]]:
        """One dict per layer; see :func:`summarize`."""
        return summarize(self, self.tasks, self.layers, baseline)

    def table(self, spread: str = "std", notes: bool = True,
              baseline: str | None = None) -> str:
        """The Markdown table of :func:`format_table`."""
        return format_table(self.summary(baseline), self.tasks, spread, notes, self.metadata)

    def to_dict(self) -> dict[str, Any]:
        """``{"metadata": ..., "rows": [...], "summary": [...]}``."""
        return {"metadata": self.metadata, "rows": list(self), "summary": self.summary()}

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The JSON report; written to ``path`` when given. Returns the text."""
        text = json.dumps(_finite(self.to_dict()), indent=2, default=repr)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    def to_csv(self, path: str | os.PathLike | None = None) -> str:
        """The rows as CSV (:data:`CSV_COLUMNS`); written to ``path`` when
        given. Returns the text."""
        import io

        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, extrasaction="ignore",
                                lineterminator="\n")
        writer.writeheader()
        for row in self:
            writer.writerow({key: ("" if row.get(key) is None else row.get(key))
                             for key in CSV_COLUMNS})
        text = buffer.getvalue()
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> "SuiteResults":
        """Results read back from :meth:`to_json` output (a path or the text)."""
        text = str(path_or_text)
        if not text.lstrip().startswith("{"):
            text = Path(path_or_text).read_text(encoding="utf-8")
        data = json.loads(text)
        return cls(data["rows"], data.get("metadata"))

    @classmethod
    def from_csv(cls, path_or_text: str | os.PathLike,
                 metadata: Mapping[str, Any] | None = None) -> "SuiteResults":
        """Results read back from :meth:`to_csv` output (a path or the text);
        the CSV has no metadata, pass it if needed."""
        import io

        text = str(path_or_text)
        if "\n" not in text:
            text = Path(path_or_text).read_text(encoding="utf-8")
        rows = []
        for raw in csv.DictReader(io.StringIO(text)):
            row: dict[str, Any] = {}
            for key, value in raw.items():
                if value == "" and key != "message":
                    row[key] = None
                elif key in _INTEGER_COLUMNS:
                    row[key] = int(value)
                elif key in _FLOAT_COLUMNS:
                    row[key] = float(value)
                else:
                    row[key] = value
            rows.append(row)
        return cls(rows, metadata)

    def write(self, output_dir: str | os.PathLike) -> dict[str, Path]:
        """Write ``lra-<size>-<time>.json`` / ``.csv`` and copies
        ``latest.json`` / ``latest.csv`` into ``output_dir``.

        Returns:
            ``{"json": path, "csv": path}`` (also kept in :attr:`paths`).
        """
        directory = Path(output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        stem = directory / f"lra-{self.metadata.get('size', 'run')}-{stamp}"
        json_text, csv_text = self.to_json(), self.to_csv()
        paths = {"json": stem.with_suffix(".json"), "csv": stem.with_suffix(".csv")}
        paths["json"].write_text(json_text + "\n", encoding="utf-8")
        paths["csv"].write_text(csv_text, encoding="utf-8")
        (directory / "latest.json").write_text(json_text + "\n", encoding="utf-8")
        (directory / "latest.csv").write_text(csv_text, encoding="utf-8")
        self.paths = paths
        return paths


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by ``None`` (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
