"""The accelerator check of issue #30, one stage per process.

Stages (``python scripts/device_check.py STAGE``; ``scripts/device_check.sh``
runs them all under time limits):

* ``correct``: every ``"pallas"`` path (KERAS_BACKEND=jax) or ``"flex"``
  path (KERAS_BACKEND=torch) of the block-sparse layers against the
  ``"reference"`` path on the same weights, float32 and bfloat16, outputs
  and input gradients; on JAX also the ``"cudnn"`` paths (plain windows of
  Local and Longformer, no padding, float16 and bfloat16). The truth is
  the reference path in float32 at full matmul precision; a path passes
  when its error is at most twice the error of the reference path itself
  in the same dtype at the backend's default precision (the rounding floor
  of that dtype on that device), or below an absolute floor. The stage
  records its plan (every case of every path, whatever shard or filter
  runs) and the hashes of each path's own sources
  (:data:`keras_longattn.kernels.proven.PATH_SOURCES`), from which
  ``device_report --prove`` writes the proofs of a complete run.
* ``bench``: B=1, H=16, d=128, bfloat16, forward+backward of the attention
  core (no projections) at n = 16K, 64K, 128K: full attention (cuDNN on
  JAX, SDPA flash on torch), our Local (causal window 512), Sparse
  strided, Longformer and BigBird paths, and as peers cuDNN's sliding
  window (``jax.nn.dot_product_attention(local_window_size=)``),
  FlexAttention used directly with a sliding-window ``BlockMask`` and
  Keras ``MultiHeadAttention(sliding_window=)``; a bf16 matrix product of
  8192^3 timed in the same process gives the peak; Local at 1,048,576
  tokens last.

Every measurement is appended at once as one JSON line to
``$DEVICE_CHECK_OUT/results.jsonl`` (a stage cut off by its time limit
keeps what it measured). ``DEVICE_CHECK_DRY=1`` runs every stage at toy
sizes on the CPU (Pallas interpreted), which is how the tests check this
script without a GPU.
"""

import json
import math
import os
import platform
import sys
import time
import traceback

DRY = os.environ.get("DEVICE_CHECK_DRY") == "1"
OUT = os.environ.get("DEVICE_CHECK_OUT") or os.environ.get("OUT") or "."
DEADLINE = time.monotonic() + float(os.environ.get("DEVICE_CHECK_STAGE_SECONDS", "1e9"))
#: Stop starting new measurements this many seconds before the deadline.
MARGIN = 20.0

BACKEND = os.environ.get("KERAS_BACKEND", "jax")


def record(kind, **fields):
    """Appends one result line (and echoes it)."""
    row = {"kind": kind, "backend": BACKEND, "dry": DRY, **fields}
    line = json.dumps(row, default=str)
    print(line, flush=True)
    with open(os.path.join(OUT, "results.jsonl"), "a") as f:
        f.write(line + "\n")


def time_left():
    return DEADLINE - time.monotonic()


def guarded(kind, fn, **fields):
    """Runs ``fn`` (returning a dict of results) unless the stage is out of
    time; records its results, or the error it raised."""
    if time_left() < MARGIN:
        record(kind, status="skipped", reason="stage time limit", **fields)
        return None
    start = time.monotonic()
    try:
        result = fn()
    except Exception as e:  # every failure is a result of the check
        record(kind, status="error", error=f"{type(e).__name__}: {e}"[:2000],
               trace=traceback.format_exc()[-3000:], seconds=time.monotonic() - start,
               **fields)
        return None
    record(kind, status=result.pop("status", "ok"), seconds=round(time.monotonic() - start, 2),
           **fields, **result)
    return result


# ------------------------------------------------------------------ device
def device_name():
    if BACKEND == "torch":
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
        return "cpu"
    import jax

    dev = jax.devices()[0]
    return getattr(dev, "device_kind", str(dev))


def on_accelerator():
    if BACKEND == "torch":
        import torch

        return torch.cuda.is_available()
    import jax

    return jax.default_backend() != "cpu"


