"""The benchmark orchestrator: one fresh subprocess per configuration.

For every (backend, length, layer, mode) the runner starts
``python -m keras_longattn.benchmarks.worker`` with ``KERAS_BACKEND`` set,
under a wall-clock timeout and a memory guard: a thread polls the child's
resident set size (with ``psutil`` when importable, else
``/proc/<pid>/status``) and kills it above the memory limit, which records
status ``"oom"``. A worker killed by ``SIGKILL`` from elsewhere (the system
OOM killer) is recorded as ``"oom"`` as well; a crash is ``"error"``, a
timeout ``"timeout"``, both with the last lines of the worker's stderr.

Skip-ahead: when a layer runs out of memory or time at length ``n`` in a mode,
its longer lengths in that mode and in the costlier modes (``fwdbwd`` after
``fwd``), and the costlier modes at ``n`` itself, are recorded as
``"skipped"`` instead of being run.

Before measuring, :func:`check_layers` resolves every layer's class and
checks its config (an unknown class or an option that the constructor does
not accept is a :class:`~keras_longattn.benchmarks.BenchmarkArgumentError`):
in this process when Keras is imported here already, else in one worker
subprocess, so that the runner process imports no backend itself.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from keras_longattn.specs.progress import Progress, make_progress
from keras_longattn.specs.resolver import check_specs

from . import peers
from .config import MODES, BenchmarkArgumentError, BenchmarkConfig
from .efficiency import annotate as annotate_efficiency
from .report import compute_ratios, write_reports
from .worker import RESULT_MARKER

__all__ = [
    "BenchmarkResults",
    "run_benchmark",
    "execute",
    "run_job",
    "plan_jobs",
    "check_layers",
    "check_layer_specs",
    "machine_info",
    "memory_limit_bytes",
    "DEFAULT_OUTPUT_DIR",
]

#: Where the CLI writes its reports by default.
DEFAULT_OUTPUT_DIR = os.path.join("build", "benchmarks")

GIB = float(1 << 30)

#: Lines of worker stderr kept in a failed row.
STDERR_TAIL_LINES = 20

#: Seconds between two polls of the child's memory.
POLL_INTERVAL = 0.05

#: Wall-clock limit in seconds of the subprocess of :func:`check_layers`.
CHECK_TIMEOUT = 300.0

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


class BenchmarkResults(list):
    """The result rows (a ``list`` of dicts) plus the run's metadata.

    Attributes:
        config: the validated :class:`BenchmarkConfig`.
        metadata: what the JSON report holds besides the rows (config,
            machine, start and end times).
        paths: the report files written (empty without ``output_dir``).
    """

    def __init__(self, rows: Iterable[dict], config: BenchmarkConfig,
                 metadata: dict[str, Any], paths: dict[str, Path] | None = None):
        super().__init__(rows)
        self.config = config
        self.metadata = metadata
        self.paths = paths or {}


# ---------------------------------------------------------------------------
# Machine and memory
# ---------------------------------------------------------------------------


def _total_memory_bytes() -> int | None:
    """Physical memory, or the cgroup limit of this container when lower."""
    total = None
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemTotal:"):
                        total = int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            total = int(text) if total is None else min(total, int(text))
    return total


def memory_limit_bytes(limit_gb: float) -> tuple[int, str | None]:
    """The memory guard's limit in bytes and a warning when it was lowered.

    The requested limit is capped at 90 % of the machine's (or container's)
    memory, so that the guard acts before the system runs out.
    """
    requested = int(limit_gb * GIB)
    total = _total_memory_bytes()
    if total is not None and requested > 0.9 * total:
        capped = int(0.9 * total)
        return capped, (
            f"memory limit {limit_gb:g} GiB exceeds 90% of this machine's "
            f"{total / GIB:.1f} GiB; using {capped / GIB:.1f} GiB"
        )
    return requested, None


def _package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine_info() -> dict[str, Any]:
    """Platform, CPUs, memory and package versions (without importing backends)."""
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable_cpus = os.cpu_count()
    total = _total_memory_bytes()
    longattn = sys.modules.get("keras_longattn")
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "memory_total_gib": None if total is None else round(total / GIB, 2),
        "hostname": platform.node(),
        "versions": {
            "keras_longattn": getattr(longattn, "__version__", None)
            or _package_version("keras-longattn"),
            "keras": _package_version("keras"),
            "numpy": _package_version("numpy"),
            "jax": _package_version("jax"),
            "jaxlib": _package_version("jaxlib"),
            "tensorflow": _package_version("tensorflow", "tensorflow-cpu", "tf-nightly"),
            "torch": _package_version("torch"),
        },
    }


# ---------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------


class _MemoryGuard(threading.Thread):
    """Polls a process's RSS (with its children) and kills it above a limit."""

    def __init__(self, process: subprocess.Popen, limit_bytes: int,
                 kill: Callable[[], None], interval: float = POLL_INTERVAL):
        super().__init__(name=f"memory-guard-{process.pid}", daemon=True)
        self.process = process
        self.limit_bytes = limit_bytes
        self.kill = kill
        self.interval = interval
        self.max_rss = 0
        self.exceeded_at: int | None = None
        self.available = True
        self._stop_event = threading.Event()
        self._psutil_process = None
        try:
            import psutil

            self._psutil_process = psutil.Process(process.pid)
        except ImportError:
            self.available = os.path.exists(f"/proc/{process.pid}/status")
        except Exception:  # noqa: BLE001 - the child may be gone already
            pass

    def _rss(self) -> int | None:
        if self._psutil_process is not None:
            import psutil

            try:
                total = self._psutil_process.memory_info().rss
                for child in self._psutil_process.children(recursive=True):
                    try:
                        total += child.memory_info().rss
                    except psutil.Error:
                        pass
                return total
            except psutil.Error:
                return None
        try:
            with open(f"/proc/{self.process.pid}/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None

    def run(self) -> None:
        while not self._stop_event.is_set() and self.process.poll() is None:
            rss = self._rss()
            if rss is not None:
                self.max_rss = max(self.max_rss, rss)
                if rss > self.limit_bytes:
                    self.exceeded_at = rss
                    self.kill()
                    return
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the worker and its process group (it runs in its own session)."""
    if process.poll() is not None:
        return
    try:
        if hasattr(os, "killpg"):
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    except (ProcessLookupError, PermissionError, OSError):
        try:
            process.kill()
        except OSError:
            pass


def _child_env(backend: str) -> dict[str, str]:
    env = dict(os.environ)
    env["KERAS_BACKEND"] = backend
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Allocate accelerator memory on demand, so that peaks are measurable
    # and a backend does not grab the whole device.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # A measurement never depends on a compilation cache: a program loaded
    # from JAX's persistent cache (scripts/test.sh keeps one) skips the
    # compiler and its memory, which moves peak-memory ratios.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    # The worker must import this very keras_longattn, installed or not.
    paths = [_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _parse_result(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            try:
                return json.loads(line[len(RESULT_MARKER):])
            except ValueError:
                return None
    return None


def _stream(process: subprocess.Popen, timeout: float,
            on_line: Callable[[str], None]) -> tuple[str, str]:
    """Read the worker's stdout line by line (calling ``on_line``) and its
    stderr in threads, until it exits; like ``communicate(timeout=...)``.

    Raises:
        subprocess.TimeoutExpired: the worker ran longer than ``timeout``;
            it is killed first, and the readers have finished.
    """
    deadline = time.monotonic() + timeout
    out_lines: list[str] = []
    err_lines: list[str] = []

    def read_stdout() -> None:
        for line in process.stdout:
            out_lines.append(line)
            on_line(line.rstrip("\n"))

    def read_stderr() -> None:
        err_lines.extend(process.stderr)

    readers = [threading.Thread(target=read, daemon=True) for read in (read_stdout, read_stderr)]
    for reader in readers:
        reader.start()
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_tree(process)
        process.wait()
        for reader in readers:
            reader.join(timeout=5.0)
        raise
    for reader in readers:
        reader.join(timeout=max(1.0, deadline - time.monotonic()))
    return "".join(out_lines), "".join(err_lines)


def run_job(job: Mapping[str, Any], timeout: float, memory_limit: int,
            python: str | None = None, module: str = "keras_longattn.benchmarks.worker",
            on_line: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one configuration in a fresh worker subprocess.

    Args:
        job: the worker configuration (see ``worker.DEFAULT_CONFIG``); its
            ``backend`` sets ``KERAS_BACKEND``.
        timeout: wall-clock limit in seconds.
        memory_limit: RSS limit of the worker in bytes.
        python: the interpreter (``sys.executable`` by default).
        module: the worker module, run as ``python -m MODULE '<json job>'``;
            it prints its result after :data:`RESULT_MARKER`. Defaults to the
            benchmark's worker (the LRA suite has its own).
        on_line: called with every line of the worker's stdout as it comes
            (for a live progress display). Defaults to ``None``: the output
            is read at the end.

    Returns:
        The worker's result merged with ``status``, ``message``, ``wall_s``,
        ``returncode``, ``observed_max_rss_bytes`` and, unless ok,
        ``stderr_tail``.
    """
    command = [python or sys.executable, "-m", module, json.dumps(dict(job))]
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(job["backend"]),
        text=True,
        errors="replace",
        start_new_session=True,
    )
    guard = _MemoryGuard(process, memory_limit, lambda: _kill_tree(process))
    guard.start()
    timed_out = False
    try:
        try:
            if on_line is None:
                stdout, stderr = process.communicate(timeout=timeout)
            else:
                stdout, stderr = _stream(process, timeout, on_line)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(process)
            # After _stream's timeout its readers have drained the pipes.
            stdout, stderr = process.communicate() if on_line is None else ("", "")
    except BaseException:
        _kill_tree(process)
        process.wait()
        raise
    finally:
        guard.stop()
        guard.join()
    wall = time.monotonic() - start

    result = _parse_result(stdout) if not (timed_out or guard.exceeded_at) else None
    row: dict[str, Any] = dict(result or {})
    if guard.exceeded_at is not None:
        row["status"] = "oom"
        row["message"] = (
            f"killed by the memory guard: RSS {guard.exceeded_at / GIB:.2f} GiB > "
            f"limit {memory_limit / GIB:.2f} GiB"
        )
    elif timed_out:
        row["status"] = "timeout"
        row["message"] = f"no result after {timeout:g} s; killed"
    elif result is None:
        if process.returncode == -getattr(signal, "SIGKILL", 9):
            row["status"] = "oom"
            row["message"] = "worker killed by SIGKILL (probably the system OOM killer)"
        else:
            row["status"] = "error"
            last = _tail(stderr, 1) or "(no output)"
            row["message"] = f"worker exited with code {process.returncode} without a result: {last}"
    row.setdefault("message", "")
    row["wall_s"] = wall
    row["returncode"] = process.returncode
    row["observed_max_rss_bytes"] = guard.max_rss or None
    if row["status"] != "ok":
        row["stderr_tail"] = _tail(stderr)
    return row


