"""Routing (clustered) attention: k-means routing of queries and keys and
attention inside the clusters, on ``keras.ops`` only.

Routing Transformer (Roy et al. 2021): queries and keys are normalised onto
the unit sphere, compared with ``k`` centroids per head, and attention is
restricted to the members of a cluster. Two ways of forming clusters live
here:

* **balanced** (:func:`balanced_assignment`, :func:`balanced_cluster_attention`):
  each centroid takes its ``w`` most similar queries and its ``w`` most
  similar keys (top-w over the sequence), as in the authors' code. Every
  cluster is a dense ``w x w`` block; a query chosen by several centroids
  gets the mean of its outputs over the clusters in which it sees at least
  one key, a query chosen by none (or seeing no key) gets zeros.
  Membership of a token depends on every other token of the sequence
  (later ones included), so this is not strictly causal.
* **token** (:func:`nearest_centroid`, :func:`clustered_window_attention`):
  each query and each key joins its nearest centroid (the k-means
  assignment, which depends on the token alone). Inside a cluster, its
  queries and keys are laid out in position order (a key before the query
  of the same position) and cut into chunks of ``w`` members; a query
  attends to the keys of its own and of the previous chunk that are not
  after it. Everything a query sees is decided by tokens at or before it:
  strictly causal. Chunks are aligned per cluster in a buffer of static
  size, so the computation is dense ``w x 2w`` blocks.

Both cost O(n * k * d) for routing and O(n * w * d) = O(n^2 * d / k) for
attention; nothing of size ``n^2`` is built. The ``*_weights`` /
``*_mask`` functions build the same attention as dense ``(B, H, T, S)``
tensors (O(n^2), for the reference path and tests only).

Shape legend: B batch, T query length, S key length, n a sequence length,
H heads, d head size, dv value head size, k clusters, w window (members of a
cluster or of a chunk).
"""

import functools
import math

import keras
import numpy as np
from keras import ops

from keras_longattn.ops.blocked import fused_dot_product_attention
from keras_longattn.ops.reference import masked_softmax

#: Similarity given to padded tokens before the top-w selection (cosine
#: similarities lie in [-1, 1]), so that they are chosen only when a
#: cluster has no real token left, always in the same (index) order.
EXCLUDED_SIMILARITY = -1e9


def backend_jit(static_argnames=()):
    """Decorator: on the JAX backend, runs the function as one compiled
    program (per shapes and static arguments); on torch, keeps it out of
    ``torch.compile``.

    Eager JAX compiles every primitive separately the first time it meets a
    shape, which makes a first eager call of a routing kernel take many
    seconds; inside ``jit`` (``fit``, ``predict``) the nested compilation is
    simply inlined. A call with a ``dropout_fn`` (stateful randomness) and
    TensorFlow run the plain function. On torch the function is wrapped in
    ``torch.compiler.disable``: in a model compiled by Keras
    (``jit_compile=True``) it runs eagerly between the compiled parts.
    TorchInductor 2.13 emits C++ that does not compile for some of these
    kernels (mixed integer and float vector masks), and the torch path of
    token routing uses data-dependent shapes. Results are identical.
    """

    def decorate(fn):
        compiled = {}

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if keras.backend.backend() == "torch":
                import torch

                if not torch.compiler.is_compiling():
                    return fn(*args, **kwargs)  # eager: no wrapper cost
                if "torch" not in compiled:
                    compiled["torch"] = torch.compiler.disable(fn)
                return compiled["torch"](*args, **kwargs)
            if (
                keras.backend.backend() != "jax"
                or kwargs.get("dropout_fn") is not None
            ):
                return fn(*args, **kwargs)
            if "fn" not in compiled:
                import jax

                compiled["fn"] = jax.jit(fn, static_argnames=static_argnames)
            return compiled["fn"](*args, **kwargs)

        wrapper.uncompiled = fn
        return wrapper

    return decorate


def segment_sum(data, segment_ids, num_segments):
    """``keras.ops.segment_sum`` over the first axis, with a fast torch path.

    Keras's torch ``segment_sum`` repeats the ids to the full shape of
    ``data`` and masks them twice before a ``scatter_reduce``; ``index_add``
    does the same sum (with its gradient) several times faster. Ids must lie
    in ``[0, num_segments)``.
    """
    if keras.backend.backend() == "torch":
        import torch

        data = ops.convert_to_tensor(data)
        ids = ops.convert_to_tensor(segment_ids).to(torch.int64)
        out = torch.zeros(
            (int(num_segments),) + tuple(data.shape[1:]),
            dtype=data.dtype,
            device=data.device,
        )
        return out.index_add(0, ids, data)
    return ops.segment_sum(data, segment_ids, num_segments=num_segments)


# ---------------------------------------------------------------- geometry
@backend_jit(("epsilon",))
def sphere_normalize(x, epsilon=1e-6):
    """Projects vectors onto the unit sphere as the authors' code does.

    Layer normalisation without scale or bias over the last axis (the
    authors' ``layer_norm(x, scaling=False)``, epsilon 1e-6), divided by
    ``sqrt(d)`` so that the result has unit length (the authors' vectors have
    length ``sqrt(d)``; the constant changes no assignment). Computed in
    float32 whatever the input dtype. A constant vector (e.g. a zero padded
    token) maps to zeros.

    Args:
        x: ``(..., d)``.
        epsilon: added to the variance.

    Returns:
        float32 tensor like ``x``.
    """
    x = ops.cast(x, "float32")
    d = x.shape[-1]
    centered = x - ops.mean(x, axis=-1, keepdims=True)
    var = ops.mean(ops.square(centered), axis=-1, keepdims=True)
    return centered * ops.rsqrt(var + epsilon) * (1.0 / math.sqrt(float(d)))


