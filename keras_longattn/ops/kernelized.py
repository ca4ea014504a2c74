"""Kernelized (linear) attention: similarities ``phi(q) . phi(k)`` with a
non-negative feature map ``phi``, normalised per query.

Written as ``phi(Q) (phi(K)^T V)`` the cost is linear in the number of keys
(Katharopoulos et al. 2020): the ``(F, dv)`` key/value summary and the
``(F,)`` normaliser of each head are computed once and shared by every
query. The explicit quadratic form (the ``(T, S)`` weights materialised) is
here too, as the specification the associative form is checked against.

Safe denominator: a query whose features are all zero (ReLU features of a
query with no positive coordinate) has the normaliser ``phi(q) . sum_j
phi(k_j) = 0``. Both forms divide by ``max(normaliser, epsilon)`` instead, so
such a query gets an output of exactly zero, finite gradients, and every
other query is unchanged while its normaliser is at least ``epsilon``
(:data:`DEFAULT_EPSILON`).

Everything is accumulated in float32 and returned in the dtype of
``value`` (under ``mixed_float16`` a sum over tens of thousands of keys
would overflow float16).

Causal attention (:func:`causal_kernel_attention`) keeps the running sums
``sum_{j<=i} phi(k_j) v_j^T`` per *chunk* of ``chunk_size`` positions, never
per position: inside a chunk the ``(C, C)`` weights are formed explicitly
(lower triangle), between chunks an exclusive prefix sum of the chunks'
``(F, dv)`` summaries carries the past. Memory O(n * C + (n / C) * F * dv)
per head, time O(n * (C * (F + dv) + F * dv)): no ``(n, F, dv)`` tensor of
every position's running sum.

Shape legend: B batch, T query length, S key length, H heads, F features
per head, dv value head size, C chunk size, N chunks.
"""

from keras import ops

from keras_longattn.kernels.constants import DEFAULT_CHUNK_SIZE
from keras_longattn.kernels.constants import DEFAULT_EPSILON
from keras_longattn.kernels.constants import check_chunk_size
from keras_longattn.kernels.constants import check_epsilon
from keras_longattn.ops.blocked import pad_axis
from keras_longattn.ops.segments import dims
from keras_longattn.ops.shapes import ceil_div
from keras_longattn.ops.shapes import head_slices as _head_slices
from keras_longattn.ops.shapes import is_static
from keras_longattn.ops.shapes import larger
from keras_longattn.ops.shapes import length

#: Feature maps understood by :func:`feature_map`.
FEATURE_MAPS = ("relu", "elu+1")

#: Most elements of one head slice's features, ``B * n * heads * features``
#: (:func:`head_slices`): 16 MiB of float32.
MAX_SLICE_ELEMENTS = 1 << 22


def head_slices(query, key, features):
    """``(h0, h1)`` head ranges for the fused kernelized paths of these
    ``(B, T, H, d)`` queries and ``(B, S, H, d)`` keys
    (:func:`keras_longattn.ops.shapes.head_slices` with
    :data:`MAX_SLICE_ELEMENTS` and ``features`` per head and position).

    Heads are independent in kernelized attention, so running a few at a
    time changes no number; it keeps every temporary of a slice (features,
    chunk states, their gradients) out of the allocator's fresh mappings.
    """
    T, S = query.shape[1], key.shape[1]
    n = None if None in (T, S) else max(T, S)
    return _head_slices(query.shape[0], n, query.shape[2], features, MAX_SLICE_ELEMENTS)


def refuse_dropout(layer):
    """Kernelized attention never forms weights: a layer's ``dropout > 0``
    is refused at construction (a ValueError naming it)."""
    if layer.dropout > 0.0:
        raise ValueError(
            f"{type(layer).__name__} never forms attention weights, so there "
            "is nothing for attention dropout to drop: use dropout=0. "
            f"Received: dropout={layer.dropout!r}"
        )


