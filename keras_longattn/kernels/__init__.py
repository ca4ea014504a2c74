"""Backend-specific code, behind one small table of operations.

``keras_longattn.layers`` and ``keras_longattn.ops`` are written in
``keras.ops`` only: they never ask which backend is active and never import
jax, tensorflow or torch. Where a backend has a faster or a more exact way
to do one of the few operations below, it lives in
``kernels/<backend>/`` and is reached through :func:`backend_ops`, which
imports the active backend's module lazily, on first use. ``ops`` calls the
table; layers reach it through ``ops`` (only ``layers/dispatch.py`` reads
it); no kernel imports :mod:`keras_longattn.ops` (constants both need live
in :mod:`keras_longattn.kernels.constants`).

The table (methods of :class:`BackendOps`; the portable default is what a
backend without its own entry gets):

* ``take_rows(x, rows)``: ``x[rows]`` of a 2-D tensor;
* ``segment_sum(data, segment_ids, num_segments)``: sums over the first axis;
* ``cluster_sums(x, assignment, num_clusters)``: per head, the sums and
  counts of the tokens assigned to each of ``k`` clusters (k-means
  statistics);
* ``top_k_indices(x, k, axis)``: positions of the ``k`` largest entries
  along ``axis``, ties resolved towards the lower position on every backend;
* ``dot_product_attention(q, k, v, mask, is_causal, scale)``: the fused
  attention kernel of the backend, any value head size;
* ``kept_items(flags)``: the indices of the True entries of a 1-D boolean
  tensor when the backend runs data-dependent shapes eagerly, else None;
* ``max_scores_per_call``: how many attention scores one fused call of
  sorted-chunk attention should hold at most (None: no limit);
* ``compile(fn, static_argnames)``: the backend's compile policy for a
  kernel made of many small operations (:func:`compiled` applies it);
* ``band_attention(q, k, v, look_back, look_ahead, block_size, key_mask,
  scale)``: exact sliding-window attention by a backend kernel, where
  ``band_attention_refusal(dtype, query_length, key_length, key_dim,
  value_dim)`` is None (the
  portable table has none: it refuses every call); ``strided_attention``
  and ``fixed_attention`` likewise, for the Sparse Transformer's patterns;
* ``block_sparse_attention(query, key, value, rows, cols, block_q,
  block_k, predicate, q_pos, k_pos, k_valid, scale)``: block-sparse flash
  attention under a block layout's tables (the Pallas kernel of
  ``kernels/jax/pallas_attention.py`` on JAX), where
  ``block_sparse_refusal()`` is None (the portable table refuses); the
  layers reach it through :mod:`keras_longattn.ops.block_sparse`;
* ``window_attention(query, key, value, look_back, look_ahead, causal,
  scale)``: a plain sliding window (query ``i`` against keys ``i -
  look_back .. i + look_ahead``) of ``(B, T, H, d)`` heads, no padding, in
  cuDNN's fused kernel (``kernels/jax/cudnn_window.py``: JAX on an NVIDIA
  GPU), where ``window_attention_refusal(dtype, query_length, key_length,
  key_dim, value_dim, look_back, look_ahead, causal, key_padding)`` is
  None (the portable table refuses every call);
* ``probe(fn, args)``: where the backend compiles a path later than the
  Python call that traces it (JAX under ``jax.jit``), compiles ``fn(*args)``
  now, forward and backward, and raises what compiling raises (the
  fallback of :mod:`keras_longattn.layers.dispatch`); elsewhere nothing;
* ``refuse_at_run_time(bad, value, message)``: raise ``message`` (with
  ``{value}`` filled in) when the traced boolean scalar ``bad`` turns out
  True while a compiled function runs; returns ``(value, refused)``: the
  value to compute with (ordered after the check) and whether the backend
  can refuse (JAX: a host callback, taken only on the bad branch;
  TensorFlow graphs: an assert, which XLA drops; portable: never);
* ``kernelized``: a module of kernelized attention with hand-written
  gradients (``associative_attention`` and ``softmax_kernel_features``, the
  arguments and results of :mod:`keras_longattn.ops.kernelized` and
  :mod:`keras_longattn.ops.performer`), or None where the backend has none;
* ``flex``: the FlexAttention module of the ``"flex"`` paths
  (``kernels/torch/flex.py``: ``torch.nn.attention.flex_attention`` under
  the layers' own patterns), or None where the backend has none (every
  backend but torch); :func:`flex_refusal` says why a call cannot run it;
* ``auto_preference``: the order in which ``implementation="auto"`` tries
  the *kinds* of implementation (``"explicit"``: einsums and a masked
  softmax, which XLA fuses; ``"fused"``: ``keras.ops.dot_product_attention``
  on block layouts; ``"pallas"``: the block-sparse Pallas kernel of
  ``kernels/jax/pallas_attention.py``; ``"flex"``: PyTorch's
  FlexAttention; ``"cudnn"``: cuDNN's sliding window). A kind missing from
  a backend's order is never chosen by ``"auto"`` there (only by name).
  The accelerator kinds (``"cudnn"``, ``"pallas"``, ``"flex"``) are listed
  first only on a GPU/TPU of a vendor for which a device run proved them
  on the path's current sources (:mod:`keras_longattn.kernels.proven`),
  never on the CPU, where Pallas only interprets.
"""