def l2_normalize(x, epsilon=1e-6):
    """``x / max(||x||, epsilon)`` over the last axis, in float32."""
    x = ops.cast(x, "float32")
    norm = ops.sqrt(ops.sum(ops.square(x), axis=-1, keepdims=True))
    return x / ops.maximum(norm, epsilon)


@backend_jit(("clusters_last",))
def centroid_similarity(x_hat, centroids, clusters_last=False):
    """Cosine similarity of normalised tokens with each centroid.

    Args:
        x_hat: ``(B, n, H, d)`` normalised tokens (:func:`sphere_normalize`).
        centroids: ``(H, k, d)``; normalised to unit length here.
        clusters_last: return ``(B, H, n, k)`` (the layout in which
            :func:`nearest_centroid` takes a contiguous argmax) instead of
            ``(B, H, k, n)`` (the layout of the top-w choice).

    Returns:
        float32 ``(B, H, k, n)``, or ``(B, H, n, k)`` with ``clusters_last``.
    """
    mu = l2_normalize(centroids)
    spec = "bnhd,hkd->bhnk" if clusters_last else "bnhd,hkd->bhkn"
    return ops.einsum(spec, ops.cast(x_hat, "float32"), mu)


# ------------------------------------------------------------- assignment
@backend_jit(("clusters_last",))
def nearest_centroid(similarity, valid=None, clusters_last=False):
    """The k-means assignment: the most similar centroid of every token.

    Args:
        similarity: ``(B, H, k, n)`` from :func:`centroid_similarity`, or
            ``(B, H, n, k)`` with ``clusters_last`` (several times faster
            on the torch backend: the argmax runs over a contiguous axis).
        valid: optional boolean ``(B, n)``; False marks padding.
        clusters_last: the layout of ``similarity``.

    Returns:
        int32 ``(B, H, n)`` in ``[0, k)``; padded tokens get ``k`` (no
        cluster).
    """
    if not clusters_last:
        similarity = ops.transpose(similarity, (0, 1, 3, 2))
    k = similarity.shape[3]
    idx = ops.cast(ops.argmax(similarity, axis=-1), "int32")
    if valid is not None:
        valid = ops.cast(valid, "bool")[:, None, :]
        idx = ops.where(valid, idx, ops.full_like(idx, k))
    return idx


@backend_jit(("window", "clusters_last"))
def balanced_assignment(similarity, window, valid=None, clusters_last=False):
    """Balanced routing: each centroid takes its ``window`` most similar
    tokens (the authors' top-w), returned sorted by position.

    Padded tokens are ranked below every real token with a constant
    similarity, so their content never changes which real tokens are chosen.

    Args:
        similarity: ``(B, H, k, n)``, or ``(B, H, n, k)`` with
            ``clusters_last`` (the layout :func:`nearest_centroid` prefers:
            one similarity tensor serves both).
        window: members per cluster, ``1 <= window <= n``.
        valid: optional boolean ``(B, n)``; False marks padding.
        clusters_last: the layout of ``similarity``.

    Returns:
        int32 ``(B, H, k, window)`` token positions, ascending in each
        cluster.
    """
    token_axis = 2 if clusters_last else 3
    n = similarity.shape[token_axis]
    window = int(window)
    if not 1 <= window <= n:
        raise ValueError(
            f"`window` must be in [1, {n}] for a sequence of length {n}. "
            f"Received: window={window}"
        )
    if valid is not None:
        valid = ops.cast(valid, "bool")[:, None, :]
        valid = valid[..., None] if clusters_last else valid[:, :, None, :]
        similarity = ops.where(valid, similarity, EXCLUDED_SIMILARITY)
    if clusters_last and keras.backend.backend() == "torch":
        import torch

        # Top-w over the token axis in place (no transposed copy).
        idx = torch.topk(similarity, window, dim=2, sorted=False).indices
        idx = idx.transpose(2, 3)
    else:
        if clusters_last:
            similarity = ops.transpose(similarity, (0, 1, 3, 2))
        _, idx = ops.top_k(similarity, window)
    return ops.sort(ops.cast(idx, "int32"), axis=-1)


# --------------------------------------------------------- gather/scatter
def _flat_token_ids(indices, batch, H, n, heads_last):
    """Row of each (example, head, position) in the flattened tokens:
    ``(B * H * n)`` rows of a ``(B, H, n, .)`` tensor, or of a
    ``(B, n, H, .)`` one with ``heads_last``."""
    shape = tuple(indices.shape)
    tail = (1,) * (len(shape) - 2)
    indices = ops.cast(indices, "int32")
    if heads_last:
        b = ops.reshape(ops.arange(batch, dtype="int32") * (n * H), (-1, 1) + tail)
        h = ops.reshape(ops.arange(H, dtype="int32"), (1, H) + tail)
        return ops.reshape(indices * H + b + h, (-1,))
    base = ops.reshape(ops.arange(batch * H, dtype="int32") * n, (-1, H) + tail)
    return ops.reshape(indices + base, (-1,))


def take_rows(x, rows):
    """``x[rows]`` for a 2-D ``x`` and int ``rows`` ``(N,)``.

    On torch this is ``index_select``, whose gradient is one ``index_add``;
    ``keras.ops.take`` runs an embedding lookup there, whose gradient
    (``embedding_dense_backward``) is about 4x slower on the CPU.
    """
    if keras.backend.backend() == "torch":
        import torch

        x = ops.convert_to_tensor(x)
        rows = ops.convert_to_tensor(rows).to(torch.int64)
        return torch.index_select(x, 0, rows)
    return ops.take(x, rows, axis=0)