def check_feature_map(name):
    """``name`` if it is one of :data:`FEATURE_MAPS`, else a ValueError
    naming ``feature_map`` and the value received."""
    if not isinstance(name, str) or name not in FEATURE_MAPS:
        raise ValueError(
            f"`feature_map` must be one of {FEATURE_MAPS}. "
            f"Received: feature_map={name!r}"
        )
    return name


def feature_map(x, name="relu"):
    """The non-negative features ``phi(x)``: ``"relu"`` (``max(x, 0)``, may
    be all zero) or ``"elu+1"`` (``elu(x) + 1``, always positive)."""
    check_feature_map(name)
    if name == "relu":
        return ops.relu(x)
    return ops.elu(x) + ops.cast(1.0, x.dtype)


def safe_denominator(normaliser, epsilon=DEFAULT_EPSILON):
    """``max(normaliser, epsilon)``: the divisor of kernelized attention
    (``epsilon`` checked by :func:`check_epsilon`)."""
    epsilon = check_epsilon(epsilon)
    return ops.maximum(normaliser, ops.cast(epsilon, normaliser.dtype))


def _masked_keys(key_features, value, key_mask):
    """Features and values of masked keys set to exact zeros (``where``,
    not a product: a NaN there must not leak)."""
    if key_mask is None:
        return key_features, value
    mask = ops.cast(key_mask, "bool")
    if len(mask.shape) == 2:  # (B, S)
        mask = mask[:, :, None]
    mask = mask[..., None]  # (B, S, H or 1, 1)
    key_features = ops.where(mask, key_features, ops.zeros_like(key_features))
    value = ops.where(mask, value, ops.zeros_like(value))
    return key_features, value


def kernel_attention(
    query_features,
    key_features,
    value,
    key_mask=None,
    epsilon=DEFAULT_EPSILON,
):
    """Kernelized attention in its associative (linear) form.

    ``out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / max(phi(q_i)^T sum_j
    phi(k_j), epsilon)``. Time O((T + S) * F * dv) per head, memory
    O((T + S) * (F + dv) + F * dv): no ``(T, S)`` tensor.

    Args:
        query_features: non-negative ``(B, T, H, F)`` (``phi`` applied).
        key_features: non-negative ``(B, S, H, F)``.
        value: ``(B, S, H, dv)``.
        key_mask: optional boolean ``(B, S)`` or ``(B, S, H)``; False keys
            take no part (their features and values may be anything).
        epsilon: smallest divisor (see the module docstring).

    Returns:
        ``(B, T, H, dv)`` in the dtype of ``value``.
    """
    dtype = value.dtype
    qf = ops.cast(query_features, "float32")
    kf = ops.cast(key_features, "float32")
    v = ops.cast(value, "float32")
    kf, v = _masked_keys(kf, v, key_mask)
    dv = v.shape[-1]
    # Head-major matmuls; a column of ones appended to the values carries
    # the normaliser through the same products.
    q = ops.transpose(qf, (0, 2, 1, 3))  # (B, H, T, F)
    k = ops.transpose(kf, (0, 2, 3, 1))  # (B, H, F, S)
    v1 = ops.transpose(_with_ones(v), (0, 2, 1, 3))  # (B, H, S, dv + 1)
    summary = ops.matmul(k, v1)  # (B, H, F, dv + 1)
    out = ops.matmul(q, summary)  # (B, H, T, dv + 1)
    out = out[..., :dv] / safe_denominator(out[..., dv:], epsilon)
    return ops.cast(ops.transpose(out, (0, 2, 1, 3)), dtype)


def _with_ones(v):
    """``v`` with a last column of ones: ``w @ [v, 1]`` gives the weighted
    sum and the sum of the weights in one product."""
    return ops.concatenate([v, ops.ones_like(v[..., :1])], axis=-1)