# ---------------------------------------------------------------------------
# The whole run
# ---------------------------------------------------------------------------


def plan_jobs(config: BenchmarkConfig) -> list[dict[str, Any]]:
    """All configurations in run order: backend, length, layer, mode.

    Each job holds the layer's label (``layer``), the layer config it builds
    at that length (``layer_spec``, see :meth:`BenchmarkConfig.layer_spec`)
    and the ``--option`` values applied to it (``options``).
    """
    jobs = []
    for backend in config.backends:
        for seq_len in config.lengths:
            for layer in config.layers:
                spec = config.layer_spec(layer, seq_len)
                for mode in config.modes:
                    jobs.append({
                        "backend": backend,
                        "layer": layer,
                        "layer_spec": spec,
                        "seq_len": seq_len,
                        "mode": mode,
                        "batch": config.batch,
                        "num_heads": config.num_heads,
                        "head_dim": config.head_dim,
                        "window": config.window,
                        "causal": config.causal,
                        "scope": config.scope,
                        "repeats": config.repeats,
                        "warmup": config.warmup,
                        "options": config.layer_options(layer),
                        "tf_jit": config.tf_jit,
                        "seed": config.seed,
                        "efficiency": config.efficiency,
                        "settle_allocator": config.settle_allocator,
                    })
    return jobs