# ---------------------------------------------------------- correctness
def layer_cases():
    from keras_longattn import layers as L

    return [
        ("local-causal", L.LocalAttention, {"window": 96}, True),
        ("local-bidirectional", L.LocalAttention, {"window": 96}, False),
        ("sparse-strided-multihead", L.SparseAttention,
         {"pattern": "strided", "block_length": 32}, True),
        ("sparse-strided-merged", L.SparseAttention,
         {"pattern": "strided", "block_length": 32, "combination": "merged"}, False),
        ("sparse-fixed-merged", L.SparseAttention,
         {"pattern": "fixed", "block_length": 32, "summary_width": 4,
          "combination": "merged"}, True),
        ("sparse-fixed-second", L.SparseAttention,
         {"pattern": "fixed", "block_length": 32, "summary_width": 4,
          "combination": "second"}, False),
        ("bigbird", L.BigBirdAttention,
         {"block_size": 64, "window_blocks": 3, "global_blocks": 1, "random_blocks": 2,
          "seed": 3}, False),
        ("bigbird-causal", L.BigBirdAttention,
         {"block_size": 64, "window_blocks": 3, "global_blocks": 1, "random_blocks": 2,
          "seed": 3}, True),
        ("longformer-dilated-global", L.LongformerAttention,
         {"window": 64, "dilation": (1, 2), "max_global": 3}, False),
        ("routing-balanced", L.RoutingAttention,
         {"num_clusters": 4, "local_heads": 1, "causal_routing": "balanced"}, True),
        ("routing-bidirectional", L.RoutingAttention, {"num_clusters": 4}, False),
    ]


def cudnn_cases():
    """The ``"cudnn"`` cases (JAX): plain windows, no padding. A window with
    keys ahead only where this JAX gives cuDNN a right window."""
    from keras_longattn import layers as L

    cases = [
        ("local-causal-cudnn", L.LocalAttention, {"window": 96}, True),
        ("local-look-back-cudnn", L.LocalAttention,
         {"window": 96, "look_back": 40, "look_ahead": 0}, False),
        ("longformer-causal-cudnn", L.LongformerAttention, {"window": 64}, True),
    ]
    try:
        from keras_longattn.kernels.jax import cudnn_window

        if cudnn_window.right_window_supported():
            cases.append(("local-bidirectional-cudnn", L.LocalAttention, {"window": 96}, False))
    except Exception:
        pass
    return cases


#: The dtypes each path is checked in (cuDNN's flash attention takes no
#: float32).
PATH_DTYPES = {"pallas": ("float32", "bfloat16"), "flex": ("float32", "bfloat16"),
               "cudnn": ("bfloat16", "float16")}


def planned_cases():
    """``[(name, cls, kwargs, causal, path, padded)]``: every case of the
    active backend's paths (``padded``: the calls carry padding masks)."""
    if BACKEND == "jax":
        return ([c + ("pallas", True) for c in layer_cases()]
                + [c + ("cudnn", False) for c in cudnn_cases()])
    return [c + ("flex", True) for c in layer_cases()]