def normalized_kernel_weights(similarity, mask=None, epsilon=DEFAULT_EPSILON):
    """Rows of non-negative similarities divided by their (safe) sums.

    Args:
        similarity: ``phi(q) . phi(k)``, non-negative, any shape whose last
            axis is the keys.
        mask: optional boolean, broadcastable to ``similarity``; masked
            entries get weight exactly 0.
        epsilon: smallest divisor.

    Returns:
        float32 weights of the shape of ``similarity``; each row sums to 1,
        or to less where its sum is below ``epsilon`` (0 for an all-zero
        row).
    """
    similarity = ops.cast(similarity, "float32")
    if mask is not None:
        similarity = ops.where(
            ops.cast(mask, "bool"), similarity, ops.zeros_like(similarity)
        )
    den = ops.sum(similarity, axis=-1, keepdims=True)
    return similarity / safe_denominator(den, epsilon)


def kernel_attention_reference(
    query_features,
    key_features,
    value,
    key_mask=None,
    epsilon=DEFAULT_EPSILON,
    return_weights=False,
    mask=None,
):
    """The explicit quadratic form of :func:`kernel_attention`.

    Materialises the ``(B, H, T, S)`` weights ``phi(q_i) . phi(k_j)``,
    normalises each row with :func:`normalized_kernel_weights` and takes
    the weighted sum of the values. O(T * S) memory: the specification.

    Args:
        query_features: non-negative ``(B, T, H, F)``.
        key_features: non-negative ``(B, S, H, F)``.
        value: ``(B, S, H, dv)``.
        key_mask: optional boolean ``(B, S)`` or ``(B, S, H)``.
        epsilon: smallest divisor.
        return_weights: also return the float32 weights.
        mask: optional boolean broadcastable to ``(B, H, T, S)`` (e.g. a
            causal or dense attention mask): False pairs get weight 0.

    Returns:
        ``(B, T, H, dv)`` in the dtype of ``value`` (and the weights).
    """
    dtype = value.dtype
    qf = ops.cast(query_features, "float32")
    kf = ops.cast(key_features, "float32")
    v = ops.cast(value, "float32")
    kf, v = _masked_keys(kf, v, key_mask)
    similarity = ops.einsum("bthf,bshf->bhts", qf, kf)
    weights = normalized_kernel_weights(similarity, mask=mask, epsilon=epsilon)
    out = ops.cast(ops.einsum("bhts,bshv->bthv", weights, v), dtype)
    if return_weights:
        return out, weights
    return out