import functools
import importlib

import keras
from keras import ops

#: Kinds of implementation a layer declares (see
#: :class:`keras_longattn.layers.Implementation`).
IMPLEMENTATION_KINDS = ("explicit", "fused", "pallas", "flex", "cudnn")
#: The kinds that run a device's own kernels, which ``"auto"`` tries only
#: where a device run proved them (:mod:`keras_longattn.kernels.proven`),
#: and falls back from when they fail to compile or launch.
ACCELERATOR_KINDS = ("pallas", "flex", "cudnn")


class BackendOps:
    """The portable entries of the table: ``keras.ops`` only."""

    #: Name of the backend this table serves.
    name = "portable"
    #: Kinds of implementation, in the order ``"auto"`` tries them (a kind
    #: not listed is never tried by ``"auto"``).
    auto_preference = ("explicit", "fused")
    #: Most scores per fused call of sorted-chunk attention (None: no limit).
    max_scores_per_call = None
    #: Kernelized attention with hand-written gradients (None: none).
    kernelized = None
    #: Token routing (causal sorted-chunk attention) kernel module, with
    #: ``token_routing_attention`` (None: none).
    routing = None
    #: LSH attention kernel module, with ``hash_buckets`` and
    #: ``lsh_attention`` (None: none).
    lsh = None
    #: The FlexAttention entry points of the ``"flex"`` paths
    #: (``kernels/torch/flex.py``; None: none).
    flex = None
    #: Whether the sequence can be split across devices
    #: (:mod:`keras_longattn.parallel`: ``shard_map`` under a
    #: ``keras.distribution`` mesh).
    context_parallel = False

    def take_rows(self, x, rows):
        """``x[rows]``: ``x`` 2-D, ``rows`` int ``(N,)``."""
        return ops.take(x, rows, axis=0)

    def segment_sum(self, data, segment_ids, num_segments):
        """Sums of the rows of ``data`` per segment id in
        ``[0, num_segments)``."""
        return ops.segment_sum(data, segment_ids, num_segments=num_segments)

    def cluster_sums(self, x, assignment, num_clusters):
        """Per head, the float32 sums ``(H, k, d)`` and counts ``(H, k)`` of
        the tokens ``x`` ``(B, n, H, d)`` assigned to each cluster by
        ``assignment`` int ``(B, H, n)`` in ``[0, k]`` (``k``: padding,
        dropped), over the batch.

        One matrix product with the ``(B, H, n, k)`` membership indicators:
        O(n k d), the size of the similarities the assignment already
        formed, and one compiled program with no scatter on JAX and
        TensorFlow.
        """
        k = int(num_clusters)
        clusters = ops.arange(k, dtype="int32")
        member = ops.equal(ops.expand_dims(ops.cast(assignment, "int32"), -1), clusters)
        member = ops.cast(member, "float32")  # (B, H, n, k); padding: no cluster
        sums = ops.einsum("bhnk,bnhd->hkd", member, ops.cast(x, "float32"))
        counts = ops.sum(member, axis=(0, 2))
        return sums, counts

    def top_k_indices(self, x, k, axis=-1):
        """int32 positions of the ``k`` largest entries along ``axis`` (in no
        particular order), the lower position first among equal values.

        ``keras.ops.top_k`` on JAX and TensorFlow already prefers the lower
        index among ties.
        """
        rank = len(x.shape)
        axis = axis % rank
        if axis != rank - 1:
            x = ops.moveaxis(x, axis, -1)
        _, idx = ops.top_k(x, int(k))
        idx = ops.cast(idx, "int32")
        if axis != rank - 1:
            idx = ops.moveaxis(idx, -1, axis)
        return idx

    def dot_product_attention(self, q, k, v, mask=None, is_causal=False, scale=None):
        """``keras.ops.dot_product_attention`` (``(B, T, H, d)`` layout)."""
        return ops.dot_product_attention(
            q, k, v, mask=mask, is_causal=is_causal, scale=scale
        )

    def as_tensor(self, x):
        """``x`` as a tensor of the backend (``keras.ops.convert_to_tensor``;
        a backend whose variables lack parts of the tensor API reads them
        into tensors)."""
        return ops.convert_to_tensor(x)

    def refuse_at_run_time(self, bad, value, message):
        """Raises ``message.format(value=...)`` when the traced boolean
        scalar ``bad`` is True at run time, where the backend can; returns
        ``(value, refused)``: ``value`` to compute with (ordered after the
        check) and whether the backend can (here: never)."""
        return value, False

    def kept_items(self, flags):
        """Indices of the True entries of boolean ``flags`` ``(N,)``, or None
        where the backend cannot run a data-dependent shape."""
        return None

    def compile(self, fn, static_argnames=()):
        """The compiled form of ``fn`` (here: ``fn`` itself)."""
        return fn

    def band_attention_refusal(self, dtype, query_length, key_length, key_dim, value_dim):
        """Why :meth:`band_attention` cannot run a call of this compute
        ``dtype``, these lengths and head sizes (None: it can)."""
        return f"no band-attention kernel on the {self.name} backend"

    def band_kernel_variant(self):
        """Which code :meth:`band_attention` and the pattern kernels run:
        ``None`` where they run the backend's compiled kernel (or where
        the backend has none), else a short name of what runs instead
        (``"flash"``: the flash-kernel calls that stand in on torch when
        the compiled kernel is switched off or cannot be built).
        ``last_implementation`` appends it: ``"band_kernel:flash"``."""
        return None

    def band_attention(self, q, k, v, look_back, look_ahead, block_size=None,
                       key_mask=None, scale=None, extra_keys=None, extra_values=None,
                       extra_mask=None):
        """Exact sliding-window attention (keys ``i - look_back .. i +
        look_ahead``) of ``(B, T, H, d)`` heads by a backend kernel; a query
        that sees no key gets zeros. ``extra_keys`` / ``extra_values``
        ``(B, G, H, d)`` with the boolean ``extra_mask`` ``(B, T, G)``: a
        few more keys in the same softmax (Longformer's global keys). Only
        where :meth:`band_attention_refusal` is None."""
        raise NotImplementedError(self.band_attention_refusal(None, None, None, None, None))

    def block_sparse_refusal(self):
        """Why :meth:`block_sparse_attention` cannot run on this backend
        (None: it can)."""
        return (
            "the Pallas kernel needs the JAX backend (KERAS_BACKEND=jax); "
            f"the active backend is {self.name!r}"
        )

    def block_sparse_attention(self, query, key, value, rows, cols, block_q, block_k, *,
                               predicate=None, q_pos=None, k_pos=None, k_valid=None,
                               scale=None):
        """Block-sparse flash attention of ``(B, T, H, d)`` heads: query
        block ``i`` visits the key blocks that row ``i`` of the int32
        layout table ``rows`` lists (``cols``: the transposed table), with
        blocks of ``block_q`` queries and ``block_k`` keys; inside a visited
        block ``predicate.allowed(q_pos, k_pos)`` decides each pair (None:
        every pair) and ``k_valid`` marks real keys. Returns ``(out, lse)``.
        Only where :meth:`block_sparse_refusal` is None (the arguments are
        those of :func:`keras_longattn.kernels.jax.pallas_attention.block_sparse_attention`)."""
        raise NotImplementedError(self.block_sparse_refusal())

    def window_attention_refusal(self, dtype, query_length, key_length, key_dim, value_dim,
                                 look_back, look_ahead, causal, key_padding):
        """Why :meth:`window_attention` cannot run a call (None: it can):
        its compute ``dtype``, lengths, head sizes, window extents, whether
        it is causal and whether it has a key padding mask."""
        return (
            "cuDNN's sliding-window attention needs the JAX backend on an NVIDIA GPU "
            f"(KERAS_BACKEND=jax); the active backend is {self.name!r}"
        )

    def window_attention(self, query, key, value, look_back, look_ahead, causal, scale):
        """Query ``i`` of ``(B, T, H, d)`` heads against keys ``i -
        look_back .. i + look_ahead`` (and ``<= i`` when ``causal``), no
        padding, in cuDNN's fused kernel; only where
        :meth:`window_attention_refusal` is None."""
        raise NotImplementedError(self.window_attention_refusal(
            None, None, None, None, None, look_back, look_ahead, causal, False))

    def probe(self, fn, args):
        """Compiles ``fn(*args)`` where the backend would compile it only
        after the call returns (nothing here: the portable backends
        compile, or fail, while the path runs)."""
        return None

    def strided_attention(self, q, k, v, stride, causal, window_heads, scale):
        """The Sparse Transformer's strided pattern (heads ``[0,
        window_heads)`` a window of ``stride`` keys, the others every
        ``stride``-th key) of ``(B, T, H, d)`` heads, ``T`` a multiple of
        ``stride``, no padding, by a backend kernel; only where
        :meth:`band_attention_refusal` is None."""
        raise NotImplementedError(self.band_attention_refusal(None, None, None, None, None))

    def fixed_attention(self, q, k, v, block_length, summary_width, causal, block_heads,
                        scale):
        """The Sparse Transformer's fixed pattern (heads ``[0,
        block_heads)`` their own block of ``block_length`` keys, the others
        the last ``summary_width`` positions of every block) of ``(B, T, H,
        d)`` heads, ``T`` a multiple of ``block_length``, no padding, by the
        backend's kernels; only where :meth:`band_attention_refusal` is
        None."""
        raise NotImplementedError(self.band_attention_refusal(None, None, None, None, None))


