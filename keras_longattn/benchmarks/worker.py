"""Measure one benchmark configuration in the current process.

The runner launches this module in a fresh subprocess per configuration::

    KERAS_BACKEND=jax python -m keras_longattn.benchmarks.worker '<json config>'

(the argument may also be ``@path`` to a JSON file). The worker builds random
float32 inputs of shape ``(batch, seq_len, num_heads * head_dim)`` and the
layer from its Keras layer config (``layer_spec``, built by
:func:`keras_longattn.specs.resolver.build_layer` with
``keras.saving.deserialize_keras_object``), compiles and warms up, then
times ``repeats`` calls and prints one line::

    @@KERAS_LONGATTN_BENCH_RESULT@@ {"status": "ok", "median_ms": ..., ...}

to stdout; the marker lets the runner find it among library log output.

``python -m keras_longattn.benchmarks.worker --check '<json list>'`` only
resolves, checks and constructs layer configs
(:func:`keras_longattn.specs.resolver.check_specs`) and prints
``{"checks": [...]}`` after the same marker.

What is timed, per backend:

* **jax**: ``jax.jit`` of ``layer.stateless_call(...)`` (``fwd``), or
  ``jax.jit(jax.grad(...))`` of the mean output w.r.t. the input and all
  trainable weights (``fwdbwd``); each call ends with ``block_until_ready``.
* **tensorflow**: ``tf.function(jit_compile=tf_jit)`` of the layer call
  (``fwd``), or of a ``GradientTape`` computing the same gradients
  (``fwdbwd``); each call ends with a device synchronisation.
* **torch**: eager calls, under ``torch.no_grad()`` for ``fwd``; ``fwdbwd``
  uses ``torch.autograd.grad`` for the same gradients; on CUDA each call ends
  with ``torch.cuda.synchronize()``.

With ``scope="attention"`` the timed layer is the attention alone: the
input ``(batch, seq_len, num_heads * head_dim)`` is split into heads and
given as query, key and value to ``layer.attend`` (the projections are
frozen and unused; the gradient is w.r.t. the input only). This measures
what differs between two attention layers, without the four projections
that every layer shares.

Peak memory (the same method for every layer, so ratios are meaningful):

* Host (CPU runs): the increase of the process's peak resident set size over
  a baseline taken after the inputs and the layer's weights exist and before
  the first call. On Linux the baseline is the current RSS (``VmRSS``), the
  peak-RSS counter is reset after warm-up (``/proc/self/clear_refs``) and the
  peak is ``VmHWM`` after the timed calls: memory kept after warm-up
  (compiled programs, allocator caches) counts, a transient compile-time peak
  does not (``memory_method = "rss-hwm"``). Where that reset is unavailable,
  the increase of ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` over its value
  at the baseline is used (``"ru_maxrss"``), which includes compilation.
* Accelerator runs: the increase of the device allocator's peak over the
  bytes in use at the baseline (``"device"``); the host figures are still
  recorded as ``host_peak_increase_bytes``.

Each timed call also records the process's minor page faults during it
(``page_faults``, one count per call, as ``times_ms``): on the CPU a call
that finds its memory returned to the system by the allocator pays for
faulting it in again, the main source of the spread of fast calls here.
The allocator's settings in the environment (glibc's ``MALLOC_*`` tunables,
``GLIBC_TUNABLES``, ``LD_PRELOAD``) are recorded as ``allocator``. Unless
``settle_allocator`` is false, the worker first settles glibc's ``malloc``
(:func:`settle_allocator`: one free of a 31 MiB block, so that it keeps
freed memory as a process with large tensors does) and records
``allocator_settled``; every layer of a run, the baseline included, is
measured so.

Only this module imports a backend, and only inside the backend-specific
functions.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from typing import Any, Callable

__all__ = ["RESULT_MARKER", "DEFAULT_CONFIG", "HostMemory", "accelerator_memory", "run_config",
           "main"]

#: Prefix of the result line on stdout.
RESULT_MARKER = "@@KERAS_LONGATTN_BENCH_RESULT@@ "

#: Defaults of the configuration keys (the runner always sends all of them).
DEFAULT_CONFIG: dict[str, Any] = {
    "backend": None,
    "layer": "full",
    "layer_spec": None,
    "seq_len": 1024,
    "batch": 1,
    "num_heads": 4,
    "head_dim": 64,
    "window": 256,
    "causal": True,
    "scope": "layer",
    "mode": "fwd",
    "repeats": 5,
    "warmup": 1,
    "options": {},
    "tf_jit": True,
    "seed": 0,
    "efficiency": False,
    "settle_allocator": True,
}

_OOM_PATTERNS = (
    "resource_exhausted",
    "resource exhausted",
    "out of memory",
    "outofmemory",
    "can't allocate memory",
    "cannot allocate memory",
    "failed to allocate",
    "oom when allocating",
)


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------


def _proc_status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _ru_maxrss_bytes() -> int:
    """``ru_maxrss`` of this process in bytes (KiB on Linux, bytes on macOS)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(value) if sys.platform == "darwin" else int(value) * 1024