def gather_tokens(x, indices, heads_last=False):
    """Gathers token vectors per head.

    Args:
        x: ``(B, H, n, d)``, or ``(B, n, H, d)`` with ``heads_last`` (the
            layers' layout: no transpose needed).
        indices: int ``(B, H, ...)`` positions in ``[0, n)``.
        heads_last: the layout of ``x``.

    Returns:
        ``(B, H, ..., d)``.
    """
    shape = tuple(indices.shape)
    H = shape[1]
    n = x.shape[1] if heads_last else x.shape[2]
    d = x.shape[3]
    # One row gather from the flattened tokens: a plain take/embedding
    # lookup on every backend, whose gradient is an indexed add
    # (take_along_axis broadcasts its indices to (..., d) instead).
    flat = _flat_token_ids(indices, ops.shape(x)[0], H, n, heads_last)
    out = take_rows(ops.reshape(x, (-1, d)), flat)
    return ops.reshape(out, (-1,) + shape[1:] + (d,))


def gather_flags(x, indices):
    """Gathers per-token scalars: ``x`` ``(B or 1, H or 1, n)``, ``indices``
    ``(B, H, ...)`` -> ``(B, H, ...)`` (int32)."""
    shape = tuple(indices.shape)
    flat = ops.reshape(indices, (-1, shape[1], _prod(shape[2:])))
    x = ops.cast(x, "int32")
    if x.shape[1] == 1 and shape[1] != 1:
        x = ops.repeat(x, shape[1], axis=1)
    if x.shape[0] == 1:
        x = ops.broadcast_to(x, (ops.shape(flat)[0],) + tuple(x.shape[1:]))
    out = ops.take_along_axis(x, flat, axis=2)
    return ops.reshape(out, (-1,) + shape[1:])


def _scatter_means(values, indices, length, weights, heads_last):
    """Sums of the rows sent to each position over the weights sent there:
    ``(mean, counts)`` with ``mean`` ``(B, H, length, dv)`` (or
    ``(B, length, H, dv)`` with ``heads_last``) in the dtype of ``values``
    and float32 ``counts`` flat ``(B * H * length,)``."""
    H = values.shape[1]
    dv = values.shape[-1]
    batch = _dim(values, 0)
    ids = _flat_token_ids(indices, batch, H, length, heads_last)
    num = batch * H * length
    sums = segment_sum(
        ops.cast(ops.reshape(values, (-1, dv)), "float32"), ids, num_segments=num
    )
    if weights is None:
        weights = ops.ones_like(ids, dtype="float32")
    counts = segment_sum(
        ops.reshape(ops.cast(weights, "float32"), (-1,)), ids, num_segments=num
    )
    mean = ops.cast(sums / ops.maximum(counts, 1.0)[:, None], values.dtype)
    shape = (-1, length, H, dv) if heads_last else (-1, H, length, dv)
    return ops.reshape(mean, shape), counts


def scatter_sum_mean(values, indices, length, weights=None, heads_last=False):
    """Like :func:`scatter_mean`, counting only the rows where ``weights``
    (boolean ``(B, H, k, w)``, None for all) is True; rows with weight False
    must hold zeros. Returns the mean only: ``(B, H, length, dv)``, or
    ``(B, length, H, dv)`` with ``heads_last``."""
    return _scatter_means(values, indices, length, weights, heads_last)[0]


@backend_jit(("length",))
def scatter_mean(values, indices, length):
    """Mean of the values sent to each position; zeros where none is sent.

    Args:
        values: ``(B, H, k, w, dv)`` (one row per cluster member).
        indices: int ``(B, H, k, w)`` positions in ``[0, length)``.
        length: the sequence length.

    Returns:
        ``(B, H, length, dv)`` in the dtype of ``values``, and the float32
        counts ``(B, H, length)``.
    """
    mean, counts = _scatter_means(values, indices, length, None, False)
    return mean, ops.reshape(counts, (-1, values.shape[1], length))


# ------------------------------------------------------------- statistics
@backend_jit(("num_clusters",))
def cluster_statistics(x_hat, assignment, num_clusters):
    """Per-head sums and counts of the tokens assigned to each centroid,
    over the batch (segment sums; padded tokens, marked ``num_clusters``,
    are dropped).

    Args:
        x_hat: ``(B, n, H, d)`` normalised tokens.
        assignment: int ``(B, H, n)`` in ``[0, num_clusters]``.
        num_clusters: k.

    Returns:
        float32 sums ``(H, k, d)`` and counts ``(H, k)``.
    """
    H, d = x_hat.shape[2], x_hat.shape[3]
    k = int(num_clusters)
    # Ids in the (B, n, H) order of the tokens: no transposed copy of x_hat.
    head = ops.reshape(ops.arange(H, dtype="int32") * (k + 1), (1, 1, H))
    assignment = ops.transpose(ops.cast(assignment, "int32"), (0, 2, 1))
    ids = ops.reshape(assignment + head, (-1,))
    sums = segment_sum(ops.reshape(ops.cast(x_hat, "float32"), (-1, d)), ids, H * (k + 1))
    counts = segment_sum(
        ops.ones_like(ids, dtype="float32"), ids, num_segments=H * (k + 1)
    )
    sums = ops.reshape(sums, (H, k + 1, d))[:, :k]
    counts = ops.reshape(counts, (H, k + 1))[:, :k]
    return sums, counts


def segment_means(sums, counts):
    """``sums / counts`` with zeros for empty clusters."""
    return sums / ops.maximum(counts, 1.0)[..., None]


@backend_jit(("decay",))
def ema_update(centroids, sums, counts, decay):
    """One mini-batch k-means step by exponential moving average.

    ``mu <- decay * mu + (1 - decay) * mean(assigned)`` for every centroid
    that was assigned at least one token; empty centroids do not move. The
    result carries no gradient.

    Args:
        centroids: ``(H, k, d)``.
        sums, counts: from :func:`cluster_statistics`.
        decay: in ``(0, 1)``.

    Returns:
        float32 ``(H, k, d)``.
    """
    centroids = ops.cast(centroids, "float32")
    means = segment_means(sums, counts)
    moved = decay * centroids + (1.0 - decay) * means
    new = ops.where(ops.greater(counts, 0.0)[..., None], moved, centroids)
    return ops.stop_gradient(new)