_TABLES = {}
_MODULES = {
    "jax": "keras_longattn.kernels.jax",
    "tensorflow": "keras_longattn.kernels.tensorflow",
    "torch": "keras_longattn.kernels.torch",
}


def backend_ops(backend=None):
    """The table of operations of ``backend`` (default: the active Keras
    backend), a :class:`BackendOps`. Imported on first use."""
    backend = backend or keras.backend.backend()
    table = _TABLES.get(backend)
    if table is None:
        module = _MODULES.get(backend)
        table = BackendOps() if module is None else importlib.import_module(module).OPS
        _TABLES[backend] = table
    return table


def flex_refusal(dtype, trainable=False, needs_lse=False):
    """Why a ``"flex"`` path cannot run a call of compute ``dtype`` on the
    active backend (None: it can): ``trainable``, whether the call's query,
    key and value come from trainable weights (they then need gradients
    where gradients are enabled); ``needs_lse``, whether the path merges
    parts by their log-sum-exps. See
    :func:`keras_longattn.kernels.torch.flex.refusal`."""
    ops_table = backend_ops()
    if ops_table.flex is None:
        return (
            "FlexAttention needs the torch backend (KERAS_BACKEND=torch); "
            f"the active backend is {ops_table.name!r}"
        )
    return ops_table.flex.refusal(dtype, trainable=trainable, needs_lse=needs_lse)


def compiled(static_argnames=()):
    """Decorator: runs a kernel under the active backend's compile policy.

    On JAX the function becomes one compiled program per shapes and static
    arguments (eager JAX would otherwise compile each primitive on first
    use); a call with a ``dropout_fn`` (stateful randomness) runs plainly.
    On torch it stays eager inside a ``torch.compile``-d model; on
    TensorFlow it runs as it is (inside ``tf.function`` when the model is).
    ``wrapper.uncompiled`` is the plain function.
    """

    def decorate(fn):
        cache = {}

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            backend = keras.backend.backend()
            run = cache.get(backend)
            if run is None:
                run = backend_ops(backend).compile(fn, static_argnames)
                cache[backend] = run
            return run(*args, **kwargs)

        wrapper.uncompiled = fn
        return wrapper

    return decorate