def _minor_faults() -> int:
    """Minor page faults of this process so far: memory the allocator gave
    back to the system and takes again is faulted in page by page, which
    can add milliseconds to a fast call (recorded per timed call as
    ``page_faults``)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        return False
    hwm = _proc_status_bytes("VmHWM")
    rss = _proc_status_bytes("VmRSS")
    # After a successful reset the peak equals the current RSS (give or take
    # pages touched in between).
    return hwm is not None and rss is not None and hwm <= rss + (64 << 20)


class HostMemory:
    """Peak host memory of this process over a baseline (see module doc)."""

    def __init__(self) -> None:
        self.method = "rss-hwm" if _proc_status_bytes("VmHWM") is not None else "ru_maxrss"
        self.baseline = 0
        self._baseline_maxrss = 0

    def start(self) -> None:
        """Record the baseline (call before the first layer call)."""
        gc.collect()
        self._baseline_maxrss = _ru_maxrss_bytes()
        if self.method == "rss-hwm":
            self.baseline = _proc_status_bytes("VmRSS") or 0
        else:
            self.baseline = self._baseline_maxrss

    def after_warmup(self) -> None:
        """Reset the peak counter so that the timed calls define the peak."""
        if self.method == "rss-hwm" and not _reset_peak_rss():
            # No reset: use ru_maxrss over its own baseline; the warm-up is
            # then included in the peak.
            self.method = "ru_maxrss"
            self.baseline = self._baseline_maxrss

    def peak(self) -> int:
        """The peak RSS since the reset (or since start), in bytes."""
        if self.method == "rss-hwm":
            return _proc_status_bytes("VmHWM") or 0
        return _ru_maxrss_bytes()

    def increase(self) -> int:
        """Peak minus baseline, in bytes (never negative)."""
        return max(0, self.peak() - self.baseline)


def record_failure(result: dict, stage: str, exc: BaseException) -> None:
    """Turns an exception raised while measuring into ``result``'s status
    (``"oom"`` or ``"error"``), a one-line message naming ``stage`` and the
    traceback's tail; a ``KeyboardInterrupt`` is raised again."""
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    result["status"] = "oom" if _is_oom(exc) else "error"
    first_line = (str(exc).strip().splitlines() or [""])[0]
    result["message"] = f"{stage}: {type(exc).__name__}: {first_line}"[:500]
    result["traceback"] = traceback.format_exc()[-4000:]


