"""Named implementations of an attention layer and how ``"auto"`` picks one.

Every efficient path of a layer is one :class:`Implementation`: a name, a
*kind* and a function that computes the attention of a call. Before a path
runs, it is asked whether it can honour the call; it either runs the call
completely or refuses it, with a reason, before running. No path falls back
to another inside: ``layer.last_implementation`` is always the path that
ran.

Kinds say how a path computes, not what: ``"explicit"`` paths write scores,
a masked softmax and the weighted sum with ``keras.ops`` (which XLA fuses on
JAX and TensorFlow); ``"fused"`` paths hand block layouts to
``keras.ops.dot_product_attention`` (PyTorch's flash kernel on the CPU);
``"pallas"`` paths run the block-sparse Pallas kernel (JAX only, refused on
other backends with :func:`keras_longattn.ops.paths.refusal`; ``"auto"``
tries them on GPU/TPU only). The order in which ``implementation="auto"``
tries the kinds on each backend is one table,
:attr:`keras_longattn.kernels.BackendOps.auto_preference`
(:func:`auto_preference`). This is the only module of the layers that reads
the backend table; the layers' paths reach the kernels through
:mod:`keras_longattn.ops`, the ``"cudnn"`` paths through
:func:`window_kernel_attention` here.

``"cudnn"`` paths run a plain sliding window in cuDNN's fused attention
(JAX on NVIDIA GPUs: :func:`window_kernel_attention`, refused elsewhere
with :func:`window_kernel_refusal`). ``"auto"`` tries the accelerator
kinds (``"cudnn"``, ``"pallas"``, ``"flex"``:
:data:`keras_longattn.kernels.ACCELERATOR_KINDS`) first, and only on a GPU
of a vendor for which a device run proved them
(:mod:`keras_longattn.kernels.proven`). When such a path, chosen by
``"auto"``, fails to compile or launch (it raises while it runs, or while
:meth:`keras_longattn.kernels.BackendOps.probe` compiles it under
``jax.jit``), the call falls back to the next path ``"auto"`` would take,
with one warning per layer class and path naming the error, and
``"auto"`` does not try that path for that layer class again in the
process (:func:`run_accelerated`, :func:`path_failure`). A path named by
the user raises instead.

A further kind, ``"context_parallel"``, runs a call with the sequence split
across the devices of a :class:`keras_longattn.parallel.ContextParallel`
distribution (JAX only): ``"auto"`` tries it first while such a
distribution is in scope (``keras.distribution.distribution()``) and never
otherwise; it may also be named. :func:`context_parallel_refusal` gives
the reasons common to every such path, :func:`context_parallel_axes` the
mesh and axes it runs on. :mod:`keras_longattn.parallel` is imported only
when a distribution is in scope or such a path runs.

A layer declares its paths with the :func:`implementation` decorator, in its
order of preference within a kind::

    class MyAttention(BaseAttention):
        @implementation("blocked")
        def _blocked(self, query, key, value, context):
            ...

        @implementation("blocked_fused", kind="fused", dropout=False)
        def _blocked_fused(self, query, key, value, context):
            ...

        @_blocked_fused.refuses
        def _blocked_fused(self, context):
            if self.combination == "merged":
                return "combination='merged' needs each part's log-sum-exp"
            return None
"""

import warnings

from keras_longattn.kernels import ACCELERATOR_KINDS
from keras_longattn.kernels import IMPLEMENTATION_KINDS
from keras_longattn.kernels import backend_ops
from keras_longattn.ops import paths as la_paths

#: Reason given when a path without attention dropout meets dropout in
#: training.
DROPOUT_REASON = "attention dropout in training needs the explicit weights"

#: The kind of the paths that split the sequence across the devices of a
#: :class:`keras_longattn.parallel.ContextParallel` distribution.
CONTEXT_PARALLEL = "context_parallel"

#: Every kind an :class:`Implementation` may have.
KINDS = tuple(IMPLEMENTATION_KINDS) + (CONTEXT_PARALLEL,)


def window_kernel_refusal(dtype, query_length, key_length, key_dim, value_dim, look_back,
                          look_ahead, causal, key_padding):
    """Why a ``"cudnn"`` path cannot run a plain window (query ``i``
    against keys ``i - look_back .. i + look_ahead``) on the active backend
    (None: it can):
    :meth:`keras_longattn.kernels.BackendOps.window_attention_refusal`
    (JAX: ``kernels/jax/cudnn_window.py``)."""
    return backend_ops().window_attention_refusal(
        dtype, query_length, key_length, key_dim, value_dim, look_back, look_ahead,
        bool(causal), bool(key_padding))


