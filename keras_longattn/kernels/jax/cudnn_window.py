"""The ``implementation="cudnn"`` paths (JAX on NVIDIA GPUs): a plain
sliding window in cuDNN's fused flash attention, through
``jax.nn.dot_product_attention(..., implementation="cudnn",
local_window_size=(left, right))``.

A layer's window (query ``i`` against keys ``i - look_back .. i +
look_ahead``) maps onto cuDNN's as follows (:func:`window_arguments`):

* causal, or ``look_ahead == 0`` with equal query and key lengths (the
  same pairs): ``is_causal=True, local_window_size=(look_back, 0)``, which
  JAX hands to cuDNN as a sliding window of ``look_back + 1`` keys
  ``(i - look_back - 1, i]``;
* a window with keys ahead (``look_ahead > 0``), not causal:
  ``is_causal=False, local_window_size=(look_back, look_ahead)``, only
  where the installed JAX takes a right window for cuDNN
  (:func:`right_window_supported`; JAX 0.10 raises "cuDNN doesn't support
  right window"), else refused.

The logit scale is the layer's (``scale=``). :func:`refusal` says why a
call cannot run here, before anything runs: no CUDA GPU with cuDNN (the
CPU never has one), a compute dtype other than float16 / bfloat16, a head
size cuDNN's flash kernel does not take (a multiple of 8, at most 128, or
256 from compute capability 9.0 on), value heads of another size than the
query's (``jax.nn.dot_product_attention`` needs them equal), query and key
lengths that differ or are unknown, and a key padding mask: cuDNN takes
per-example key lengths (``key_value_seq_lengths``), i.e. right padding
only, while a boolean mask may pad any position, which no program can tell
while it is traced; those calls go to the Pallas path (or the portable
ones), which take any mask.

:data:`IMPLEMENTATION` is the ``implementation`` argument passed to JAX.
Tests set it to None (JAX's XLA implementation, with the same
``local_window_size`` semantics) to check the argument mapping against the
dense reference on a CPU, where cuDNN cannot run.
"""

import functools

import jax
import jax.numpy as jnp

#: The ``implementation`` of ``jax.nn.dot_product_attention`` (tests: None,
#: XLA's, on the CPU).
IMPLEMENTATION = "cudnn"
#: Compute dtypes cuDNN's flash attention takes.
DTYPES = ("float16", "bfloat16")


def window_arguments(look_back, look_ahead, causal):
    """``(is_causal, local_window_size)`` of ``jax.nn.dot_product_attention``
    for query ``i`` against keys ``i - look_back .. i + look_ahead`` (``<=
    i`` when ``causal``), equal query and key lengths."""
    look_back, look_ahead = int(look_back), int(look_ahead)
    if causal or look_ahead == 0:
        return True, (look_back, 0)
    return False, (look_back, look_ahead)


def device_refusal():
    """Why JAX cannot run cuDNN's fused attention here (None: a CUDA GPU
    with cuDNN)."""
    platform = jax.default_backend()
    if platform != "gpu":
        return ("cuDNN's fused attention runs on NVIDIA GPUs only; JAX's default backend "
                f"is {platform!r} (no cuDNN there)")
    version = str(getattr(jax.devices()[0].client, "platform_version", "") or "")
    if "cuda" not in version.lower():
        return f"JAX's GPU is not a CUDA device (platform version {version!r}): no cuDNN"
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        check_cudnn_version()
    except Exception as error:  # any failure means: no cuDNN to call
        return f"cuDNN is not available to JAX ({type(error).__name__}: {error})"
    return None


def max_head_dim():
    """The largest head size cuDNN's flash attention takes on the active
    GPU: 256 from compute capability 9.0 (Hopper) on, else 128."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        return 128
    return 256 if major >= 9 else 128


@functools.lru_cache(maxsize=None)
def right_window_supported():
    """Whether the installed JAX hands a right window (keys after the
    query, not causal) to cuDNN: traced once on a tiny call
    (``jax.eval_shape``, nothing runs). JAX 0.10 refuses it with a
    ValueError ("cuDNN doesn't support right window"); any error counts as
    no."""
    spec = jax.ShapeDtypeStruct((1, 16, 1, 16), jnp.bfloat16)
    try:
        jax.eval_shape(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, local_window_size=(2, 2), implementation="cudnn"),
            spec, spec, spec)
    except Exception:
        return False
    return True


def refusal(dtype, query_length, key_length, key_dim, value_dim, look_back, look_ahead,
            causal, key_padding):
    """Why :func:`window_attention` cannot run a call (None: it can); see
    the module docstring for each reason."""
    reason = device_refusal()
    if reason is not None:
        return reason
    if str(dtype) not in DTYPES:
        return (f"cuDNN's flash attention takes float16 or bfloat16 only; the compute "
                f"dtype is {dtype}")
    if value_dim != key_dim:
        return (f"value heads of {value_dim} and query/key heads of {key_dim}: "
                "jax.nn.dot_product_attention needs them equal")
    limit = max_head_dim()
    if key_dim % 8 or key_dim > limit:
        return (f"a head size of {key_dim}: cuDNN's flash attention takes a multiple of 8, "
                f"at most {limit} on this GPU")
    if not isinstance(query_length, int) or not isinstance(key_length, int):
        return (f"the sequence lengths must be known (query {query_length}, "
                f"key {key_length})")
    if query_length != key_length:
        return (f"query and key lengths differ ({query_length} and {key_length}): "
                "the window is mapped for equal lengths only")
    if key_padding:
        return ("a key padding mask: cuDNN takes per-example key lengths "
                "(key_value_seq_lengths, right padding only) and a boolean mask may pad "
                "any position")
    if not causal and look_ahead > 0 and not right_window_supported():
        return (f"keys ahead of the query (look_ahead={look_ahead}, not causal): this JAX "
                f"({jax.__version__}) gives cuDNN a left window only")
    return None


def window_attention(query, key, value, look_back, look_ahead, causal, scale):
    """Query ``i`` of ``(B, T, H, d)`` heads against keys ``i - look_back ..
    i + look_ahead`` (``<= i`` when ``causal``), ``(B, T, H, d)`` in the
    query's dtype, by ``jax.nn.dot_product_attention`` with
    :data:`IMPLEMENTATION`. Only where :func:`refusal` is None."""
    is_causal, window = window_arguments(look_back, look_ahead, causal)
    return jax.nn.dot_product_attention(
        query, key, value, scale=None if scale is None else float(scale),
        is_causal=is_causal,
        local_window_size=window, implementation=IMPLEMENTATION)