# ------------------------------------------------- balanced cluster blocks
@backend_jit(("causal", "exclude_self", "scale", "dropout_fn", "fused"))
def balanced_cluster_attention(
    query,
    key,
    value,
    query_indices,
    key_indices,
    causal=False,
    key_mask=None,
    exclude_self=False,
    scale=None,
    dropout_fn=None,
    fused=False,
):
    """Dense attention inside each balanced cluster, averaged per query.

    Cluster ``c`` holds the queries ``query_indices[..., c, :]`` and the keys
    ``key_indices[..., c, :]``; each of its queries attends to its keys
    (padding and, when ``causal``, later positions masked by comparing the
    gathered positions). A query in several clusters gets the mean of its
    outputs over the clusters in which it sees at least one key; a query in
    none (or seeing no key) gets zeros. O(k * w^2) per head.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        query_indices: int ``(B, H, k, wq)``, ascending per cluster.
        key_indices: int ``(B, H, k, wk)``, ascending per cluster.
        causal: mask keys after the query.
        key_mask: optional boolean ``(B, S)``; False marks padded keys.
        exclude_self: a query does not attend to the key at its own
            position unless no other key is visible (shared query/key).
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights.
        fused: compute the clusters with ``keras.ops.dot_product_attention``
            (each cluster one batch item; PyTorch's fused
            ``scaled_dot_product_attention``) instead of explicit einsums.
            Ignored with ``dropout_fn``. Same result.

    Returns:
        ``(B, T, H, dv)``.
    """
    T = query.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    qg = gather_tokens(query, query_indices, heads_last=True)  # (B, H, k, wq, d)
    kg = gather_tokens(key, key_indices, heads_last=True)  # (B, H, k, wk, d)
    vg = gather_tokens(value, key_indices, heads_last=True)  # (B, H, k, wk, dv)
    q_pos = query_indices[..., :, None]
    k_pos = key_indices[..., None, :]
    mask = None
    if key_mask is not None:
        kv = gather_flags(ops.expand_dims(key_mask, 1), key_indices) > 0
        mask = kv[..., None, :]
    if causal:
        mask = _and(mask, ops.less_equal(k_pos, q_pos))
    if exclude_self:
        mask = exclude_self_unless_alone(mask, ops.equal(k_pos, q_pos))
    out, seen = _cluster_blocks(qg, kg, vg, mask, scale, dropout_fn, fused)
    # A query's output is the mean over the clusters in which it sees a key.
    return scatter_sum_mean(out, query_indices, T, weights=seen, heads_last=True)


def _cluster_blocks(qg, kg, vg, mask, scale, dropout_fn=None, fused=False):
    """Dense attention inside every block of ``(B, H, G, w, .)`` layouts.

    ``qg`` ``(B, H, G, wq, d)``, ``kg``/``vg`` ``(B, H, G, wk, d|dv)``,
    ``mask`` broadcastable to ``(B, H, G, wq, wk)`` or None. With ``fused``
    (and no ``dropout_fn``) through :func:`_fused_cluster_blocks`, else
    with explicit einsums and a masked softmax. Returns the outputs
    ``(B, H, G, wq, dv)`` (zeros where a query sees no key) and the boolean
    ``(B, H, G, wq)`` of the queries that see a key (None without a mask).
    """
    if fused and dropout_fn is None:
        return _fused_cluster_blocks(qg, kg, vg, mask, scale)
    qg = ops.multiply(qg, ops.cast(scale, qg.dtype))
    scores = ops.einsum("bhgqd,bhgkd->bhgqk", qg, kg)
    probs = masked_softmax(scores, mask, axis=-1)
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    out = ops.einsum("bhgqk,bhgkd->bhgqd", probs, vg)
    if mask is None:
        return out, None
    return out, ops.any(ops.broadcast_to(mask, ops.shape(scores)), axis=-1)


def _fused_cluster_blocks(qg, kg, vg, mask, scale):
    """Each cluster as one item of a batched ``dot_product_attention``.

    ``qg`` ``(B, H, k, wq, d)``, ``kg``/``vg`` ``(B, H, k, wk, d|dv)``,
    ``mask`` broadcastable to ``(B, H, k, wq, wk)`` or None. Returns the
    outputs ``(B, H, k, wq, dv)`` (zeros where a query sees no key) and the
    boolean ``(B, H, k, wq)`` of the queries that see a key (None without
    a mask)."""
    shape = tuple(ops.shape(qg))
    wq, d = qg.shape[3], qg.shape[4]
    wk, dv = kg.shape[3], vg.shape[4]
    # (B*H*k, w, 1, d): reshapes only, one attention "head" per cluster.
    qf = ops.reshape(qg, (-1, wq, 1, d))
    kf = ops.reshape(kg, (-1, wk, 1, d))
    vf = ops.reshape(vg, (-1, wk, 1, dv))
    if mask is None:
        out = fused_dot_product_attention(qf, kf, vf, scale=scale)
        return ops.reshape(out, shape[:4] + (dv,)), None
    mask = ops.broadcast_to(mask, shape[:4] + (wk,))
    out = fused_dot_product_attention(
        qf, kf, vf, mask=ops.reshape(mask, (-1, 1, wq, wk)), scale=scale
    )
    return ops.reshape(out, shape[:4] + (dv,)), ops.any(mask, axis=-1)


