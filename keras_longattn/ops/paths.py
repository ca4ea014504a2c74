"""Entry points of the layers' backend paths, and their refusals.

A layer names the path it runs (its ``implementation``); the backend's
kernels behind each path are reached here, through the backend table
(:func:`keras_longattn.kernels.backend_ops`), so that a layer talks to
:mod:`keras_longattn.ops` only. Paths:

* ``"band_kernel"``: the backend's band-attention kernel (PyTorch on the
  CPU) and the Sparse Transformer's pattern kernels;
* ``"block_sparse"``: the block-sparse kernel (the ``"pallas"`` paths, JAX;
  the pattern entry points are :mod:`keras_longattn.ops.block_sparse`);
* ``"flex"``: PyTorch's FlexAttention under the layers' own patterns;
* ``"kernelized"``: kernelized attention with written-out gradients;
* ``"routing"``: the token-routing (sorted-chunk) kernel;
* ``"lsh"``: the LSH attention kernel.

:func:`refusal` says why a path cannot run a call (None: it can), before
anything runs; :func:`variant` what ran where a path ran other code than
its name says.

Shape legend: B batch, T query length, S key length, H heads, d head size.
"""

from keras_longattn.kernels import backend_ops
from keras_longattn.kernels import flex_refusal as _flex_refusal
from keras_longattn.ops import block_sparse as la_block_sparse
from keras_longattn.ops import patterns as la_patterns

#: The paths of this module.
PATHS = ("band_kernel", "block_sparse", "flex", "kernelized", "routing", "lsh")

#: Why the ``"kernelized"`` path refuses a call on a backend without the
#: kernel.
NO_FUSED_KERNEL = (
    "the backend has no kernelized attention with written-out gradients "
    "(BackendOps.kernelized is None; keras_longattn.kernels)"
)


def _check_path(path):
    if path not in PATHS:
        raise ValueError(f"`path` must be one of {PATHS}. Received: path={path!r}")
    return path


def refusal(path, dtype=None, query_length=None, key_length=None, key_dim=None,
            value_dim=None, trainable=False, needs_lse=False):
    """Why ``path`` cannot run a call on the active backend (None: it can).

    Args:
        path: one of :data:`PATHS`.
        dtype: the call's compute dtype (``"band_kernel"``, ``"flex"``).
        query_length, key_length, key_dim, value_dim: the call's lengths
            and head sizes (``"band_kernel"``).
        trainable: whether query, key and value come from trainable
            weights (``"flex"``: they then need gradients).
        needs_lse: whether the path merges parts by their log-sum-exps
            (``"flex"``).
    """
    table = backend_ops()
    path = _check_path(path)
    if path == "band_kernel":
        return table.band_attention_refusal(dtype, query_length, key_length, key_dim,
                                            value_dim)
    if path == "block_sparse":
        return table.block_sparse_refusal()
    if path == "flex":
        return _flex_refusal(dtype, trainable=trainable, needs_lse=needs_lse)
    if path == "kernelized":
        return NO_FUSED_KERNEL if table.kernelized is None else None
    if getattr(table, path) is None:  # "routing", "lsh"
        return f"needs the torch backend (active: {table.name})"
    return None


def variant(path):
    """What ``path`` runs beside its own code on the active backend: None
    where it runs the code its name stands for, else a short name
    (``"band_kernel"``: ``"flash"`` where PyTorch's compiled band kernel
    is switched off or cannot be built and flash-kernel calls stand in)."""
    if _check_path(path) == "band_kernel":
        return backend_ops().band_kernel_variant()
    return None