def causal_kernel_attention(
    query_features,
    key_features,
    value,
    key_mask=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
    epsilon=DEFAULT_EPSILON,
    initial_state=None,
    return_state=False,
):
    """Causal kernelized attention by chunked prefix sums.

    ``out_i = phi(q_i)^T S_i / max(phi(q_i)^T z_i, epsilon)`` with
    ``S_i = sum_{j<=i} phi(k_j) v_j^T`` and ``z_i = sum_{j<=i} phi(k_j)``
    (query ``i`` sees keys ``j <= i``, top-left aligned when ``T != S``).
    Positions are cut into chunks of ``C = chunk_size``; within a chunk the
    ``(C, C)`` weights ``phi(q_i) . phi(k_j)`` are formed and masked to
    ``j <= i``; the earlier chunks reach a query through an exclusive
    prefix sum over the chunks' ``(F, dv)`` summaries. Everything is
    accumulated in float32.

    Time O(L * (C * (F + dv) + F * dv)) and memory O(L * C + (L / C) * F *
    dv) per head, ``L = max(T, S)``: never an ``(L, F, dv)`` tensor.

    Args:
        query_features: non-negative ``(B, T, H, F)``.
        key_features: non-negative ``(B, S, H, F)``.
        value: ``(B, S, H, dv)``.
        key_mask: optional boolean ``(B, S)`` or ``(B, S, H)``.
        chunk_size: positions per chunk (>= 1); capped at ``max(L, 1)``
            when the lengths are static.
        epsilon: smallest divisor.
        initial_state: optional float32 ``(B, H, F, dv + 1)``: the sums
            ``[S | z]`` of keys before these (a decoding state), which every
            query also sees.
        return_state: also return the state after these keys
            (``initial_state`` plus their sums).

    Returns:
        ``(B, T, H, dv)`` in the dtype of ``value`` (and the state).
    """
    chunk_size = check_chunk_size(chunk_size)
    dtype = value.dtype
    qf = ops.cast(query_features, "float32")
    kf = ops.cast(key_features, "float32")
    v = ops.cast(value, "float32")
    kf, v = _masked_keys(kf, v, key_mask)
    B, T, H, F = dims(qf)
    S = length(kf, 1)
    dv = v.shape[-1]
    L = larger(T, S)
    C = max(1, min(chunk_size, L)) if is_static(L) else chunk_size
    N = ceil_div(L, C)
    padded = N * C
    # Head-major chunks; the ones column of the values carries the
    # normaliser through every product. Padded keys have zero features:
    # they add nothing.
    def chunks(x):
        x = ops.transpose(pad_axis(x, 1, padded), (0, 2, 1, 3))
        return ops.reshape(x, (B, H, N, C, x.shape[-1]))

    q, k, v1 = chunks(qf), chunks(kf), chunks(_with_ones(v))
    # Within each chunk: explicit (C, C) weights, lower triangle.
    positions = ops.arange(C)
    lower = ops.cast(
        ops.less_equal(positions[None, :], positions[:, None]), "float32"
    )  # (C, C)
    weights = ops.matmul(q, ops.swapaxes(k, -1, -2)) * lower  # (B, H, N, C, C)
    out = ops.matmul(weights, v1)  # (B, H, N, C, dv + 1)
    # Earlier chunks: chunk c reads the inclusive prefix sum of the
    # summaries of chunks 0..c-1 (chunk 0 reads nothing, or the initial
    # state); without a state to return only N - 1 prefixes are formed.
    if initial_state is None and not return_state:
        summary = ops.matmul(ops.swapaxes(k[:, :, :-1], -1, -2), v1[:, :, :-1])
        summary = ops.cumsum(summary, axis=2)  # (B, H, N - 1, F, dv + 1)
        past = ops.matmul(q[:, :, 1:], summary)  # (B, H, N - 1, C, dv + 1)
        out = out + ops.concatenate([ops.zeros_like(out[:, :, :1]), past], axis=2)
        state = None
    else:
        summary = ops.cumsum(ops.matmul(ops.swapaxes(k, -1, -2), v1), axis=2)  # (B, H, N, F, dv+1)
        state = summary[:, :, -1]
        before = ops.concatenate([ops.zeros_like(summary[:, :, :1]), summary[:, :, :-1]], axis=2)
        if initial_state is not None:
            initial = ops.cast(initial_state, "float32")
            before = before + initial[:, :, None]
            state = state + initial
        out = out + ops.matmul(q, before)
    out = out[..., :dv] / safe_denominator(out[..., dv:], epsilon)
    out = ops.transpose(ops.reshape(out, (B, H, padded, dv)), (0, 2, 1, 3))[:, :T]
    if return_state:
        return ops.cast(out, dtype), state
    return ops.cast(out, dtype)


def associative_attention(
    query_features,
    key_features,
    value,
    causal=False,
    key_mask=None,
    chunk_size=DEFAULT_CHUNK_SIZE,
    epsilon=DEFAULT_EPSILON,
):
    """Kernelized attention in linear time, either mode:
    :func:`causal_kernel_attention` when ``causal``, else
    :func:`kernel_attention` (same arguments; ``chunk_size`` is used only
    when causal)."""
    if causal:
        return causal_kernel_attention(
            query_features, key_features, value, key_mask=key_mask,
            chunk_size=chunk_size, epsilon=epsilon,
        )
    return kernel_attention(
        query_features, key_features, value, key_mask=key_mask, epsilon=epsilon
    )