@backend_jit(("causal", "exclude_self", "scale"))
def balanced_cluster_weights(
    query,
    key,
    query_indices,
    key_indices,
    causal=False,
    key_mask=None,
    exclude_self=False,
    scale=None,
    extra_mask=None,
):
    """Dense ``(B, H, T, S)`` weights equal to :func:`balanced_cluster_attention`.

    For every cluster, a dense softmax over the whole ``(T, S)`` grid under
    the cluster's membership mask; the weights of a query are the mean over
    the clusters that hold it and in which it sees a key (zeros where there
    is none), so every row sums to 1 or to 0. O(k * T * S):
    the specification, not a fast path.

    Args:
        query, key, query_indices, key_indices, causal, key_mask,
        exclude_self, scale: as :func:`balanced_cluster_attention`.
        extra_mask: optional boolean mask broadcastable to ``(B, H, T, S)``
            (e.g. a dense ``attention_mask``), ANDed into every cluster.

    Returns:
        float32 weights ``(B, H, T, S)``.
    """
    T, S = query.shape[1], key.shape[1]
    num_clusters = query_indices.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    scores = ops.einsum("bthd,bshd->bhts", query, key)
    q_member = membership(query_indices, T)  # (B, H, k, T)
    k_member = membership(key_indices, S)  # (B, H, k, S)
    base = extra_mask
    if key_mask is not None:
        base = _and(base, ops.cast(key_mask, "bool")[:, None, None, :])
    q_pos = ops.arange(T, dtype="int32")[:, None]
    k_pos = ops.arange(S, dtype="int32")[None, :]
    if causal:
        base = _and(base, ops.less_equal(k_pos, q_pos)[None, None])
    total = None
    counts = None
    for c in range(num_clusters):
        mask = ops.logical_and(
            q_member[:, :, c, :, None], k_member[:, :, c, None, :]
        )
        mask = _and(mask, base)
        if exclude_self:
            mask = exclude_self_unless_alone(
                mask, ops.equal(k_pos, q_pos)[None, None]
            )
        probs = ops.cast(masked_softmax(scores, mask, axis=-1), "float32")
        seen = ops.cast(ops.any(mask, axis=-1), "float32")  # (B, H, T)
        total = probs if total is None else total + probs
        counts = seen if counts is None else counts + seen
    # Mean over the clusters in which the query sees at least one key.
    return total / ops.maximum(counts, 1.0)[..., None]


def membership(indices, length):
    """Boolean ``(B, H, k, length)``: position ``i`` is in cluster ``c``.
    O(k * w * length)."""
    hits = ops.equal(indices[..., None], ops.arange(length, dtype="int32"))
    return ops.any(hits, axis=-2)