def check_layers(config: BenchmarkConfig, in_process: bool | None = None,
                 python: str | None = None, timeout: float = CHECK_TIMEOUT) -> dict[str, str]:
    """Resolve every layer's class and check its configs before measuring.

    Each distinct layer config of the run (one per layer and length) is
    resolved, checked against the constructor's keyword arguments and
    constructed (without weights), as the worker will do.

    Args:
        config: the validated benchmark request.
        in_process: check in this process (imports the layer classes). Defaults
            to ``None``: in this process when Keras is imported already, else
            in a worker subprocess on the first backend.
        python: the interpreter of the subprocess. Defaults to
            ``sys.executable``.
        timeout: wall-clock limit of the subprocess in seconds. Defaults to
            :data:`CHECK_TIMEOUT`.

    Returns:
        The layer class of each label (``"module.Class"``).

    Raises:
        BenchmarkArgumentError: an unknown class or option, or a config the
            constructor rejects; the message names the layer (and the
            option with the accepted ones). Argument ``option`` when the
            option came from ``--option``, else ``layers``.
        RuntimeError: the subprocess gave no answer.
    """
    items, seen = [], set()
    for label in config.layers:
        for seq_len in config.lengths:
            spec = config.layer_spec(label, seq_len)
            key = json.dumps([label, spec], sort_keys=True)
            if key not in seen:
                seen.add(key)
                items.append({"label": label, "layer_spec": spec})
    results = check_layer_specs(items, config.backends[0], in_process, python, timeout)
    classes: dict[str, str] = {}
    for result in results:
        label = result["label"]
        if result.get("error"):
            unknown = result.get("unknown_options") or ()
            explicit = config.layer_options(label)
            from_option = any(key in explicit for key in unknown)
            message = result["error"]
            shared = [key for key in unknown if key in config.options]
            if shared:
                message += (f" (--option {shared[0]}=... applies to every layer; "
                            f"LABEL.{shared[0]}=... applies to one)")
            raise BenchmarkArgumentError("option" if from_option else "layers", message)
        classes.setdefault(label, result.get("layer_class"))
    return classes