# ------------------------------------------------------------------- band
def band_attention(query, key, value, look_back, look_ahead, *, path, block_size=None,
                   key_mask=None, scale=None, pattern=None):
    """Exact sliding-window attention (keys ``i - look_back .. i +
    look_ahead``) of ``(B, T, H, d)`` heads on ``path``: ``"band_kernel"``
    (the backend's band kernel, blocks of ``block_size``),
    ``"block_sparse"`` or ``"flex"`` (``pattern``, default
    ``LocalPattern(look_back, look_ahead)``, as the element predicate).
    Only where :func:`refusal` of ``path`` is None."""
    path = _check_path(path)
    if path == "band_kernel":
        return band_kernel_attention(query, key, value, look_back, look_ahead,
                                     block_size=block_size, key_mask=key_mask, scale=scale)
    if pattern is None:
        pattern = la_patterns.LocalPattern(look_back, look_ahead)
    if path == "block_sparse":
        return la_block_sparse.band_attention(query, key, value, look_back, look_ahead,
                                              key_mask=key_mask, scale=scale,
                                              predicate=pattern)
    if path == "flex":
        return backend_ops().flex.local_attention(query, key, value, pattern,
                                                  key_mask=key_mask, scale=scale)
    raise ValueError(f"`path` {path!r} has no band attention. Received: path={path!r}")


def band_kernel_attention(query, key, value, look_back, look_ahead, block_size=None,
                          key_mask=None, scale=None, extra_keys=None, extra_values=None,
                          extra_mask=None):
    """The backend's band-attention kernel
    (:meth:`keras_longattn.kernels.BackendOps.band_attention`: ``extra_keys``
    / ``extra_values`` ``(B, G, H, d)`` with ``extra_mask`` ``(B, T, G)``,
    more keys in the same softmax); the ``band_kernel`` argument of
    :func:`keras_longattn.ops.longformer.longformer_attention`."""
    return backend_ops().band_attention(
        query, key, value, look_back, look_ahead, block_size=block_size,
        key_mask=key_mask, scale=scale, extra_keys=extra_keys,
        extra_values=extra_values, extra_mask=extra_mask)


def strided_attention(query, key, value, stride, causal, window_heads, scale):
    """The Sparse Transformer's strided pattern on the ``"band_kernel"``
    path (:meth:`keras_longattn.kernels.BackendOps.strided_attention`)."""
    return backend_ops().strided_attention(query, key, value, stride, causal,
                                           window_heads, scale)


def fixed_attention(query, key, value, block_length, summary_width, causal, block_heads,
                    scale):
    """The Sparse Transformer's fixed pattern on the ``"band_kernel"`` path
    (:meth:`keras_longattn.kernels.BackendOps.fixed_attention`)."""
    return backend_ops().fixed_attention(query, key, value, block_length, summary_width,
                                         causal, block_heads, scale)


# ------------------------------------------------------------------- flex
def flex_attention(pattern_kind, *args, **kwargs):
    """A ``"flex"`` path's FlexAttention entry point for ``pattern_kind``
    (``"local"``, ``"sparse"``, ``"bigbird"``, ``"longformer"`` or
    ``"cluster"``: ``kernels/torch/flex.py``'s ``<kind>_attention``, with
    its arguments). Only where :func:`refusal` of ``"flex"`` is None."""
    kinds = ("local", "sparse", "bigbird", "longformer", "cluster")
    if pattern_kind not in kinds:
        raise ValueError(
            f"`pattern_kind` must be one of {kinds}. Received: pattern_kind={pattern_kind!r}")
    return getattr(backend_ops().flex, f"{pattern_kind}_attention")(*args, **kwargs)


# ------------------------------------------------- torch kernels by module
def fused_kernelized():
    """The active backend's module of kernelized attention with written-out
    gradients (``associative_attention``, ``softmax_kernel_features``), or
    None (:attr:`keras_longattn.kernels.BackendOps.kernelized`)."""
    return backend_ops().kernelized


def token_routing_attention(*args, **kwargs):
    """Causal token routing (sorted chunks) on the ``"routing"`` path: the
    backend's kernel (``kernels/torch/routing.py``'s
    ``token_routing_attention``, with its arguments)."""
    return backend_ops().routing.token_routing_attention(*args, **kwargs)


def lsh_hash_buckets(*args, **kwargs):
    """The ``"lsh"`` path's hashing (``kernels/torch/lsh.py``'s
    ``hash_buckets``, with its arguments)."""
    return backend_ops().lsh.hash_buckets(*args, **kwargs)


def lsh_attention(*args, **kwargs):
    """The ``"lsh"`` path's attention over the hashing rounds
    (``kernels/torch/lsh.py``'s ``lsh_attention``, with its arguments)."""
    return backend_ops().lsh.lsh_attention(*args, **kwargs)
