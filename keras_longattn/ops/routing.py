"""Routing attention of the Routing Transformer (Roy et al. 2021): what is
specific to that paper.

The routing itself (online spherical k-means, balanced top-w clusters) is in
:mod:`keras_longattn.ops.kmeans`; causal *token* routing is sorted-chunk
attention over nearest-centroid buckets (:mod:`keras_longattn.ops.chunked`).
Here: attention inside **balanced** clusters, where each centroid takes its
``w`` most similar queries and its ``w`` most similar keys (as in the
authors' code), every cluster is a dense ``w x w`` block, and a query chosen
by several centroids gets the mean of its outputs over the clusters in which
it sees at least one key (a query chosen by none, or seeing no key, gets
zeros). Membership of a token depends on every other token of the sequence
(later ones included), so this is not strictly causal. And the dense
weights of both kinds of routing (the reference path).

Cost: O(n * w * d) = O(n^2 * d / k) for attention; nothing of size ``n^2``
outside the ``*_weights`` functions (O(n^2), for the reference path and
tests only).

Shape legend: B batch, T query length, S key length, H heads, d head size,
dv value head size, k clusters, w members of a cluster.
"""

import math

from keras import ops

from keras_longattn.kernels import compiled
from keras_longattn.ops.blocked import block_attention
from keras_longattn.ops.blocked import local_attention
from keras_longattn.ops.chunked import sorted_chunk_mask
from keras_longattn.ops.patterns import LocalPattern
from keras_longattn.ops.patterns import combine_dense_masks
from keras_longattn.ops.patterns import exclude_self_unless_alone
from keras_longattn.ops.reference import masked_softmax
from keras_longattn.ops.segments import gather_flags
from keras_longattn.ops.segments import gather_tokens
from keras_longattn.ops.segments import scatter_mean
from keras_longattn.ops.shapes import length


# ------------------------------------------------- balanced cluster blocks
@compiled(("causal", "exclude_self", "scale", "dropout_fn", "fused"))
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
            Not with ``dropout_fn``. Same result.

    Returns:
        ``(B, T, H, dv)``.
    """
    T = length(query, 1)
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    qg = gather_tokens(query, query_indices)  # (B, H, k, wq, d)
    kg = gather_tokens(key, key_indices)  # (B, H, k, wk, d)
    vg = gather_tokens(value, key_indices)  # (B, H, k, wk, dv)
    q_pos = query_indices[..., :, None]
    k_pos = key_indices[..., None, :]
    mask = None
    if key_mask is not None:
        kv = gather_flags(ops.expand_dims(key_mask, 1), key_indices) > 0
        mask = kv[..., None, :]
    if causal:
        mask = combine_dense_masks(mask, ops.less_equal(k_pos, q_pos))
    if exclude_self:
        mask = exclude_self_unless_alone(mask, ops.equal(k_pos, q_pos))
    out, seen = block_attention(qg, kg, vg, mask, scale, dropout_fn, fused)
    # A query's output is the mean over the clusters in which it sees a key.
    return scatter_mean(out, query_indices, T, weights=seen)


@compiled(("causal", "exclude_self", "scale"))
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
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        query_indices: int ``(B, H, k, wq)``, as
            :func:`balanced_cluster_attention`.
        key_indices: int ``(B, H, k, wk)``.
        causal: mask keys after the query.
        key_mask: optional boolean ``(B, S)``; False marks padded keys.
        exclude_self: a query sees the key at its own position only when
            nothing else is visible.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        extra_mask: optional boolean mask broadcastable to ``(B, H, T, S)``
            (e.g. a dense ``attention_mask``), ANDed into every cluster.

    Returns:
        float32 weights ``(B, H, T, S)``.
    """
    T, S = length(query, 1), length(key, 1)
    num_clusters = query_indices.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    scores = ops.einsum("bthd,bshd->bhts", query, key)
    q_member = membership(query_indices, T)  # (B, H, k, T)
    k_member = membership(key_indices, S)  # (B, H, k, S)
    base = extra_mask
    if key_mask is not None:
        base = combine_dense_masks(base, ops.cast(key_mask, "bool")[:, None, None, :])
    q_pos = ops.arange(T, dtype="int32")[:, None]
    k_pos = ops.arange(S, dtype="int32")[None, :]
    if causal:
        base = combine_dense_masks(base, ops.less_equal(k_pos, q_pos)[None, None])
    total = None
    counts = None
    for c in range(num_clusters):
        mask = ops.logical_and(
            q_member[:, :, c, :, None], k_member[:, :, c, None, :]
        )
        mask = combine_dense_masks(mask, base)
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


@compiled(
    ("local_extents", "mode", "causal", "shared", "num_clusters", "window", "scale")
)
def routing_reference_weights(
    q_loc,
    k_loc,
    q_rt,
    keys,
    extra,
    query_indices,
    key_indices,
    query_clusters,
    key_clusters,
    local_extents,
    mode,
    causal,
    shared,
    num_clusters,
    window,
    scale,
):
    """Dense float32 ``(B, H, T, S)`` weights of a routing layer's reference
    path: the local heads under their sliding window (``local_extents``
    ``(look_back, look_ahead)``, None without local heads), then the routing
    heads under their clusters (``mode`` ``"balanced"`` or ``"token"``,
    None without routing heads). ``extra`` is an optional boolean mask
    broadcastable to ``(B, H, T, S)`` (padding, a dense ``attention_mask``).
    O(T * S) (O(k * T * S) for balanced routing): the specification."""
    weights = []
    if local_extents is not None:
        T, S = length(q_loc, 1), length(k_loc, 1)
        mask = LocalPattern(*local_extents).dense_mask(T, S)[None, None]
        mask = combine_dense_masks(mask, extra)
        scores = ops.einsum(
            "bthd,bshd->bhts", ops.multiply(q_loc, ops.cast(scale, q_loc.dtype)), k_loc
        )
        weights.append(ops.cast(masked_softmax(scores, mask), "float32"))
    if mode == "balanced":
        weights.append(
            balanced_cluster_weights(
                q_rt,
                keys,
                query_indices,
                key_indices,
                causal=causal,
                exclude_self=shared,
                scale=scale,
                extra_mask=extra,
            )
        )
    elif mode == "token":
        T, S = length(q_rt, 1), length(keys, 1)
        mask = sorted_chunk_mask(
            query_clusters, key_clusters, num_clusters, window, shared=shared
        )
        mask = combine_dense_masks(mask, extra)
        if shared:
            eye = ops.equal(
                ops.arange(T, dtype="int32")[:, None],
                ops.arange(S, dtype="int32")[None, :],
            )
            mask = exclude_self_unless_alone(mask, eye[None, None])
        scores = ops.einsum(
            "bthd,bshd->bhts", ops.multiply(q_rt, ops.cast(scale, q_rt.dtype)), keys
        )
        weights.append(ops.cast(masked_softmax(scores, mask), "float32"))
    return weights[0] if len(weights) == 1 else ops.concatenate(weights, axis=1)


#: :func:`keras_longattn.ops.local_attention` of a routing layer's local
#: heads, compiled as one program on JAX (static: the extents, the block
#: size, the scale, the dropout function and ``fused``).
local_heads_attention = compiled(
    ("look_back", "look_ahead", "block_size", "scale", "dropout_fn", "fused")
)(local_attention)