def window_kernel_attention(query, key, value, look_back, look_ahead, causal, scale):
    """The plain window of ``(B, T, H, d)`` heads in cuDNN's fused kernel
    (:meth:`keras_longattn.kernels.BackendOps.window_attention`); only
    where :func:`window_kernel_refusal` is None."""
    return backend_ops().window_attention(query, key, value, look_back, look_ahead,
                                          bool(causal), scale)


#: ``{(layer class name, path name): "ErrorType: message"}``: accelerator
#: paths that failed to compile or launch in this process.
_FAILED = {}


def path_failure(layer, name):
    """Why ``"auto"`` no longer tries path ``name`` of ``layer``'s class
    (the error it raised earlier in this process), or None."""
    error = _FAILED.get((type(layer).__name__, name))
    if error is None:
        return None
    return f"failed on this device earlier in this process ({error})"


def forget_failures():
    """Lets ``"auto"`` try again the paths that failed (tests, or after
    fixing a device setting)."""
    _FAILED.clear()


def run_accelerated(layer, path, query, key, value, context):
    """Runs ``path`` (an accelerator kind, chosen by ``"auto"``): compiles
    it first where the backend compiles later than the call
    (:meth:`keras_longattn.kernels.BackendOps.probe`), then runs it.
    Returns the output, or raises what compiling or running raised."""
    backend_ops().probe(lambda q, k, v: path.run(layer, q, k, v, context), (query, key, value))
    return path.run(layer, query, key, value, context)


def record_failure(layer, path, error):
    """Records that ``path`` failed for ``layer``'s class with ``error`` and
    warns once (per layer class and path) that ``"auto"`` falls back."""
    key = (type(layer).__name__, path.name)
    if key in _FAILED:
        return
    text = f"{type(error).__name__}: {error}"
    if len(text) > 1000:
        text = text[:1000] + " ..."
    _FAILED[key] = text
    warnings.warn(
        f"{type(layer).__name__} with implementation='auto': the {path.kind!r} path "
        f"{path.name!r} failed to compile or run on this device ({text}). This call and "
        f"later ones run the next path 'auto' picks (the portable paths), and 'auto' does "
        f"not try {path.name!r} for {type(layer).__name__} again in this process. Name "
        f"implementation={path.name!r} to see the error raised instead.",
        stacklevel=4,
    )


def is_accelerator(path):
    """Whether ``path`` is of an accelerator kind (see
    :data:`keras_longattn.kernels.ACCELERATOR_KINDS`)."""
    return path.kind in ACCELERATOR_KINDS


def auto_preference():
    """The kinds of implementation in the order ``implementation="auto"``
    tries them on the active backend
    (:attr:`keras_longattn.kernels.BackendOps.auto_preference`), preceded
    by ``"context_parallel"`` while a
    :class:`keras_longattn.parallel.ContextParallel` distribution is in
    scope."""
    preference = tuple(backend_ops().auto_preference)
    if context_parallel_distribution() is not None:
        return (CONTEXT_PARALLEL,) + preference
    return preference


def _distribution_in_scope():
    """``keras.distribution.distribution()`` (None when unset, and on
    backends without ``keras.distribution``)."""
    import keras

    try:
        return keras.distribution.distribution()
    except (AttributeError, ImportError, NotImplementedError):
        return None


def context_parallel_distribution():
    """The :class:`keras_longattn.parallel.ContextParallel` distribution in
    scope, or None (no distribution, another kind of distribution, or a
    backend other than JAX)."""
    if not backend_ops().context_parallel:
        return None
    distribution = _distribution_in_scope()
    if distribution is None:
        return None
    from keras_longattn.parallel.layouts import ContextParallel

    return distribution if isinstance(distribution, ContextParallel) else None


def context_parallel_devices():
    """The number of devices on the sequence axis of the
    :class:`~keras_longattn.parallel.ContextParallel` in scope (None
    without one)."""
    distribution = context_parallel_distribution()
    if distribution is None:
        return None
    mesh = distribution.device_mesh
    return int(mesh.shape[list(mesh.axis_names).index(distribution.sequence_dim_name)])