def check_layer_specs(items: list[dict], backend: str, in_process: bool | None = None,
                      python: str | None = None,
                      timeout: float = CHECK_TIMEOUT) -> list[dict]:
    """:func:`~keras_longattn.specs.resolver.check_specs` of resolved
    layer configs, here or in a worker subprocess.

    Args:
        items: dicts ``{"label": ..., "layer_spec": {...}}``.
        backend: the backend of the subprocess.
        in_process: check in this process. Defaults to ``None``: here when
            Keras is imported already, else in a subprocess.
        python: the interpreter of the subprocess (``sys.executable``).
        timeout: wall-clock limit of the subprocess in seconds.

    Returns:
        The findings of ``check_specs``, one per item.

    Raises:
        RuntimeError: the subprocess gave no answer.
    """
    if in_process is None:
        in_process = "keras" in sys.modules
    if in_process:
        return check_specs(items)
    return _check_in_subprocess(items, backend, python, timeout)


def _check_in_subprocess(items: list[dict], backend: str, python: str | None,
                         timeout: float) -> list[dict]:
    command = [python or sys.executable, "-m", "keras_longattn.benchmarks.worker", "--check",
               json.dumps(items)]
    try:
        completed = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                                   text=True, errors="replace", env=_child_env(backend),
                                   timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"checking the layers took more than {timeout:g} s") from None
    answer = _parse_result(completed.stdout)
    if not isinstance(answer, dict) or "checks" not in answer:
        raise RuntimeError(
            "checking the layers failed (worker exit code "
            f"{completed.returncode}): {_tail(completed.stderr, 5) or '(no output)'}"
        )
    return answer["checks"]