def _is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure of Python or a backend."""
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__.lower()
    if "outofmemory" in name or "resourceexhausted" in name:
        return True
    text = str(exc).lower()
    return any(pattern in text for pattern in _OOM_PATTERNS)


# ---------------------------------------------------------------------------
# Backend-specific steps. Each returns (step, device_memory) where ``step()``
# runs one synchronised call and drops its outputs, and ``device_memory`` is
# None on CPU or an object with start/after_warmup/increase/method.
# ---------------------------------------------------------------------------


class _DeviceMemory:
    """Peak accelerator memory over a baseline, through backend callbacks."""

    method = "device"

    def __init__(self, in_use: Callable[[], int], peak: Callable[[], int],
                 reset: Callable[[], None] | None) -> None:
        self._in_use = in_use
        self._peak = peak
        self._reset = reset
        self.baseline = 0

    def start(self) -> None:
        self.baseline = self._in_use()

    def after_warmup(self) -> None:
        if self._reset is not None:
            self._reset()

    def peak(self) -> int:
        return self._peak()

    def increase(self) -> int:
        return max(0, self._peak() - self.baseline)


def _jax_step(layer, x_np, config):
    import jax
    import jax.numpy as jnp

    causal = bool(config["causal"])
    x = jnp.asarray(x_np)
    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    if config["mode"] == "fwd":

        def forward(trainable, non_trainable, x):
            out, _ = layer.stateless_call(
                trainable, non_trainable, x, x, use_causal_mask=causal, training=False
            )
            return out

        compiled = jax.jit(forward)

        def step():
            jax.block_until_ready(compiled(trainable, non_trainable, x))

    else:

        def loss(trainable, non_trainable, x):
            out, _ = layer.stateless_call(
                trainable, non_trainable, x, x, use_causal_mask=causal, training=True
            )
            return jnp.mean(out.astype("float32"))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 2)))

        def step():
            jax.block_until_ready(compiled(trainable, non_trainable, x))

    device = x.devices().pop() if hasattr(x, "devices") else jax.devices()[0]
    device_memory = None
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            device_memory = _DeviceMemory(
                in_use=lambda: device.memory_stats().get("bytes_in_use", 0),
                peak=lambda: device.memory_stats().get("peak_bytes_in_use", 0),
                reset=None,
            )
    info = {
        "device": "cpu" if device.platform == "cpu"
        else f"{device.platform}:{getattr(device, 'device_kind', '')}",
        "backend_version": f"jax {jax.__version__}",
    }
    return step, device_memory, info


def _tensorflow_step(layer, x_np, config):
    import tensorflow as tf

    causal = bool(config["causal"])
    x = tf.constant(x_np)
    variables = list(layer.trainable_variables)

    if config["mode"] == "fwd":

        @tf.function(jit_compile=bool(config["tf_jit"]))
        def compiled(x):
            return layer(x, x, use_causal_mask=causal, training=False)

    else:

        @tf.function(jit_compile=bool(config["tf_jit"]))
        def compiled(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x, x, use_causal_mask=causal, training=True)
                loss = tf.reduce_mean(tf.cast(out, tf.float32))
            grads = tape.gradient(loss, [x] + variables)
            # A weight outside the graph (LSHAttention's key projection)
            # has no gradient: None, which a tf.function cannot return.
            return [g for g in grads if g is not None]

    sync_devices = getattr(getattr(tf, "experimental", None), "sync_devices", None)

    def sync(outputs):
        if sync_devices is not None:
            sync_devices()
        else:
            for tensor in tf.nest.flatten(outputs):
                tf.reshape(tensor, [-1])[:1].numpy()

    def step():
        sync(compiled(x))

    gpus = tf.config.list_logical_devices("GPU")
    device_memory = None
    if gpus:
        name = gpus[0].name.split("device:")[-1]
        device_memory = _DeviceMemory(
            in_use=lambda: tf.config.experimental.get_memory_info(name)["current"],
            peak=lambda: tf.config.experimental.get_memory_info(name)["peak"],
            reset=lambda: tf.config.experimental.reset_memory_stats(name),
        )
    info = {
        "device": f"gpu:{gpus[0].name}" if gpus else "cpu",
        "backend_version": f"tensorflow {tf.__version__}",
        "tf_jit": bool(config["tf_jit"]),
    }
    return step, device_memory, info


def _torch_step(layer, x_np, config):
    import keras
    import torch

    causal = bool(config["causal"])
    x = keras.ops.convert_to_tensor(x_np)
    cuda = x.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    if config["mode"] == "fwd":

        def step():
            with torch.no_grad():
                layer(x, x, use_causal_mask=causal, training=False)
            sync()

    else:
        xg = x.detach().clone().requires_grad_(True)
        params = [v.value for v in layer.trainable_variables]

        def step():
            out = layer(xg, xg, use_causal_mask=causal, training=True)
            loss = out.float().mean()
            # allow_unused: a layer may leave a weight out of its graph
            # (LSHAttention's keys are its normalised queries: no key
            # projection), as jax.grad and tf.GradientTape allow.
            torch.autograd.grad(loss, [xg] + params, allow_unused=True)
            sync()

    device_memory = None
    if cuda:
        device_memory = _DeviceMemory(
            in_use=torch.cuda.memory_allocated,
            peak=torch.cuda.max_memory_allocated,
            reset=torch.cuda.reset_peak_memory_stats,
        )
    info = {
        "device": f"cuda:{torch.cuda.get_device_name(x.device)}" if cuda else "cpu",
        "backend_version": f"torch {torch.__version__}",
        "torch_threads": torch.get_num_threads(),
    }
    return step, device_memory, info


def accelerator_memory(backend: str):
    """A peak-memory tracker of the first accelerator of ``backend``, or
    ``None`` on CPU (where :class:`HostMemory` applies).

    The tracker has ``start()`` (baseline: bytes in use now),
    ``after_warmup()`` (reset the peak where the backend can), ``peak()``,
    ``increase()`` (peak minus baseline) and ``method`` (``"device"``).
    Imports the backend; used by the LRA suite's worker.
    """
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform == "cpu" or "peak_bytes_in_use" not in (device.memory_stats() or {}):
            return None
        return _DeviceMemory(
            in_use=lambda: device.memory_stats().get("bytes_in_use", 0),
            peak=lambda: device.memory_stats().get("peak_bytes_in_use", 0),
            reset=None,
        )
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_logical_devices("GPU")
        if not gpus:
            return None
        name = gpus[0].name.split("device:")[-1]
        return _DeviceMemory(
            in_use=lambda: tf.config.experimental.get_memory_info(name)["current"],
            peak=lambda: tf.config.experimental.get_memory_info(name)["peak"],
            reset=lambda: tf.config.experimental.reset_memory_stats(name),
        )
    if backend == "torch":
        import torch

        if not torch.cuda.is_available():
            return None
        return _DeviceMemory(
            in_use=torch.cuda.memory_allocated,
            peak=torch.cuda.max_memory_allocated,
            reset=torch.cuda.reset_peak_memory_stats,
        )
    return None


_STEPS = {"jax": _jax_step, "tensorflow": _tensorflow_step, "torch": _torch_step}


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def _attention_only(layer, num_heads: int, head_dim: int):
    """A layer timing only ``layer.attend`` (``scope="attention"``)."""
    import keras

    if not hasattr(layer, "attend"):
        raise TypeError(
            f"scope 'attention' needs a keras_longattn attention layer with an "
            f"`attend` method; {type(layer).__name__} has none"
        )

    class AttentionOnly(keras.layers.Layer):
        def __init__(self, inner):
            super().__init__(name=f"{inner.name}_attention_only")
            self.inner = inner

        def build(self, query_shape, value_shape=None, key_shape=None):
            self.inner.build(query_shape, value_shape or query_shape)
            self.inner.trainable = False
            self.built = True

        def call(self, query, value=None, key=None, use_causal_mask=False, training=None):
            n = query.shape[1]
            heads = keras.ops.reshape(query, (-1, n, num_heads, head_dim))
            out = self.inner.attend(
                heads, heads, heads, use_causal_mask=use_causal_mask, training=training
            )
            return keras.ops.reshape(out, (-1, n, num_heads * out.shape[-1]))

        def get_config(self):
            return {"scope": "attention", "layer": self.inner.get_config()}

    return AttentionOnly(layer)


def _json_safe(value: Any) -> Any:
    """``value`` made JSON-serialisable (unknown objects become their repr)."""
    return json.loads(json.dumps(value, default=repr))


def _build(layer, x, seq_len: int, backend: str) -> None:
    """Create the layer's weights without a full-size call.

    Uses ``layer.build(query_shape, value_shape)`` (the MultiHeadAttention
    signature); if that is not supported, calls the layer eagerly on a short
    prefix of the input, and as a last resort on the whole input.
    """
    shape = tuple(x.shape)
    try:
        layer.build(shape, shape)
    except (TypeError, NotImplementedError, ValueError):
        pass
    if layer.built:
        return

    def call(inputs):
        if backend == "torch":
            import torch

            with torch.no_grad():
                layer(inputs, inputs)
        else:
            layer(inputs, inputs)

    short = min(seq_len, 16)
    try:
        call(x[:, :short])
    except Exception:  # noqa: BLE001 - the layer may need the real length
        call(x)


def run_config(config: dict[str, Any]) -> dict[str, Any]:
    """Measure one configuration; never raises (failures become a status).

    Returns:
        A dict with ``status`` (``"ok"``, ``"oom"`` or ``"error"``), timings
        in milliseconds (``times_ms``, ``median_ms``, ``first_call_ms``...),
        memory in bytes (``peak_memory_bytes``, ``baseline_rss_bytes``...),
        and what ran (``layer_spec``: the layer config it was built from,
        ``layer_class``, ``layer_config``: the layer's ``get_config()``,
        versions, device).
    """
    config = {**DEFAULT_CONFIG, **config}
    backend = config["backend"] or os.environ.get("KERAS_BACKEND") or "jax"
    result: dict[str, Any] = {"status": "error", "message": "", "worker_pid": os.getpid()}
    stage = "setup"
    try:
        if "keras" not in sys.modules:
            os.environ["KERAS_BACKEND"] = backend
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import keras
        import numpy as np

        if keras.backend.backend() != backend:
            raise RuntimeError(
                f"Keras runs the {keras.backend.backend()!r} backend but the "
                f"configuration asks for {backend!r}: set KERAS_BACKEND={backend}"
            )
        if config["mode"] not in ("fwd", "fwdbwd"):
            raise ValueError(f"unknown mode {config['mode']!r}")
        result["keras_version"] = keras.__version__

        from keras_longattn.specs import registry
        from keras_longattn.specs.layer_spec import resolve_spec
        from keras_longattn.specs.resolver import build_layer

        stage = "build"
        keras.utils.set_random_seed(int(config["seed"]))
        batch, seq_len = int(config["batch"]), int(config["seq_len"])
        heads, head_dim = int(config["num_heads"]), int(config["head_dim"])
        spec = config["layer_spec"]
        if spec is None:
            spec = registry.get_entry(config["layer"]).config
        spec = resolve_spec(spec, seq_len=seq_len, num_heads=heads, key_dim=head_dim,
                            batch=batch, window=int(config["window"]),
                            options=config["options"], label=config["layer"])
        result["layer_spec"] = spec
        rng = np.random.default_rng(int(config["seed"]))
        x_np = rng.standard_normal((batch, seq_len, heads * head_dim), dtype=np.float32)
        layer = build_layer(spec, label=config["layer"])
        result["layer_class"] = f"{type(layer).__module__}.{type(layer).__qualname__}"
        if config["scope"] == "attention":
            layer = _attention_only(layer, heads, head_dim)
        elif config["scope"] != "layer":
            raise ValueError(f"unknown scope {config['scope']!r}")
        x_built = keras.ops.convert_to_tensor(x_np)
        _build(layer, x_built, seq_len, backend)
        del x_built
        result["num_params"] = int(sum(int(np.prod(v.shape)) for v in layer.trainable_variables))
        try:
            result["layer_config"] = _json_safe(layer.get_config())
        except Exception as exc:  # noqa: BLE001 - informative only
            result["layer_config"] = {"error": repr(exc)}

        stage = "prepare"
        step, device_memory, info = _STEPS[backend](layer, x_np, config)
        result.update(info)
        result["allocator_settled"] = bool(config["settle_allocator"]) and settle_allocator()

        host = HostMemory()
        host.start()
        if device_memory is not None:
            device_memory.start()
        result["baseline_rss_bytes"] = host.baseline

        stage = "warm-up"
        warmup = int(config["warmup"])
        if warmup > 0:
            start = time.perf_counter()
            step()
            result["first_call_ms"] = (time.perf_counter() - start) * 1e3
            for _ in range(warmup - 1):
                step()
        host.after_warmup()
        if device_memory is not None:
            device_memory.after_warmup()

        stage = "timed calls"
        times, faults = [], []
        gc.collect()
        gc.disable()
        try:
            for _ in range(int(config["repeats"])):
                before = _minor_faults()
                start = time.perf_counter()
                step()
                times.append((time.perf_counter() - start) * 1e3)
                faults.append(_minor_faults() - before)
        finally:
            gc.enable()
        result["page_faults"] = faults

        result["host_peak_rss_bytes"] = host.peak()
        result["host_peak_increase_bytes"] = host.increase()
        if device_memory is not None:
            result["memory_method"] = device_memory.method
            result["peak_memory_bytes"] = device_memory.increase()
            result["device_peak_bytes"] = device_memory.peak()
        else:
            result["memory_method"] = host.method
            result["peak_memory_bytes"] = host.increase()
        if config["efficiency"]:
            stage = "matmul peak"
            from .efficiency import measure_matmul_peak

            result["matmul_peak_gflops"] = measure_matmul_peak(backend)
        result.update(
            status="ok",
            times_ms=times,
            median_ms=statistics.median(times),
            mean_ms=statistics.fmean(times),
            min_ms=min(times),
            max_ms=max(times),
        )
    except BaseException as exc:  # noqa: BLE001 - everything becomes a status
        record_failure(result, stage, exc)
    result["python"] = platform.python_version()
    allocator = allocator_settings()
    if allocator:
        result["allocator"] = allocator
    return result


#: Bytes of the block :func:`settle_allocator` allocates and frees: just
#: under glibc's cap on its dynamic mmap threshold (32 MiB on 64-bit).
SETTLE_BYTES = 31 << 20


def settle_allocator() -> bool:
    """Puts glibc's ``malloc`` in the state of a process that has freed a
    large block: one ``malloc`` / ``free`` of :data:`SETTLE_BYTES` raises
    its dynamic mmap threshold to that size and its trim threshold to twice
    it. A small, fresh process is not in that state: there every freed
    block above a few MiB at the top of the heap is given back to the
    system and faulted in again (zeroed page by page) by the next call,
    several milliseconds per call, more than the whole call for a fast
    layer, and irregularly (see ``page_faults``). A training process, whose
    activations and optimizer states are larger, is in the settled state.
    Returns False (and does nothing) where the C library is not glibc or
    its tunables are set in the environment (:func:`allocator_settings`).
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    if allocator_settings():
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(SETTLE_BYTES)
    if not block:
        return False
    libc.free(block)
    return True