def context_parallel_refusal(context, multiple=1, self_attention=True):
    """Why a context-parallel path cannot run ``context``, for the reasons
    every such path shares, or None.

    Refused: a backend other than JAX; no
    :class:`~keras_longattn.parallel.ContextParallel` distribution in
    scope; a dense ``attention_mask`` (padding travels as key masks);
    sequence lengths unknown while tracing; query and key lengths that
    differ when ``self_attention``; lengths that are not a multiple of
    ``multiple`` times the devices of the sequence axis.
    """
    if not backend_ops().context_parallel:
        from keras_longattn.parallel.context import context_parallel_refusal as refusal

        return refusal()
    distribution = context_parallel_distribution()
    if distribution is None:
        return ("no keras_longattn.parallel.ContextParallel distribution is in scope "
                f"(keras.distribution.distribution() is {_distribution_in_scope()!r})")
    if context.attention_mask is not None:
        return ("a dense attention_mask is not split along the sequence; pass padding "
                "as query/value/key masks")
    T, S = context.query_length, context.key_length
    if not isinstance(T, int) or not isinstance(S, int):
        return f"the sequence lengths must be known (query {T}, key {S})"
    if self_attention and T != S:
        return f"cross-attention of different lengths (query {T}, key {S})"
    parts = multiple * context_parallel_devices()
    for name, n in (("query", T), ("key", S)):
        if n % parts:
            what = "the devices" if multiple == 1 else f"{multiple} x the devices"
            return (f"the {name} length {n} is not a multiple of {parts} ({what} of the "
                    f"sequence axis {distribution.sequence_dim_name!r})")
    return None


def context_parallel_axes(batch_size):
    """Keyword arguments ``mesh``, ``sequence_axis`` and ``batch_axis`` of
    the :mod:`keras_longattn.parallel` functions for the
    :class:`~keras_longattn.parallel.ContextParallel` in scope. The batch
    is split over its axis when ``batch_size`` is a multiple of that axis'
    size, else computed whole on each of its devices."""
    distribution = context_parallel_distribution()
    if distribution is None:
        raise ValueError("no keras_longattn.parallel.ContextParallel distribution is in scope")
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    batch_axis = distribution.batch_dim_name
    if batch_axis is not None and (
            not isinstance(batch_size, int) or batch_size % int(sizes[batch_axis])):
        batch_axis = None
    return {"mesh": mesh, "sequence_axis": distribution.sequence_dim_name,
            "batch_axis": batch_axis}


class Implementation:
    """One named way of computing a layer's attention.

    Args:
        fn: ``fn(layer, query, key, value, context)`` returning the attention
            output ``(B, T, H, dv)`` of projected heads.
        name: the value of the layer's ``implementation`` argument that
            selects it.
        kind: ``"explicit"``, ``"fused"``, ``"pallas"``, ``"flex"``,
            ``"cudnn"`` or ``"context_parallel"`` (see the module
            docstring).
        dropout: whether the path applies attention dropout; a path that
            does not refuses calls with dropout active in training.
    """

    def __init__(self, fn, name, kind="explicit", dropout=True):
        if kind not in KINDS:
            raise ValueError(
                f"`kind` must be one of {KINDS}. Received: kind={kind!r}"
            )
        self.fn = fn
        self.name = name
        self.kind = kind
        self.dropout = bool(dropout)
        self._refusal = None
        self._variant = None
        self.__doc__ = fn.__doc__

    def refuses(self, check):
        """Decorator: ``check(layer, context)`` returns a reason (a string)
        when this path cannot honour a call, else None. Returns the
        implementation itself, so the decorated name may be reused."""
        self._refusal = check
        return self

    def reports(self, variant):
        """Decorator: ``variant(layer, context)`` returns None when the path
        ran the code its name stands for, else a short name of what ran
        instead, which ``last_implementation`` appends after a colon
        (``"band_kernel:flash"``). Returns the implementation itself."""
        self._variant = variant
        return self

    def variant(self, layer, context):
        """What :meth:`run` ran for ``context`` beside the path's own code
        (None: the path's own code)."""
        if self._variant is None:
            return None
        return self._variant(layer, context)

    def refusal(self, layer, context):
        """Why this path cannot run ``context`` on ``layer`` (None: it can)."""
        if not self.dropout and layer.dropout > 0.0 and is_training(context.training):
            return DROPOUT_REASON
        if self._refusal is not None:
            return self._refusal(layer, context)
        return None

    def run(self, layer, query, key, value, context):
        """Computes the attention of the call."""
        return self.fn(layer, query, key, value, context)

    def __repr__(self):
        return f"Implementation(name={self.name!r}, kind={self.kind!r})"


def implementation(name, kind="explicit", dropout=True):
    """Decorator turning a layer method ``(self, query, key, value,
    context)`` into an :class:`Implementation` of that name and kind."""

    def decorate(fn):
        return Implementation(fn, name, kind=kind, dropout=dropout)

    return decorate


def collect_implementations(cls):
    """The implementations of a layer class, base classes first, in order
    of definition (a subclass may redefine a name)."""
    table = {}
    for klass in reversed(cls.__mro__):
        for value in vars(klass).values():
            if isinstance(value, Implementation):
                table[value.name] = value
    return table


def is_training(training):
    """The Keras ``training`` flag as a Python bool (a symbolic flag counts
    as False: Keras passes Python bools in ``fit``)."""
    if training is None:
        return False
    if isinstance(training, bool):
        return training
    try:
        return bool(training)
    except Exception:
        return False