class _SkipAhead:
    """Remembers out-of-memory and timeouts to skip costlier configurations."""

    def __init__(self) -> None:
        self._failures: dict[tuple[str, str], list[tuple[int, int, str]]] = {}

    def record(self, job: Mapping[str, Any], status: str) -> None:
        if status in ("oom", "timeout"):
            key = (job["backend"], job["layer"])
            self._failures.setdefault(key, []).append(
                (MODES.index(job["mode"]), job["seq_len"], status))

    def reason(self, job: Mapping[str, Any]) -> str | None:
        mode = MODES.index(job["mode"])
        for failed_mode, seq_len, status in self._failures.get((job["backend"], job["layer"]), ()):
            if job["seq_len"] >= seq_len and mode >= failed_mode:
                return f"{job['layer']} {MODES[failed_mode]} {status} at n={seq_len}"
        return None


def _row(job: Mapping[str, Any], outcome: Mapping[str, Any]) -> dict[str, Any]:
    """The report row of ``job``: its settings, then the worker's outcome."""
    row = dict(job)
    row.update(outcome)
    peak = row.get("peak_memory_bytes")
    row["peak_memory_mib"] = peak / float(1 << 20) if isinstance(peak, (int, float)) else None
    return row


def execute(config: BenchmarkConfig, progress: Progress | None = None) -> BenchmarkResults:
    """Run every configuration of ``config`` and compute the ratios.

    The layers are checked first (:func:`check_layers`). On
    ``KeyboardInterrupt`` the running worker is killed, the remaining
    configurations are recorded as skipped, and the interrupt propagates with
    the partial :class:`BenchmarkResults` as ``exc.results``.
    """
    progress = progress if progress is not None else Progress()
    try:
        layer_classes = check_layers(config)
    except RuntimeError as exc:
        # The workers will report what is wrong, configuration by configuration.
        progress.note(f"warning: {exc}")
        layer_classes = {}
    started = datetime.now(timezone.utc)
    limit, warning = memory_limit_bytes(config.memory_limit_gb)
    if warning:
        progress.note(f"warning: {warning}")
    metadata: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "config": {**config.to_dict(), "memory_limit_bytes": limit,
                   "python_executable": sys.executable},
        "machine": machine_info(),
        "layer_classes": layer_classes,
        "memory_method": (
            "peak RSS increase over the RSS after the inputs and the layer are "
            "built (see keras_longattn.benchmarks.worker); device allocator "
            "peak on accelerators"
        ),
    }
    jobs = plan_jobs(config)
    total = len(jobs)
    skip = _SkipAhead()
    rows: list[dict[str, Any]] = []
    try:
        for index, job in enumerate(jobs, start=1):
            reason = skip.reason(job) or peers.skip_reason(job)
            if reason is not None:
                outcome = {"status": "skipped", "message": reason}
                progress.start(index, total, {**job, "status": "skipped"})
            else:
                progress.start(index, total, job)
                outcome = run_job(job, config.timeout, limit)
                skip.record(job, outcome["status"])
            row = _row(job, outcome)
            rows.append(row)
            progress.finish(index, total, job, row)
    except KeyboardInterrupt as interrupt:
        for job in jobs[len(rows):]:
            rows.append(_row(job, {"status": "skipped", "message": "interrupted"}))
        compute_ratios(rows, config.baseline)
        metadata["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        metadata["interrupted"] = True
        interrupt.results = BenchmarkResults(rows, config, metadata)
        raise
    finally:
        progress.close()
    compute_ratios(rows, config.baseline)
    annotate_efficiency(rows)
    metadata["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    metadata["interrupted"] = False
    return BenchmarkResults(rows, config, metadata)


def run_benchmark(
    layers: Any,
    lengths: str | int | Sequence[int],
    backends: str | Sequence[str] | None = None,
    *,
    modes: str | Sequence[str] = MODES,
    batch: int = 1,
    num_heads: int = 4,
    head_dim: int = 64,
    window: int = 256,
    causal: bool = True,
    repeats: int = 5,
    warmup: int = 1,
    timeout: float = 600.0,
    memory_limit_gb: float = 16.0,
    options: Mapping[str, Any] | Sequence[str] | None = None,
    tf_jit: bool = True,
    baseline: Any = "full",
    seed: int = 0,
    scope: str = "layer",
    output_dir: str | os.PathLike | None = None,
    progress: bool | Progress = False,
    efficiency: bool = False,
    settle_allocator: bool = True,
) -> BenchmarkResults:
    """Benchmark layers; every configuration runs in a fresh subprocess.

    Args:
        layers: the layers, each a registered short name (``"local"``, see
            :func:`keras_longattn.benchmarks.register`), a class reference
            (``"keras_longattn>LocalAttention"``, ``"my_package.layers:MyAttention"``)
            or a Keras layer config (``{"class_name": "LocalAttention",
            "config": {"window": 128}}``, also as JSON text); a list, or a
            comma-separated string of names (see
            :func:`keras_longattn.benchmarks.config.parse_layers`). A row's
            ``layer`` is the short name, else the config's ``"name"``, else
            the class name.
        lengths: sequence lengths.
        backends: ``"jax"``, ``"tensorflow"``, ``"torch"``; default
            ``$KERAS_BACKEND`` or jax.
        modes: ``"fwd"`` and/or ``"fwdbwd"``.
        batch: batch size B.
        num_heads: heads H; the ``num_heads`` of every layer config that does
            not set it (a config setting another value is an error).
        head_dim: size d of each head; the inputs are ``(B, n, H * d)``; the
            ``key_dim`` of every layer config that does not set it.
        window: the value of ``"${window}"`` in layer configs (the ``local``
            layer's window).
        causal: causal attention (``use_causal_mask=True``).
        repeats: timed calls per configuration (the median is reported).
        warmup: untimed calls before them (the first one compiles).
        timeout: seconds per configuration before it is killed.
        memory_limit_gb: RSS limit per worker before it is killed (``oom``).
        options: constructor arguments set in the layer configs,
            ``{"name": value}`` or ``["name=value"]``; ``"label.name"``
            targets one layer, a bare ``"name"`` every layer. An option that
            a layer's constructor does not accept is an error.
        tf_jit: ``jit_compile`` of the TensorFlow ``tf.function``.
        baseline: layer the ratios compare with: the label of one of
            ``layers``, or a layer given like them (added when missing);
            ``None`` for no ratios.
        seed: seed of the inputs and the weights.
        scope: ``"layer"`` times the whole layer (projections included);
            ``"attention"`` times only ``layer.attend`` on projected heads,
            which excludes the four projections every layer shares.
        output_dir: when given, write the JSON and CSV reports there.
        progress: ``True`` for the progress display on stderr, or a
            :class:`~keras_longattn.specs.progress.Progress`.
        efficiency: also time a float32 matmul in every worker, the peak
            against which rows report their useful-FLOP throughput
            (:mod:`~keras_longattn.benchmarks.efficiency`; the throughput
            itself is always reported where the layer has a definition).
        settle_allocator: before timing, put glibc's ``malloc`` in the
            state of a process that has freed a large block, so that freed
            memory is reused instead of faulted in again by every call
            (:func:`keras_longattn.benchmarks.worker.settle_allocator`;
            recorded as ``allocator_settled``). Defaults to True.

    Returns:
        One dict per configuration (see :mod:`keras_longattn.benchmarks.report`),
        as a :class:`BenchmarkResults` list that also holds ``metadata`` and
        the written ``paths``.

    Raises:
        BenchmarkArgumentError: an invalid argument (the message names it),
            including an unknown layer class and an option that a layer's
            constructor does not accept.
    """
    config = BenchmarkConfig.create(
        layers=layers, lengths=lengths, backends=backends, modes=modes, batch=batch,
        num_heads=num_heads, head_dim=head_dim, window=window, causal=causal,
        repeats=repeats, warmup=warmup, timeout=timeout, memory_limit_gb=memory_limit_gb,
        options=options, tf_jit=tf_jit, baseline=baseline, seed=seed, scope=scope,
        efficiency=efficiency, settle_allocator=settle_allocator,
    )
    if isinstance(progress, Progress):
        display = progress
    else:
        display = make_progress(bool(progress))
    try:
        results = execute(config, display)
    except KeyboardInterrupt as interrupt:
        partial = getattr(interrupt, "results", None)
        if output_dir is not None and partial is not None:
            partial.paths = write_reports(partial, partial.metadata, output_dir)
            display.note(f"partial results written to {partial.paths['json']}")
        raise
    if output_dir is not None:
        results.paths = write_reports(results, results.metadata, output_dir)
    return results