def _inputs(n, F, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, n, F)).astype("float32")
    w = rng.standard_normal((2, n, F)).astype("float32")
    mask = np.ones((2, n), bool)
    mask[1, n - n // 4:] = False  # example 1: its last quarter is padding
    global_mask = np.zeros((2, n), bool)
    global_mask[0, [5, n // 2]] = True
    global_mask[1, [1, n - 3]] = True  # n - 3 is padding
    return x, w, mask, global_mask


def _run_layer(layer, x, w, mask, causal, extra, padded=True):
    """Output (real queries) and the input gradient of sum(out * w); the
    padding masks reach the layer only when ``padded`` (else ``mask`` is
    all True)."""
    import numpy as np

    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        masks = {"query_mask": mask, "value_mask": mask} if padded else {}

        def loss(x):
            out = layer(x, x, use_causal_mask=causal, **masks, **extra)
            out = out.astype("float32")
            return jnp.sum(jnp.where(mask[..., None], out * w, 0.0)), out

        (_, out), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            jnp.asarray(x, layer.compute_dtype))
        return np.asarray(out, "float32")[mask], np.asarray(grad, "float32")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    xt = torch.tensor(x, device=device).to(getattr(torch, layer.compute_dtype))
    xt.requires_grad_(True)
    mt = torch.tensor(mask, device=device)
    extra = {k: torch.tensor(v, device=device) for k, v in extra.items()}
    masks = {"query_mask": mt, "value_mask": mt} if padded else {}
    out = layer(xt, xt, use_causal_mask=causal, **masks, **extra)
    out = out.float()
    wt = torch.tensor(w, device=device)
    (out * wt * mt[..., None]).sum().backward()
    return (out.detach().cpu().numpy()[mask], xt.grad.float().cpu().numpy())


def _matmul_precision(highest):
    """The backend's float32 matmul precision: full (``highest``) or its
    default (TF32 allowed on JAX's GPUs; torch's matmul default is full)."""
    if BACKEND == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", "highest" if highest else None)
    else:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False


def check_case(name, cls, kwargs, causal, path, n, heads, key_dim, padded=True):
    import numpy as np

    from keras_longattn.testing import rel_error

    F = heads * key_dim
    x, w, mask, global_mask = _inputs(n, F)
    if not padded:
        mask = np.ones_like(mask)
    extra = {"global_mask": global_mask} if "global" in name else {}
    heads = heads + 1 if "routing" in name else heads
    truth_layer = cls(num_heads=heads, key_dim=key_dim, implementation="reference", **kwargs)
    truth_layer(x[:, :64], x[:, :64])
    weights = truth_layer.get_weights()
    _matmul_precision(highest=True)
    truth = _run_layer(truth_layer, x, w, mask, causal, extra, padded)
    _matmul_precision(highest=False)
    result = {}
    ok = True
    for dtype in PATH_DTYPES[path]:
        errors, outputs = {}, {}
        for impl in ("reference", path):
            layer = cls(num_heads=heads, key_dim=key_dim, implementation=impl, dtype=dtype,
                        **kwargs)
            layer(x[:, :64], x[:, :64])
            layer.set_weights(weights)
            got = outputs[impl] = _run_layer(layer, x, w, mask, causal, extra, padded)
            errors[impl] = [rel_error(a, b) for a, b in zip(got, truth)]
            if impl == path:
                ran = layer.last_implementation
        floor = 1e-4 if dtype == "float32" else 1e-2  # bfloat16, float16
        limits = [max(2.0 * e, floor) for e in errors["reference"]]
        # Against the reference in the same dtype too: layers whose choices
        # are discrete (routing clusters) make the same choices there.
        same = [rel_error(a, b) for a, b in zip(outputs[path], outputs["reference"])]
        passed = (all(e <= lim for e, lim in zip(errors[path], limits))
                  and all(e <= lim for e, lim in zip(same, limits)) and ran == path)
        ok = ok and passed
        result[dtype] = {"error_out": errors[path][0], "error_grad": errors[path][1],
                         "reference_error_out": errors["reference"][0],
                         "reference_error_grad": errors["reference"][1],
                         "same_dtype_error_out": same[0], "same_dtype_error_grad": same[1],
                         "ran": ran, "passed": bool(passed)}
    result["status"] = "pass" if ok else "fail"
    return result


def _path_refusal(path, cls, kwargs, causal, n, heads, key_dim):
    """Why ``path`` cannot run on this machine at all (None: it can, or
    only the case's own properties stop it, which the case then reports
    as an error): a ``"cudnn"`` case on a device without cuDNN."""
    if path != "cudnn":
        return None
    from keras_longattn.kernels.jax import cudnn_window

    return cudnn_window.device_refusal()


def stage_correct(shard=0, shards=1):
    """The cases ``shard, shard + shards, ...`` of :func:`planned_cases`
    (the shell script runs the shards side by side: compiling dominates).
    Every shard records the hashes of the paths' own sources; shard 0 the
    device and the plan (every case, whatever filter applies)."""
    from keras_longattn.kernels import proven

    n, heads, key_dim = (128, 2, 16) if DRY else (1024, 2, 64)
    cases = planned_cases()
    if shard == 0:
        record("device", name=device_name(), accelerator=on_accelerator(),
               vendor=proven.active_vendor(BACKEND),
               python=platform.python_version(), versions=_versions())
        record("plan", cases=[{"case": c[0], "path": c[4]} for c in cases])
    for path in sorted({c[4] for c in cases}):
        record("path_sources", path=path, files=proven.source_hashes(path))
    wanted = (os.environ.get(f"DEVICE_CHECK_CASES_{BACKEND.upper()}")
              or os.environ.get("DEVICE_CHECK_CASES"))
    if wanted:
        cases = [c for c in cases if c[0] in wanted.split(",")]
    for name, cls, kwargs, causal, path, padded in cases[shard::shards]:
        reason = _path_refusal(path, cls, kwargs, causal, n, heads, key_dim)
        if reason is not None:
            record("correct", status="unavailable", reason=reason, case=name, path=path, n=n)
            continue
        guarded("correct", lambda: check_case(name, cls, kwargs, causal, path, n, heads,
                                              key_dim, padded),
                case=name, path=path, n=n)


def _versions():
    import keras

    out = {"keras": keras.__version__}
    for mod in ("jax", "jaxlib", "torch", "triton"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            pass
    return out


# ---------------------------------------------------------------- timing
def _timer():
    """``time(fn, reps)``: median seconds of ``fn()`` after warm-up, the
    device synchronised around each call."""
    if BACKEND == "torch":
        import torch

        def sync():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    else:
        def sync():
            pass

    def measure(fn, reps):
        import numpy as np

        out = fn()
        _block(out)
        sync()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            out = fn()
            _block(out)
            sync()
            times.append(time.perf_counter() - start)
        return float(np.median(times)), float(np.min(times))

    return measure


def _block(out):
    if BACKEND == "jax":
        import jax

        jax.block_until_ready(out)


def bench_shape():
    """``(B, H, d, lengths)``; ``DEVICE_CHECK_SIZES`` (comma-separated)
    replaces the lengths."""
    sizes = os.environ.get("DEVICE_CHECK_SIZES")
    B, H, d, default = (1, 2, 32, [256, 512]) if DRY else (1, 16, 128, [16384, 65536, 131072])
    return B, H, d, [int(x) for x in sizes.split(",")] if sizes else default


WINDOW = 512


def local_pairs(n, w):
    """Allowed (query, key) pairs of a causal window of ``w`` keys."""
    w = min(w, n)
    return n * w - w * (w - 1) // 2


def matmul_peak():
    """bf16 TFLOP/s of a square matrix product (8192^3, 256^3 when dry)."""
    m = 256 if DRY else 8192
    measure = _timer()
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        a = jax.random.normal(jax.random.PRNGKey(0), (m, m), jnp.bfloat16)
        b = jax.random.normal(jax.random.PRNGKey(1), (m, m), jnp.bfloat16)
        f = jax.jit(lambda a, b: a @ b)
        t, _ = measure(lambda: f(a, b), 10)
    else:
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
        t, _ = measure(lambda: a @ b, 10)
    return {"tflops": 2 * m ** 3 / t / 1e12, "size": m}


def _jax_fwd_bwd(attend, B, T, H, d, seed=0):
    """A timed ``fn()`` running forward+backward of ``attend(q, k, v)``."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v, do = (jax.random.normal(kk, (B, T, H, d), jnp.bfloat16) for kk in keys)

    def loss(q, k, v, do):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    # Every array an argument: a constant captured by the compiled program
    # would be folded by XLA at compile time (slowly, at these sizes).
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return lambda: step(q, k, v, do)


def bench_jax_methods(n, B, H, d, only_local=False):
    """name -> (attend(q, k, v), useful pairs per head or None)."""
    import jax

    from keras_longattn import layers as L

    causal_pairs = n * (n + 1) // 2
    methods = {}
    if jax.default_backend() == "gpu" and not only_local:
        methods["full_cudnn"] = (lambda: lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"), causal_pairs)
        methods["local_cudnn_window"] = (lambda: lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(WINDOW - 1, 0),
            implementation="cudnn"), local_pairs(n, WINDOW))
        # Our layer's "cudnn" path (the same kernel, through the layer).
        methods["local_cudnn"] = (lambda: _ours(L.LocalAttention, "cudnn", H, d, True,
                                                window=WINDOW), local_pairs(n, WINDOW))
    methods["local_pallas"] = (lambda: _ours(L.LocalAttention, "pallas", H, d, True,
                                             window=WINDOW), local_pairs(n, WINDOW))
    if only_local:
        return methods
    methods.update(_pattern_methods("pallas", H, d))
    return methods


def _pattern_methods(path, H, d):
    from keras_longattn import layers as L

    return {
        f"sparse_strided_{path}": (lambda: _ours(
            L.SparseAttention, path, H, d, True, pattern="strided", block_length=256), None),
        f"longformer_{path}": (lambda: _ours(
            L.LongformerAttention, path, H, d, False, window=WINDOW,
            dilation=(1,) * (H - H // 4) + (2,) * (H // 4)), None),
        f"bigbird_{path}": (lambda: _ours(
            L.BigBirdAttention, path, H, d, False, block_size=64, window_blocks=3,
            global_blocks=2, random_blocks=3, seed=0), None),
    }


#: Tilings tried for the Local Pallas path (changes to the GPU default;
#: forward and backward choices are read off separately).
SWEEP = {
    "default": {},
    "mask_every_tile": {"skip_full_tiles": False},
    "bwd_whole": {"bwd_q_split": 1, "bwd_k_split": 1},
    "bwd_stages3": {"bwd_num_stages": 3},
    "fwd_stages3_bwd_whole": {"num_stages": 3, "bwd_q_split": 1, "bwd_k_split": 1},
    "fwd_warps4_bwd_warps4": {"num_warps": 4, "bwd_num_warps": 4},
    "fwd_q64_bwd_stages3": {"q_split": 2, "bwd_num_stages": 3},
    "fwd_k64_bwd_q32": {"k_split": 2, "bwd_q_split": 4},
}


def sweep_tilings(n, B, H, d, measure):
    """Forward and forward+backward times of the Local Pallas path under
    each tiling of :data:`SWEEP` (one line each)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from keras_longattn.kernels.jax import pallas_attention as pa
    from keras_longattn.layers import LocalAttention

    key = ("gpu" if jax.default_backend() == "gpu" else jax.default_backend(),
           "small" if d <= 64 else "large")
    base = pa.default_tiling(d)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (B, n, H, d), jnp.bfloat16) for kk in keys)
    chosen = os.environ.get("DEVICE_CHECK_SWEEP")
    sweep = SWEEP if not chosen else {k: v for k, v in SWEEP.items() if k in chosen.split(",")}
    try:
        for name, change in sweep.items():
            def run(change=change):
                pa.TILINGS[key] = dataclasses.replace(base, **change)
                attend = _ours(LocalAttention, "pallas", H, d, True, window=WINDOW)
                fwd = jax.jit(attend)
                t_fwd, _ = measure(lambda: fwd(q, k, v), 5)
                t_all, _ = measure(_jax_fwd_bwd(attend, B, n, H, d), 5)
                flops = 4 * local_pairs(n, WINDOW) * d * H * B
                return {"fwd_ms": t_fwd * 1e3, "fwd_bwd_ms": t_all * 1e3,
                        "bwd_ms": (t_all - t_fwd) * 1e3,
                        "fwd_tflops": flops / t_fwd / 1e12,
                        "tiling": dataclasses.asdict(pa.TILINGS[key])}

            guarded("sweep", run, variant=name, n=n, B=B, H=H, d=d)
    finally:
        pa.TILINGS[key] = base


def stage_bench():
    B, H, d, sizes = bench_shape()
    record("device", name=device_name(), accelerator=on_accelerator(), versions=_versions())
    peak = guarded("peak", matmul_peak)
    peak = peak and peak.get("tflops")
    measure = _timer()
    reps = 3 if DRY else 5
    if BACKEND == "jax":
        sweep_tilings(sizes[len(sizes) // 2], B, H, d, measure)
    million = int(os.environ.get("DEVICE_CHECK_MILLION", 4096 if DRY else 1 << 20))
    middle = sizes[len(sizes) // 2]
    # The size the criteria are judged at first, then the million tokens,
    # then the other sizes (a stage cut off by its limit keeps the first).
    order = [middle, million] + [n for n in sizes if n != middle]
    for n in order:
        only_local = n == million
        methods = (bench_jax_methods if BACKEND == "jax" else bench_torch_methods)(
            n, B, H, d, only_local=only_local)
        if only_local:
            methods = {k: v for k, v in methods.items() if k in ("local_pallas", "local_flex")}
        for name, (factory, pairs) in methods.items():
            def run(factory=factory, pairs=pairs, n=n):
                fn = (_jax_fwd_bwd if BACKEND == "jax" else _torch_fwd_bwd)(factory(), B, n, H, d)
                t, t_min = measure(fn, 2 if n == million else reps)
                out = {"ms": t * 1e3, "ms_min": t_min * 1e3}
                if pairs is not None:
                    flops = 3.5 * 4 * pairs * d * H * B
                    out["useful_tflops"] = flops / t / 1e12
                    if peak:
                        out["fraction_of_peak"] = flops / t / 1e12 / peak
                return out

            guarded("bench", run, method=name, n=n, B=B, H=H, d=d)
        if BACKEND == "jax" and n == sizes[0]:
            guarded("bench", lambda: keras_layers_pair(n, H, d, measure), method="keras_layers",
                    n=n, B=B, H=H, d=d)


def keras_layers_pair(n, H, d, measure):
    """Keras ``MultiHeadAttention(sliding_window=)`` (a dense band) against
    our ``LocalAttention`` layer (auto path), same sizes, whole layers
    with projections, forward+backward, bf16."""
    import jax
    import jax.numpy as jnp
    import keras

    from keras_longattn.layers import LocalAttention

    F = H * d
    x = jax.random.normal(jax.random.PRNGKey(0), (1, n, F), jnp.bfloat16)
    out = {}
    layers = {
        "keras_mha_sliding_window": keras.layers.MultiHeadAttention(
            num_heads=H, key_dim=d, sliding_window=WINDOW, dtype="bfloat16"),
        "longattn_local_layer": LocalAttention(num_heads=H, key_dim=d, window=WINDOW,
                                               implementation="pallas", dtype="bfloat16"),
        # What a user gets: the path "auto" picks on this device.
        "longattn_local_layer_auto": LocalAttention(num_heads=H, key_dim=d, window=WINDOW,
                                                    dtype="bfloat16"),
    }
    for name, layer in layers.items():
        layer(x[:, :128], x[:, :128], use_causal_mask=True)

        def loss(x, layer=layer):
            return jnp.sum(layer(x, x, use_causal_mask=True).astype(jnp.float32))

        step = jax.jit(jax.grad(loss))
        try:
            t, _ = measure(lambda: step(x), 3)
            out[name + "_ms"] = t * 1e3
        except Exception as e:
            out[name + "_error"] = f"{type(e).__name__}: {e}"[:500]
        if name.startswith("longattn_local_layer"):
            out[name + "_path"] = layer.last_implementation
    return out


# ---------------------------------------------------------------- torch
def _torch_fwd_bwd(attend, B, T, H, d, seed=0):
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, do = (torch.randn(B, T, H, d, device=dev, dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def fn():
        for t in (q, k, v):
            t.grad = None
        out = attend(q, k, v)
        out.backward(do)
        return q.grad

    return fn


def _flex_direct_local(n):
    """FlexAttention used directly: a causal sliding-window BlockMask."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # _compile: the mask is evaluated block by block, never as an (n, n)
    # tensor (128 GiB at n = 128K).
    block_mask = create_block_mask(sliding, None, None, n, n, device=dev, _compile=True)
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(q, k, v):  # (B, T, H, d) in and out
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       block_mask=block_mask)
        return out.transpose(1, 2)

    return attend


def _ours(layer_cls, path, H, d, causal, **kwargs):
    """Our layer's ``path`` on projected heads (``layer.attend``: the
    attention alone, no projections), bf16."""
    import keras

    layer = layer_cls(num_heads=H, key_dim=d, implementation=path, dtype="bfloat16", **kwargs)
    x = keras.ops.zeros((1, 128, H * d), "bfloat16")
    layer(x, x, use_causal_mask=causal)

    def attend(q, k, v):
        out = layer.attend(q, k, v, use_causal_mask=causal)
        if layer.last_implementation != path:
            raise RuntimeError(f"ran {layer.last_implementation!r}, not {path!r}")
        return out

    return attend


def bench_torch_methods(n, B, H, d, only_local=False):
    import torch.nn.functional as F

    from keras_longattn import layers as L

    methods = {}
    if not only_local:
        def full(q, k, v):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True)
            return out.transpose(1, 2)

        methods["full_sdpa"] = (lambda: full, n * (n + 1) // 2)
        methods["local_flex_direct"] = (lambda: _flex_direct_local(n), local_pairs(n, WINDOW))
    methods["local_flex"] = (lambda: _ours(L.LocalAttention, "flex", H, d, True,
                                           window=WINDOW), local_pairs(n, WINDOW))
    # The other patterns at one size: each is a compile of its own.
    if only_local or n != bench_shape()[3][len(bench_shape()[3]) // 2]:
        return methods
    methods.update(_pattern_methods("flex", H, d))
    return methods


STAGES = {"correct": stage_correct, "bench": stage_bench}

def record_provenance():
    """The package source files this stage imported, with their hashes (the
    summary's staleness check compares them with today's sources)."""
    from keras_longattn import provenance

    record("provenance", **provenance.collect())


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in STAGES:
        sys.exit(f"usage: device_check.py {{{','.join(STAGES)}}} [SHARD/SHARDS]")
    args = ()
    if len(sys.argv) == 3:
        args = tuple(int(x) for x in sys.argv[2].split("/"))
    try:
        STAGES[sys.argv[1]](*args)
    finally:
        record_provenance()
