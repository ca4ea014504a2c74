"""The suite's orchestrator: one fresh subprocess per (layer, task).

:func:`run_suite` validates its arguments (a :class:`SuiteArgumentError`
names the bad one), checks every layer config against its class before
training (an option the constructor does not accept is an error), then runs
``python -m keras_longattn.lra.worker`` once per (layer, task) under the
benchmark's timeout and memory guard
(:func:`keras_longattn.benchmarks.runner.run_job`), which trains one model
per seed, and shows the worker's progress lines as they come. The rows it
returns (one per layer, task and seed) are summarised by
:mod:`keras_longattn.lra.report`.

This module imports no backend; only the worker subprocess does.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

from keras_longattn.benchmarks.config import default_backend, parse_backends
from keras_longattn.benchmarks.runner import (
    check_layer_specs,
    machine_info,
    memory_limit_bytes,
    run_job,
)
from keras_longattn.specs import registry
from keras_longattn.specs.arguments import (
    ArgumentError,
    layer_options,
    parse_layers,
    parse_options,
)
from keras_longattn.specs.layer_spec import LayerConfigError, substitute_placeholders
from keras_longattn.specs.progress import Progress, make_progress

from .report import SuiteResults
from .tasks import OVERRIDABLE, SIZES, TaskSize, available_tasks, get_task
from . import worker
from .worker import MODEL_CONFIG, PROGRESS_MARKER

__all__ = [
    "SuiteArgumentError",
    "DEFAULT_OUTPUT_DIR",
    "parse_tasks",
    "parse_seeds",
    "default_window",
    "resolve_layers",
    "run_suite",
]

#: Where the command line writes its reports by default.
DEFAULT_OUTPUT_DIR = os.path.join("build", "lra")


class SuiteArgumentError(ArgumentError):
    """An invalid argument of :func:`run_suite`; ``argument`` names it
    (``"tasks"``) and ``flag`` is its command-line flag (``--tasks``)."""


def _split(value: Any, argument: str) -> list[str]:
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
    elif isinstance(value, Iterable):
        items = [str(item).strip() for item in value]
    else:
        raise SuiteArgumentError(argument, f"expected a comma-separated string or a list, "
                                           f"got {value!r}")
    items = [item for item in items if item]
    if not items:
        raise SuiteArgumentError(argument, "no value given")
    return items


def parse_tasks(value: Any = None) -> list[str]:
    """Task names from ``"listops,text"``, a list, ``"all"`` or ``None`` (all),
    in the order of the table's columns.

    Raises:
        SuiteArgumentError: an unknown task (argument ``tasks``).
    """
    if value is None:
        return available_tasks()
    names = [name.lower() for name in _split(value, "tasks")]
    if names == ["all"]:
        return available_tasks()
    for name in names:
        if name not in available_tasks():
            raise SuiteArgumentError(
                "tasks", f"unknown task {name!r}; choose from {', '.join(available_tasks())} "
                         "or all")
    return [name for name in available_tasks() if name in names]


def parse_seeds(value: Any) -> list[int]:
    """Seeds from a count (``3`` is seeds 0, 1, 2) or a list / comma-separated
    string of seeds (``"0,5"``).

    Raises:
        SuiteArgumentError: a count below 1, a negative seed or not an
            integer (argument ``seeds``).
    """
    if isinstance(value, str) and "," not in value:
        try:
            value = int(value.strip())
        except ValueError:
            raise SuiteArgumentError("seeds", f"expected a number of seeds or a "
                                              f"comma-separated list, got {value!r}") from None
    if isinstance(value, bool):
        raise SuiteArgumentError("seeds", f"expected an integer, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise SuiteArgumentError("seeds", f"the number of seeds must be >= 1, got {value}")
        return list(range(value))
    seeds = []
    for item in _split(value, "seeds"):
        try:
            seed = int(item)
        except ValueError:
            raise SuiteArgumentError("seeds", f"{item!r} is not an integer seed") from None
        if seed < 0:
            raise SuiteArgumentError("seeds", f"seeds must be >= 0, got {seed}")
        seeds.append(seed)
    return list(dict.fromkeys(seeds))


def _parse_size(value: Any) -> str:
    if value not in SIZES:
        raise SuiteArgumentError("size", f"unknown size {value!r}; choose from "
                                         f"{', '.join(SIZES)}")
    return value


def _parse_overrides(value: Mapping[str, Any] | None) -> dict[str, Any]:
    overrides = dict(value or {})
    for key, item in overrides.items():
        try:
            TaskSize(1, 1, 1, 1, 1, 1.0).replace(**{key: item})
        except ValueError as exc:
            raise SuiteArgumentError("overrides", str(exc)) from None
    return overrides


def default_window(seq_len: int) -> int:
    """The value of ``"${window}"`` at sequence length ``seq_len``: n / 8,
    at least 8 (the ``local`` layer's window)."""
    return max(8, seq_len // 8)


def resolve_layers(layers: Any, options: Mapping[str, Any] | None = None,
                   *, tasks: Sequence[str], size: str, overrides=None, window=None,
                   model_config=None) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """The labels of ``layers`` and, per label and task, the layer config the
    worker builds.

    ``"all"`` among ``layers`` stands for every registered short name
    (:func:`keras_longattn.specs.registry.available_layers`).

    A config's ``"${...}"`` placeholders are evaluated at the task's sequence
    length (variables ``seq_len``, ``batch``, ``num_heads``, ``key_dim``,
    ``head_dim``, ``window``; see
    :mod:`keras_longattn.specs.layer_spec`); ``num_heads`` and
    ``key_dim`` are filled in where the config does not set them (2 heads of
    ``64 // num_heads``). ``options`` are merged in like the benchmark's
    ``--option`` (``label.name`` for one layer).

    Raises:
        SuiteArgumentError: an unknown layer or a bad config (``layers``),
            an option naming no layer (``option``).
    """
    layers = [layers] if isinstance(layers, str) else list(layers or ["full"])
    if any(isinstance(item, str) and item.strip().lower() == "all" for item in layers):
        # "all": every registered short name, beside any other layer given.
        layers = registry.available_layers() + [
            item for item in layers
            if not (isinstance(item, str) and item.strip().lower() == "all")]
    try:
        specs = parse_layers(layers)
    except ArgumentError as exc:
        raise SuiteArgumentError(exc.argument, exc.detail) from None
    labels = [spec.label for spec in specs]
    options = parse_options(options)
    for key in options:
        prefix, dot, _ = key.rpartition(".")
        if dot and prefix not in labels:
            raise SuiteArgumentError("option", f"option {key!r} names no layer of this run; "
                                               f"the layers are {', '.join(labels)}")
    config = {**MODEL_CONFIG, **(model_config or {})}
    resolved: dict[str, dict[str, dict]] = {}
    for spec in specs:
        per_task = {}
        for name in tasks:
            task_size = get_task(name).size(size, overrides)
            layer_config = {**spec.config, **layer_options(spec.label, options)}
            heads = layer_config.get("num_heads", config["num_heads"])
            heads = heads if isinstance(heads, int) and heads > 0 else config["num_heads"]
            variables = {"seq_len": task_size.seq_len, "batch": task_size.batch_size,
                         "num_heads": heads, "key_dim": config["dim"] // heads,
                         "head_dim": config["dim"] // heads,
                         "window": window or default_window(task_size.seq_len)}
            try:
                layer_config = substitute_placeholders(layer_config, variables)
            except LayerConfigError as exc:
                raise SuiteArgumentError("layers", f"layer {spec.label!r}: {exc}") from None
            layer_config.setdefault("num_heads", heads)
            layer_config.setdefault("key_dim", config["dim"] // layer_config["num_heads"])
            per_task[name] = {**spec.to_dict(), "config": layer_config}
        resolved[spec.label] = per_task
    return labels, resolved


def _check(labels, resolved, backend, options) -> dict[str, str]:
    """Resolve every layer class and check its configs (one subprocess)."""
    items, seen = [], set()
    for label in labels:
        for spec in resolved[label].values():
            key = json.dumps([label, spec], sort_keys=True)
            if key not in seen:
                seen.add(key)
                items.append({"label": label, "layer_spec": spec})
    classes = {}
    for found in check_layer_specs(items, backend):
        if found.get("error"):
            unknown = found.get("unknown_options") or ()
            from_option = any(key in layer_options(found["label"], options) for key in unknown)
            raise SuiteArgumentError("option" if from_option else "layers", found["error"])
        classes.setdefault(found["label"], found.get("layer_class"))
    return classes


def _describe(index: int, total: int, job: Mapping[str, Any]) -> str:
    return f"[{index}/{total}] {job['task']} {job['layer']} {job['backend']}"


def run_suite(
    layers: Any = "full",
    tasks: Any = None,
    seeds: Any = 1,
    size: str = "ci",
    *,
    backend: str | None = None,
    options: Mapping[str, Any] | Sequence[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    window: int | None = None,
    model_config: Mapping[str, Any] | None = None,
    timeout: float = 3600.0,
    memory_limit_gb: float = 16.0,
    output_dir: str | os.PathLike | None = None,
    progress: bool | Progress = False,
    shuffle_labels: bool = False,
    isolate: bool = True,
) -> SuiteResults:
    """Train and evaluate every layer on every task, for every seed.

    Args:
        layers: the attention layers, as the benchmark takes them (see
            :func:`keras_longattn.specs.arguments.parse_layers`): registered
            short names (``"full,local"``; ``"all"`` for every registered
            one), class references or Keras layer configs
            (``{"class_name": "LocalAttention", "config": {"window": 64}}``,
            also as JSON), as a list or a comma-separated string. Defaults
            to ``"full"``.
        tasks: task names (:func:`~keras_longattn.lra.tasks.available_tasks`),
            a list or a comma-separated string; ``None`` or ``"all"`` for all
            five. Defaults to ``None``.
        seeds: a number of seeds (``3``: seeds 0, 1, 2) or a list of seeds.
            Defaults to 1.
        size: ``"tiny"``, ``"ci"`` or ``"full"`` (see
            :mod:`keras_longattn.lra.tasks`). Defaults to ``"ci"``.
        backend: ``"jax"``, ``"tensorflow"`` or ``"torch"``. Defaults to
            ``$KERAS_BACKEND``, else jax.
        options: layer constructor arguments merged into the configs,
            ``{"name": value}`` or ``["name=value"]``; ``"label.name"`` for
            one layer.
        overrides: replace some of every task's size
            (:data:`~keras_longattn.lra.tasks.OVERRIDABLE`), e.g.
            ``{"steps": 50}``.
        window: the value of ``"${window}"`` in layer configs (the ``local``
            layer's window). Defaults to ``None``: n / 8 per task, at least 8.
        model_config: overrides of the model's configuration
            (:data:`keras_longattn.lra.worker.MODEL_CONFIG`: 2 layers, width
            64, feed-forward 128, 2 heads).
        timeout: seconds per (layer, task) subprocess before it is killed.
        memory_limit_gb: RSS limit of a subprocess before it is killed.
        output_dir: when given, write the JSON and CSV reports there
            (:meth:`SuiteResults.write`).
        progress: ``True`` for progress lines on stderr, or a
            :class:`~keras_longattn.specs.progress.Progress`.
        shuffle_labels: train on permuted labels (a deliberately broken
            run that must score chance; for testing the suite).
        isolate: run every (layer, task) in a fresh subprocess (default).
            ``False`` runs them in this process, whose Keras backend must be
            ``backend``: faster to start, but the peak memory then includes
            what earlier jobs left behind and no timeout or memory guard
            applies (for tests and quick looks).

    Returns:
        :class:`~keras_longattn.lra.report.SuiteResults`: one row per
        (layer, task, seed), with ``.table()``, ``.to_json()``,
        ``.to_csv()``.

    Raises:
        SuiteArgumentError: an invalid argument (its ``argument`` names it),
            including an unknown layer class and an option that a layer's
            constructor does not accept.
    """
    size = _parse_size(size)
    task_names = parse_tasks(tasks)
    seed_list = parse_seeds(seeds)
    overrides = _parse_overrides(overrides)
    try:
        backend_name = parse_backends(backend if backend is not None else default_backend())
    except ArgumentError as exc:
        raise SuiteArgumentError("backend", exc.detail) from None
    if len(backend_name) != 1:
        raise SuiteArgumentError("backend", f"expected one backend, got {backend!r}")
    backend_name = backend_name[0]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise SuiteArgumentError("window", f"must be an integer >= 1, got {window!r}")
    for name, value in (("timeout", timeout), ("memory_limit_gb", memory_limit_gb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise SuiteArgumentError(name, f"must be > 0, got {value!r}")
    labels, resolved = resolve_layers(layers, options, tasks=task_names, size=size,
                                      overrides=overrides, window=window,
                                      model_config=model_config)
    options = parse_options(options)
    display = progress if isinstance(progress, Progress) else make_progress(bool(progress))

    try:
        layer_classes = _check(labels, resolved, backend_name, options)
    except RuntimeError as exc:  # the workers will say what is wrong
        display.note(f"warning: {exc}")
        layer_classes = {}
    limit, warning = memory_limit_bytes(memory_limit_gb)
    if warning:
        display.note(f"warning: {warning}")
    sizes = {name: get_task(name).size(size, overrides) for name in task_names}
    metadata: dict[str, Any] = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "size": size,
        "tasks": task_names,
        "layers": labels,
        "seeds": seed_list,
        "backend": backend_name,
        "task_sizes": {name: task_size.to_dict() for name, task_size in sizes.items()},
        "model_config": {**MODEL_CONFIG, **dict(model_config or {})},
        "layer_specs": resolved,
        "layer_classes": layer_classes,
        "options": options,
        "shuffle_labels": bool(shuffle_labels),
        "isolated": bool(isolate),
        "machine": machine_info(),
        "memory_method": "peak RSS increase over the RSS once the model is built, the peak "
                         "counter reset after the first (compiling) step; device allocator "
                         "peak on accelerators (keras_longattn.lra.worker)",
    }
    jobs = [{"backend": backend_name, "task": name, "size": sizes[name].to_dict(),
             "seeds": seed_list, "layer": label, "layer_spec": resolved[label][name],
             "model_config": dict(model_config or {}), "shuffle_labels": bool(shuffle_labels)}
            for label in labels for name in task_names]
    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    try:
        for index, job in enumerate(jobs, start=1):
            prefix = _describe(index, len(jobs), job)
            display.note(f"{prefix}: n={sizes[job['task']].seq_len}, "
                         f"{sizes[job['task']].steps} steps x {len(seed_list)} seed(s) ...")

            def on_line(line: str, prefix=prefix) -> None:
                if line.startswith(PROGRESS_MARKER):
                    info = json.loads(line[len(PROGRESS_MARKER):])
                    display.note(f"{prefix} seed {info['seed']}: step {info['step']}/"
                                 f"{info['steps']} loss {info['loss']:.4f} "
                                 f"({info['elapsed_s']:.1f} s)")

            if isolate:
                outcome = run_job(job, timeout, limit, module="keras_longattn.lra.worker",
                                  on_line=on_line)
            else:
                outcome = worker.run_job(job, emit=on_line)
            new_rows = _rows(job, outcome)
            rows.extend(new_rows)
            display.note(f"{prefix}: " + "; ".join(_describe_row(row) for row in new_rows))
    except KeyboardInterrupt as interrupt:
        metadata["interrupted"] = True
        interrupt.results = SuiteResults(rows, metadata)
        raise
    finally:
        display.close()
    metadata["interrupted"] = False
    metadata["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    metadata["wall_s"] = time.monotonic() - start
    results = SuiteResults(rows, metadata)
    if output_dir is not None:
        results.write(output_dir)
    return results


def _rows(job: Mapping[str, Any], outcome: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per seed of a job's outcome."""
    base = {"layer": job["layer"], "task": job["task"], "backend": job["backend"],
            "seq_len": job["size"]["seq_len"], "steps": job["size"]["steps"],
            "batch_size": job["size"]["batch_size"]}
    by_seed = {item["seed"]: item for item in outcome.get("seeds", [])}
    rows = []
    for seed in job["seeds"]:
        row = {**base, "seed": seed}
        if seed in by_seed:
            row.update(status="ok", message="", **by_seed[seed])
            row["peak_memory_mib"] = row["peak_memory_bytes"] / float(1 << 20)
        else:
            row.update(status=outcome.get("status") if outcome.get("status") != "ok"
                       else "error", message=outcome.get("message", ""))
            if outcome.get("stderr_tail") or outcome.get("traceback"):
                row["detail"] = outcome.get("traceback") or outcome.get("stderr_tail")
        rows.append(row)
    return rows


def _describe_row(row: Mapping[str, Any]) -> str:
    if row["status"] != "ok":
        return f"seed {row['seed']} {row['status']}: {row['message']}"
    return (f"seed {row['seed']} accuracy {100 * row['accuracy']:.1f}%, "
            f"{row['step_ms']:.1f} ms/step, peak {row['peak_memory_mib']:.0f} MiB")