def allocator_settings() -> dict[str, str]:
    """The environment that changes how this process's ``malloc`` returns
    memory to the system (glibc's ``MALLOC_*`` tunables, a preloaded
    jemalloc or tcmalloc): recorded with each row, since it decides how
    many page faults a fast CPU call pays for."""
    names = [k for k in os.environ if k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES",)]
    settings = {k: os.environ[k] for k in sorted(names)}
    if os.environ.get("LD_PRELOAD"):
        settings["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    return settings


def _load_config(argument: str) -> dict[str, Any]:
    if argument.startswith("@"):
        with open(argument[1:], encoding="utf-8") as handle:
            return json.load(handle)
    return json.loads(argument)


def _check(argument: str) -> int:
    """``--check``: resolve and check layer configs, print the findings."""
    try:
        items = _load_config(argument)
    except (OSError, ValueError) as exc:
        print(f"worker: cannot read the layer configs: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from keras_longattn.specs.resolver import check_specs

    checks = check_specs(items)
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps({"checks": checks}, default=repr), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m keras_longattn.benchmarks.worker CONFIG``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--check":
        return _check(argv[1])
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        print("usage: python -m keras_longattn.benchmarks.worker '<json>' | @file.json\n"
              "       python -m keras_longattn.benchmarks.worker --check '<json list>'",
              file=sys.stderr)
        return 2
    try:
        config = _load_config(argv[0])
    except (OSError, ValueError) as exc:
        print(f"worker: cannot read the configuration: {exc}", file=sys.stderr)
        return 2
    result = run_config(config)
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(result, default=repr), flush=True)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