# ---------------------------------------------------- token routing blocks
def cluster_window_layout(item_clusters, item_keys, num_clusters, window):
    """Lays the items of each cluster out in chunk-aligned slots.

    Items (queries and/or keys) are sorted by ``item_keys`` (cluster first,
    then position); cluster ``c`` gets ``ceil(n_c / window)`` whole chunks of
    ``window`` slots, so that a chunk never mixes clusters. Items of cluster
    ``num_clusters`` (padding) get no slot. The buffer has a static size of
    ``(ceil(N / window) + num_clusters) * window`` slots.

    Args:
        item_clusters: int ``(B, H, N)`` in ``[0, num_clusters]``.
        item_keys: int ``(B, H, N)`` unique sort keys, increasing with the
            cluster.
        num_clusters: k.
        window: chunk size.

    Returns:
        A dict with int32 ``source`` ``(B, H, L)`` (item of each slot),
        boolean ``filled`` ``(B, H, L)``, int32 ``cluster`` ``(B, H, L)``
        (-1 for empty slots), int32 ``slot`` ``(B, H, N)`` (slot of each
        item, clipped) and boolean ``placed`` ``(B, H, N)``.
    """
    k = int(num_clusters)
    w = int(window)
    N = item_clusters.shape[-1]
    item_clusters = ops.cast(item_clusters, "int32")
    order = ops.cast(ops.argsort(item_keys, axis=-1), "int32")  # (B, H, N)
    sorted_clusters = ops.take_along_axis(item_clusters, order, axis=-1)
    counts = _row_bincount(item_clusters, k)  # (B, H, k)
    start = ops.cumsum(counts, axis=-1) - counts
    chunks = (counts + (w - 1)) // w
    base = ops.cumsum(chunks, axis=-1) - chunks  # first chunk of each cluster
    num_chunks = -(-N // w) + k
    g = ops.arange(num_chunks, dtype="int32")
    # Cluster owning chunk g: the last cluster whose first chunk is <= g.
    chunk_cluster = (
        ops.sum(ops.cast(ops.less_equal(base[..., None, :], g[:, None]), "int32"), axis=-1)
        - 1
    )  # (B, H, G)
    chunk_base = ops.take_along_axis(base, chunk_cluster, axis=-1)
    offsets = ops.arange(w, dtype="int32")
    rank = (g - chunk_base)[..., None] * w + offsets  # (B, H, G, w)
    cluster = ops.repeat(chunk_cluster[..., None], w, axis=-1)
    H = item_clusters.shape[1]
    rank = ops.reshape(rank, (-1, H, num_chunks * w))
    cluster = ops.reshape(cluster, (-1, H, num_chunks * w))
    filled = ops.less(rank, ops.take_along_axis(counts, cluster, axis=-1))
    sorted_index = ops.clip(
        ops.take_along_axis(start, cluster, axis=-1) + rank, 0, N - 1
    )
    source = ops.take_along_axis(order, sorted_index, axis=-1)
    cluster = ops.where(filled, cluster, -1)
    # Slot of every item (inverse of the layout).
    safe = ops.minimum(sorted_clusters, k - 1)
    sorted_rank = ops.arange(N, dtype="int32") - ops.take_along_axis(start, safe, axis=-1)
    slot_sorted = ops.take_along_axis(base, safe, axis=-1) * w + sorted_rank
    inverse = ops.cast(ops.argsort(order, axis=-1), "int32")
    slot = ops.take_along_axis(slot_sorted, inverse, axis=-1)
    placed = ops.less(item_clusters, k)
    slot = ops.where(placed, ops.clip(slot, 0, num_chunks * w - 1), 0)
    return {
        "source": source,
        "filled": filled,
        "cluster": cluster,
        "slot": slot,
        "placed": placed,
    }


@backend_jit(("num_clusters", "window", "shared", "scale", "dropout_fn", "fused"))
def clustered_window_attention(
    query,
    key,
    value,
    query_clusters,
    key_clusters,
    num_clusters,
    window,
    shared=False,
    scale=None,
    dropout_fn=None,
    fused=False,
):
    """Strictly causal attention inside nearest-centroid clusters.

    Each query and each key belongs to the cluster in ``query_clusters`` /
    ``key_clusters`` (``num_clusters`` marks padding: such a key is never
    seen, such a query gets zeros). Inside a cluster, queries and keys are
    ordered by position (the key of a position before its query) and cut into
    chunks of ``window`` members; a query attends to the keys of its own and
    of the previous chunk whose position is not after its own. Which keys a
    query sees depends only on tokens at or before it. With ``shared=True``
    (shared query/key, ``T == S``) every token is one member, both query and
    key, and does not attend to itself unless nothing else is visible.
    Computed as dense ``window x 2 window`` blocks over a chunk-aligned
    buffer: O(n * window * d), no ``(T, S)`` tensor. The buffer holds up to
    ``N + k * window`` slots for ``N`` members (``N = T`` shared, ``T + S``
    otherwise), so about ``4 n w`` (shared) to ``6 n w`` scores are
    evaluated, against ``n w`` for balanced routing; the layout itself costs
    two sorts of ``N`` members and O(N * k) integer comparisons.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        query_clusters: int ``(B, H, T)`` in ``[0, num_clusters]``.
        key_clusters: int ``(B, H, S)`` in ``[0, num_clusters]`` (ignored
            when ``shared``).
        num_clusters: k.
        window: chunk size (members).
        shared: queries and keys are the same tokens.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights.
        fused: compute the chunks with ``keras.ops.dot_product_attention``
            (as :func:`balanced_cluster_attention`). Ignored with
            ``dropout_fn``.

    Returns:
        ``(B, T, H, dv)``.
    """
    T, S = query.shape[1], key.shape[1]
    H = query.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    w = int(window)
    query_clusters = ops.cast(query_clusters, "int32")
    if shared:
        if T != S:
            raise ValueError(
                "Shared query/key routing needs as many keys as queries. "
                f"Received: query length {T}, key length {S}"
            )
        item_clusters = query_clusters
        positions = ops.arange(T, dtype="int32")
        item_keys = item_clusters * T + positions
        layout = cluster_window_layout(item_clusters, item_keys, num_clusters, w)
        src = layout["source"]
        q_rows = k_rows = src  # every slot holds one token, query and key
        is_key = is_query = layout["filled"]
    else:
        key_clusters = ops.cast(key_clusters, "int32")
        P = max(T, S)
        item_clusters = ops.concatenate([query_clusters, key_clusters], axis=-1)
        q_pos = ops.arange(T, dtype="int32")
        k_pos = ops.arange(S, dtype="int32")
        positions = ops.concatenate([q_pos, k_pos], axis=0)
        kind = ops.concatenate(
            [ops.ones((T,), "int32"), ops.zeros((S,), "int32")], axis=0
        )  # 1 = query; a key sorts before the query of its position
        item_keys = item_clusters * (2 * P) + 2 * positions + kind
        layout = cluster_window_layout(item_clusters, item_keys, num_clusters, w)
        src = layout["source"]
        is_q_item = ops.less(src, T)
        q_rows = ops.clip(src, 0, T - 1)
        k_rows = ops.clip(src - T, 0, S - 1)
        is_key = ops.logical_and(layout["filled"], ops.logical_not(is_q_item))
        is_query = ops.logical_and(layout["filled"], is_q_item)
    L = src.shape[-1]
    G = L // w
    cluster = layout["cluster"]

    def blocks(x):
        return ops.reshape(x, (-1, H, G, w) + tuple(x.shape[3:]))

    def context(x, fill=0):
        # Each chunk preceded by the previous one: (B, H, G, 2w, ...).
        x = blocks(x)
        first = ops.full_like(x[:, :, :1], fill)
        prev = ops.concatenate([first, x[:, :, :-1]], axis=2)
        return ops.concatenate([prev, x], axis=3)

    # A chunk never mixes clusters, and inside a cluster the members are in
    # position order (a key before the query of its position). So a query
    # sees: every key of the previous chunk when that chunk belongs to the
    # same cluster, and the keys of its own chunk in earlier slots. That is
    # a per-column flag (is a key, and its chunk counts) AND a static
    # (w, 2w) layout, instead of comparing positions and clusters per pair.
    chunk_cluster = blocks(cluster)[..., 0]  # (B, H, G); -1: empty chunk
    prev_cluster = ops.concatenate(
        [ops.full_like(chunk_cluster[..., :1], -1), chunk_cluster[..., :-1]], axis=-1
    )
    same_prev = ops.logical_and(
        ops.equal(prev_cluster, chunk_cluster), ops.greater_equal(chunk_cluster, 0)
    )
    key_cols = context(is_key, fill=False)  # (B, H, G, 2w)
    col_ok = ops.logical_and(
        key_cols,
        ops.concatenate(
            [
                ops.repeat(same_prev[..., None], w, axis=-1),
                ops.ones_like(key_cols[..., w:]),
            ],
            axis=-1,
        ),
    )
    # Own half: earlier slots (and the slot itself when shared: a token is
    # both query and key; see the self rule below).
    own = np.tril(np.ones((w, w), bool), k=0 if shared else -1)
    band = np.concatenate([np.ones((w, w), bool), own], axis=1)  # (w, 2w)
    is_self = None
    if shared:
        is_self = np.concatenate([np.zeros((w, w), bool), np.eye(w, dtype=bool)], axis=1)
    slot = layout["slot"][..., :T]
    placed = layout["placed"][..., :T]
    if fused and dropout_fn is None:
        return _token_chunks_fused(
            query, key, value, q_rows, is_query, context(k_rows), col_ok, band,
            is_self, slot, placed, scale,
        )
    qb = blocks(gather_tokens(query, q_rows, heads_last=True))
    kb = context(gather_tokens(key, k_rows, heads_last=True))
    vb = context(gather_tokens(value, k_rows, heads_last=True))
    mask = _chunk_mask(col_ok[..., None, :], band, is_self)
    out, _ = _cluster_blocks(qb, kb, vb, mask, scale, dropout_fn)
    out = ops.reshape(out, (-1, H, L, out.shape[-1]))
    out = ops.take_along_axis(out, slot[..., None], axis=2)  # (B, H, T, dv)
    out = ops.where(placed[..., None], out, ops.zeros_like(out))
    return ops.transpose(out, (0, 2, 1, 3))


#: Most scores (elements of one ``(chunks, w, 2w)`` mask) that the torch
#: path of :func:`_token_chunks_fused` gives to one attention call. Keeping
#: every temporary of a call well under glibc's largest mmap threshold
#: (32 MiB) lets the allocator reuse memory between calls instead of
#: mapping and page-faulting fresh buffers, which cost more than the
#: attention itself at n = 16K on the CPU.
_TORCH_SCORES_PER_CALL = 1 << 22


def _chunk_mask(cols, band, is_self):
    """Mask of token-routing chunks: the static ``(w, 2w)`` ``band`` AND the
    column flags ``cols`` (``(..., 1, 2w)``), and with ``is_self`` (static
    ``(w, 2w)``, shared query/key) the self rule."""
    mask = ops.logical_and(ops.convert_to_tensor(band), cols)
    if is_self is None:
        return mask
    self_cols = ops.broadcast_to(ops.convert_to_tensor(is_self), ops.shape(mask))
    return exclude_self_unless_alone(mask, self_cols)


def _chunks_per_call(items, wq, wk):
    """How many ``(wq, wk)`` chunks one attention call of
    :func:`_token_chunks_fused` takes: all on JAX and TensorFlow (one
    compiled program), at most :data:`_TORCH_SCORES_PER_CALL` scores' worth
    on torch."""
    if keras.backend.backend() != "torch":
        return items
    return max(1, _TORCH_SCORES_PER_CALL // (wq * wk))


def _token_chunks_fused(
    query, key, value, q_rows, is_query, k_rows, col_ok, band, is_self, slot, placed,
    scale,
):
    """The chunks of :func:`clustered_window_attention` through
    :func:`~keras_longattn.ops.blocked.fused_dot_product_attention`.

    Gathers each chunk's queries ``(w)`` and context keys ``(2w)`` straight
    from the ``(B, n, H, d)`` tokens (no transposed copies, no concatenated
    context buffers). On torch (eager) it also drops the chunks that hold no
    query (the buffer is sized for the worst case: typically a sixth of its
    chunks are empty or hold keys only) and runs the others in slices of at
    most :data:`_TORCH_SCORES_PER_CALL` scores. Same result as the einsum
    path.

    Args:
        query, key, value: ``(B, T, H, d)``, ``(B, S, H, d)``, ``(B, S, H, dv)``.
        q_rows: int ``(B, H, L)`` query position of every slot.
        is_query: boolean ``(B, H, L)``: the slot holds a query.
        k_rows: int ``(B, H, G, 2w)`` key position of every context column.
        col_ok: boolean ``(B, H, G, 2w)`` columns that may be seen.
        band: static boolean ``(w, 2w)`` pattern; ``is_self`` static
            ``(w, 2w)`` self entries (shared query/key) or None.
        slot, placed: ``(B, H, T)`` slot of every query and whether it has one.

    Returns:
        ``(B, T, H, dv)``.
    """
    T, H, d = query.shape[1], query.shape[2], query.shape[3]
    S, dv = key.shape[1], value.shape[3]
    G, w2 = k_rows.shape[2], k_rows.shape[3]
    w = w2 // 2
    L = G * w
    batch = _dim(query, 0)
    q_ids = ops.reshape(_flat_token_ids(q_rows, batch, H, T, True), (-1, w))
    k_ids = ops.reshape(_flat_token_ids(k_rows, batch, H, S, True), (-1, w2))
    ok = ops.reshape(col_ok, (-1, 1, 1, w2))
    position = None  # compact index of each kept chunk (torch only)
    # Data-dependent shapes are fine on torch: clustered_window_attention is
    # kept out of torch.compile by backend_jit, so this always runs eagerly.
    if isinstance(batch, int) and keras.backend.backend() == "torch":
        has_query = ops.any(ops.reshape(is_query, (-1, w)), axis=-1)  # (I,)
        kept = ops.convert_to_tensor(has_query).nonzero()[:, 0]  # data-dependent size
        q_ids, k_ids, ok = q_ids[kept], k_ids[kept], ok[kept]
        position = ops.cumsum(ops.cast(has_query, "int32")) - 1
    q_flat = ops.reshape(query, (-1, d))
    k_flat = ops.reshape(key, (-1, d))
    v_flat = ops.reshape(value, (-1, dv))
    items = int(q_ids.shape[0]) if isinstance(batch, int) else None
    if items == 0:  # no query has a slot (all padding)
        return ops.zeros((batch, T, H, dv), dtype=value.dtype)
    per = None if items is None else _chunks_per_call(items, w, w2)
    bounds = [(None, None)] if per is None else [
        (i, min(i + per, items)) for i in range(0, items, per)
    ]
    outs = []
    for i0, i1 in bounds:
        qs = take_rows(q_flat, ops.reshape(q_ids[i0:i1], (-1,)))
        ks = take_rows(k_flat, ops.reshape(k_ids[i0:i1], (-1,)))
        vs = take_rows(v_flat, ops.reshape(k_ids[i0:i1], (-1,)))
        mask = _chunk_mask(ok[i0:i1], band, is_self)  # (m, 1, w, 2w)
        out = fused_dot_product_attention(
            ops.reshape(qs, (-1, w, 1, d)),
            ops.reshape(ks, (-1, w2, 1, d)),
            ops.reshape(vs, (-1, w2, 1, dv)),
            mask=mask,
            scale=scale,
        )
        outs.append(ops.reshape(out, (-1, dv)))
    out = outs[0] if len(outs) == 1 else ops.concatenate(outs, axis=0)
    # Slot rows are ordered (example, head, slot); read them back in the
    # (B, T, H) order of the tokens.
    base = ops.reshape(ops.arange(batch * H, dtype="int32") * L, (-1, H, 1))
    rows = ops.transpose(ops.cast(slot, "int32") + base, (0, 2, 1))
    if position is not None:
        # Rows of the kept chunks only (every placed query's chunk is kept;
        # an unplaced query reads row 0 and is zeroed below).
        rows = ops.take(position, rows // w) * w + rows % w
        rows = ops.maximum(rows, 0)
    out = ops.reshape(take_rows(out, ops.reshape(rows, (-1,))), (-1, T, H, dv))
    keep = ops.transpose(placed, (0, 2, 1))[..., None]
    return ops.where(keep, out, ops.zeros_like(out))


@backend_jit(("num_clusters", "window", "shared"))
def clustered_window_mask(query_clusters, key_clusters, num_clusters, window, shared=False):
    """Dense boolean ``(B, H, T, S)`` mask of :func:`clustered_window_attention`
    (without the self rule of ``shared``), from ranks counted densely.

    O(T * S): for the reference path and tests.
    """
    k = int(num_clusters)
    w = int(window)
    cq = ops.cast(query_clusters, "int32")
    T = cq.shape[-1]
    t_pos = ops.arange(T, dtype="int32")
    if shared:
        same = ops.equal(cq[..., :, None], cq[..., None, :])  # (B, H, T, T)
        before = ops.less(t_pos[None, :], t_pos[:, None])  # [i, j]: j < i
        rank_q = ops.sum(ops.cast(ops.logical_and(same, before), "int32"), axis=-1)
        rank_k = rank_q
        ck = cq
        S = T
    else:
        ck = ops.cast(key_clusters, "int32")
        S = ck.shape[-1]
        s_pos = ops.arange(S, dtype="int32")
        qq = ops.equal(cq[..., :, None], cq[..., None, :])  # (B, H, T, T)
        qk = ops.equal(cq[..., :, None], ck[..., None, :])  # (B, H, T, S)
        kk = ops.equal(ck[..., :, None], ck[..., None, :])  # (B, H, S, S)
        q_before_q = ops.less(t_pos[None, :], t_pos[:, None])  # [t, t']: t' < t
        k_upto_q = ops.less_equal(s_pos[None, :], t_pos[:, None])  # [t, j]: j <= t
        k_before_k = ops.less(s_pos[None, :], s_pos[:, None])  # [j, j']: j' < j
        q_before_k = ops.less(t_pos[None, :], s_pos[:, None])  # [j, t']: t' < j
        rank_q = ops.sum(ops.cast(ops.logical_and(qq, q_before_q), "int32"), axis=-1)
        rank_q = rank_q + ops.sum(ops.cast(ops.logical_and(qk, k_upto_q), "int32"), axis=-1)
        rank_k = ops.sum(ops.cast(ops.logical_and(kk, k_before_k), "int32"), axis=-1)
        kq = ops.transpose(qk, (0, 1, 3, 2))  # (B, H, S, T)
        rank_k = rank_k + ops.sum(ops.cast(ops.logical_and(kq, q_before_k), "int32"), axis=-1)
    chunk_q = rank_q // w
    chunk_k = rank_k // w
    s_pos = ops.arange(S, dtype="int32")
    mask = ops.logical_and(
        ops.equal(cq[..., :, None], ck[..., None, :]),
        ops.less(cq, k)[..., :, None],
    )
    mask = ops.logical_and(mask, ops.less_equal(s_pos[None, :], t_pos[:, None])[None, None])
    mask = ops.logical_and(
        mask, ops.greater_equal(chunk_k[..., None, :], chunk_q[..., :, None] - 1)
    )
    return mask


def _row_bincount(x, k):
    """How many entries of each row of int ``x`` ``(B, H, N)`` equal
    ``0 .. k-1`` (values ``k`` are dropped): int32 ``(B, H, k)``, by one
    segment sum (not an O(N * k) one-hot)."""
    H = x.shape[1]
    batch = _dim(x, 0)
    offsets = ops.reshape(ops.arange(batch * H, dtype="int32") * (k + 1), (-1, H, 1))
    ids = ops.reshape(ops.cast(x, "int32") + offsets, (-1,))
    counts = segment_sum(ops.ones_like(ids, dtype="float32"), ids, batch * H * (k + 1))
    counts = ops.reshape(counts, (-1, H, k + 1))[..., :k]
    return ops.cast(counts, "int32")


# ------------------------------------------------------------------ masks
def exclude_self_unless_alone(mask, is_self):
    """Removes the ``is_self`` entries of every row of ``mask`` that has
    another visible entry (shared query/key attention)."""
    if mask is None:
        mask = ops.ones_like(is_self, dtype="bool")
    mask = ops.logical_and(
        ops.cast(mask, "bool"), ops.ones_like(is_self, dtype="bool")
    )
    others = ops.logical_and(mask, ops.logical_not(is_self))
    has_other = ops.any(others, axis=-1, keepdims=True)
    return ops.where(has_other, others, mask)


def _and(a, b):
    if a is None:
        return None if b is None else ops.cast(b, "bool")
    if b is None:
        return ops.cast(a, "bool")
    return ops.logical_and(ops.cast(a, "bool"), ops.cast(b, "bool"))


def _prod(values):
    result = 1
    for v in values:
        result *= int(v)
    return result


def _dim(x, axis):
    """Static size of ``x`` along ``axis`` when known, else a tensor."""
    size = x.shape[axis]
    return size if size is not None else ops.shape(x)[axis]
