"""Online k-means on the unit sphere: the routing of the Routing
Transformer, as pure functions.

Tokens (queries and keys per head) are projected onto the unit sphere
(:func:`sphere_normalize`), compared with ``k`` centroids per head by cosine
similarity (:func:`centroid_similarity`) and assigned either to their
nearest centroid (:func:`nearest_centroid`, the k-means assignment) or, for
balanced clusters, to the centroids that rank them among their ``w`` most
similar tokens (:func:`balanced_assignment`). Centroids move by an
exponential moving average of the tokens assigned to them
(:func:`cluster_statistics`, :func:`ema_update`). :func:`route` does a whole
routing step and returns a :class:`Routing` with the clusters, the new
centroids and the commitment loss; a layer only assigns the first and adds
the second.

Shape legend: B batch, T query length, S key length, n a sequence length,
H heads, d head size, k clusters, w members of a cluster.
"""

import dataclasses
import math

from keras import ops

from keras_longattn.kernels import backend_ops
from keras_longattn.kernels import compiled
from keras_longattn.ops import shapes

#: Similarity given to padded tokens before the top-w selection (cosine
#: similarities lie in [-1, 1]), so that they are chosen only when a
#: cluster has no real token left, always in the same (index) order.
EXCLUDED_SIMILARITY = -1e9


# ---------------------------------------------------------------- geometry
@compiled(("epsilon",))
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
    # keras.ops.layer_normalization: one fused kernel on torch, the moments
    # on the other backends.
    normalized = ops.layer_normalization(x, axis=-1, epsilon=epsilon)
    return normalized * (1.0 / math.sqrt(float(d)))


def l2_normalize(x, epsilon=1e-6):
    """``x / max(||x||, epsilon)`` over the last axis, in float32, with a
    finite gradient at ``x = 0`` (no square root of zero is differentiated)."""
    x = ops.cast(x, "float32")
    squared = ops.sum(ops.square(x), axis=-1, keepdims=True)
    return x * ops.rsqrt(ops.maximum(squared, epsilon * epsilon))


@compiled(("clusters_last",))
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
@compiled(("clusters_last",))
def nearest_centroid(similarity, valid=None, clusters_last=False):
    """The k-means assignment: the most similar centroid of every token.

    Args:
        similarity: ``(B, H, k, n)`` from :func:`centroid_similarity`, or
            ``(B, H, n, k)`` with ``clusters_last`` (the argmax then runs
            over a contiguous axis, which the torch backend prefers).
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


#: Most elements of one similarity slice in :func:`assign_by_heads`
#: (:func:`keras_longattn.ops.shapes.head_slices`): 16 MiB of float32, so
#: that each slice reuses the allocator's memory.
MAX_SIMILARITY_ELEMENTS = 1 << 22


def assign_by_heads(x_hat, centroids, valid=None, nearest=True, window=None):
    """The nearest centroids (:func:`nearest_centroid`) and / or the
    balanced top-``window`` members (:func:`balanced_assignment`) of
    :func:`centroid_similarity`, a few heads at a time: the same products,
    argmax and top-w as on the whole similarity (heads are independent),
    with no similarity slice above :data:`MAX_SIMILARITY_ELEMENTS` elements
    when a head allows it.

    Args:
        x_hat: ``(B, n, H, d)`` normalised tokens.
        centroids: ``(H, k, d)``.
        valid: optional boolean ``(B, n)``; False marks padding.
        nearest: compute the nearest centroids.
        window: members per cluster of the balanced assignment (None: none).

    Returns:
        ``(nearest, members)``: int32 ``(B, H, n)`` (padded tokens get
        ``k``) or None, and int32 ``(B, H, k, window)`` or None.
    """
    B, n, H = x_hat.shape[0], x_hat.shape[1], x_hat.shape[2]
    slices = shapes.head_slices(B, n, H, centroids.shape[1], MAX_SIMILARITY_ELEMENTS)
    near, members = [], []
    for h0, h1 in slices:
        part = (x_hat, centroids) if len(slices) == 1 else (x_hat[:, :, h0:h1], centroids[h0:h1])
        sim = centroid_similarity(*part, clusters_last=True)
        if nearest:
            near.append(nearest_centroid(sim, valid, clusters_last=True))
        if window is not None:
            members.append(balanced_assignment(sim, int(window), valid, clusters_last=True))

    def joined(parts):
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)

    return joined(near), joined(members)


@compiled(("window", "clusters_last"))
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
        cluster. Among tokens of equal similarity the lower positions are
        taken first, on every backend.
    """
    token_axis = 2 if clusters_last else 3
    n = similarity.shape[token_axis]
    window = int(window)
    if window < 1 or (n is not None and window > n):
        raise ValueError(
            f"`window` must be in [1, {n}] for a sequence of length {n}. "
            f"Received: window={window}"
        )
    if valid is not None:
        valid = ops.cast(valid, "bool")[:, None, :]
        valid = valid[..., None] if clusters_last else valid[:, :, None, :]
        similarity = ops.where(valid, similarity, EXCLUDED_SIMILARITY)
    # Ties resolve towards the lower position on every backend.
    idx = backend_ops().top_k_indices(similarity, window, axis=token_axis)
    if clusters_last:
        idx = ops.transpose(idx, (0, 1, 3, 2))
    return ops.sort(ops.cast(idx, "int32"), axis=-1)


# ------------------------------------------------------------- statistics
@compiled(("num_clusters",))
def cluster_statistics(x_hat, assignment, num_clusters):
    """Per-head sums and counts of the tokens assigned to each centroid,
    over the batch (padded tokens, marked ``num_clusters``, are dropped).

    The backend table's ``cluster_sums``: one matrix product with the
    ``(B, H, n, k)`` membership indicators (JAX, TensorFlow), a row
    scatter-add on torch (:mod:`keras_longattn.kernels`).

    Args:
        x_hat: ``(B, n, H, d)`` normalised tokens.
        assignment: int ``(B, H, n)`` in ``[0, num_clusters]``.
        num_clusters: k.

    Returns:
        float32 sums ``(H, k, d)`` and counts ``(H, k)``.
    """
    return backend_ops().cluster_sums(x_hat, assignment, int(num_clusters))


@compiled(("decay",))
def ema_update(centroids, sums, counts, decay):
    """One mini-batch k-means step by exponential moving average.

    ``mu <- decay * mu + (1 - decay) * mean(assigned)`` for every centroid
    that was assigned at least one token; empty centroids do not move. The
    result carries no gradient.

    Args:
        centroids: ``(H, k, d)``.
        sums: ``(H, k, d)`` from :func:`cluster_statistics`.
        counts: ``(H, k)`` from :func:`cluster_statistics`.
        decay: in ``(0, 1)``.

    Returns:
        float32 ``(H, k, d)``.
    """
    centroids = ops.cast(centroids, "float32")
    means = sums / ops.maximum(counts, 1.0)[..., None]
    moved = decay * centroids + (1.0 - decay) * means
    new = ops.where(ops.greater(counts, 0.0)[..., None], moved, centroids)
    return ops.stop_gradient(new)




def commitment_loss(x_live, nearest, centroids):
    """Mean ``||x_hat - stop_gradient(mu_hat)||^2`` over real tokens.

    Args:
        x_live: ``(B, n, H, d)`` normalised tokens, with their gradient.
        nearest: int ``(B, H, n)`` from :func:`nearest_centroid` (``k``
            marks padding, which does not count).
        centroids: ``(H, k, d)``.

    Returns:
        A float32 scalar.
    """
    k = centroids.shape[1]
    mu = l2_normalize(centroids)  # (H, k, d)
    idx = ops.minimum(nearest, k - 1)  # (B, H, n)
    mu = ops.take_along_axis(
        ops.expand_dims(mu, 0), ops.expand_dims(idx, -1), axis=2
    )  # (B, H, n, d)
    x = ops.transpose(x_live, (0, 2, 1, 3))
    dist = ops.sum(ops.square(x - ops.stop_gradient(mu)), axis=-1)  # (B, H, n)
    weight = ops.cast(ops.less(nearest, k), "float32")
    return ops.sum(dist * weight) / ops.maximum(ops.sum(weight), 1.0)


@dataclasses.dataclass
class Routing:
    """The routing decisions of one call (see :func:`route`).

    Attributes:
        mode: ``"balanced"`` (top-w clusters) or ``"token"`` (nearest
            centroid).
        keys: the keys the attention uses: ``key``, or with shared queries
            and keys the unit-normalised queries.
        window: members per cluster (balanced) or per chunk (token).
        query_clusters: int ``(B, H, T)`` nearest centroid of each query,
            ``k`` for padding; None where it was not needed.
        key_clusters: int ``(B, H, S)``, the same for keys.
        query_indices: int ``(B, H, k, wq)`` balanced members, ascending;
            None in token mode.
        key_indices: int ``(B, H, k, wk)``; None in token mode.
        centroids: float32 ``(H, k, d)`` moved centroids, or None when no
            update was asked for.
        loss: float32 commitment loss, or None when not asked for.
    """

    mode: str
    keys: object
    window: int
    query_clusters: object = None
    key_clusters: object = None
    query_indices: object = None
    key_indices: object = None
    centroids: object = None
    loss: object = None


def route(
    query,
    key,
    centroids,
    mode,
    window,
    key_window=None,
    query_valid=None,
    key_valid=None,
    shared=False,
    ema_decay=None,
    commitment=False,
    nearest=True,
):
    """One routing step of online spherical k-means.

    Args:
        query: ``(B, T, H, d)`` projected queries.
        key: ``(B, S, H, d)`` projected keys (unused with ``shared``).
        centroids: ``(H, k, d)``.
        mode: ``"balanced"`` (each centroid takes its ``window`` most similar
            queries and its ``key_window`` most similar keys) or ``"token"``
            (each token joins its nearest centroid).
        window: members per cluster (balanced queries) or per chunk (token).
        key_window: members per cluster for keys (balanced). Defaults to
            ``window``.
        query_valid: optional boolean ``(B, T)``; False marks padding, which
            is routed last and never moves a centroid.
        key_valid: optional boolean ``(B, S)``.
        shared: queries and keys are the same tokens (the normalised
            queries serve as keys).
        ema_decay: when set, also return the centroids moved by one
            exponential-moving-average step towards the tokens assigned to
            them (nearest centroid, queries and keys pooled).
        commitment: also return the commitment loss (the only output with a
            gradient towards the projections; otherwise routing runs on
            detached inputs, as it is a discrete decision).
        nearest: compute the nearest centroids even where nothing needs them
            (balanced inference needs only the top-w choice).

    Returns:
        A :class:`Routing`.
    """
    if mode not in ("balanced", "token"):
        raise ValueError(
            f"`mode` must be 'balanced' or 'token'. Received: mode={mode!r}"
        )
    balanced = mode == "balanced"
    k = centroids.shape[1]
    centroids = ops.cast(centroids, "float32")
    q_in, k_in = query, key
    if not commitment:
        q_in, k_in = ops.stop_gradient(query), ops.stop_gradient(key)
    q_live = sphere_normalize(q_in)
    k_live = q_live if shared else sphere_normalize(k_in)
    q_hat = ops.stop_gradient(q_live)
    k_hat = ops.stop_gradient(k_live)
    # Similarities (B, H, n, k) a few heads at a time: the nearest centroid
    # is a contiguous argmax, and the top-w choice reads the same slice.
    need_near = nearest or ema_decay is not None or commitment or not balanced
    near_q, members_q = assign_by_heads(
        q_hat, centroids, query_valid, nearest=need_near,
        window=int(window) if balanced else None,
    )
    if shared:
        near_k, members_k = near_q, members_q
    else:
        near_k, members_k = assign_by_heads(
            k_hat, centroids, key_valid, nearest=need_near,
            window=int(key_window or window) if balanced else None,
        )
    routing = Routing(
        mode=mode,
        keys=ops.cast(l2_normalize(query), query.dtype) if shared else key,
        window=int(window),
        query_clusters=near_q,
        key_clusters=near_k,
    )
    if ema_decay is not None:
        sums, counts = cluster_statistics(q_hat, near_q, k)
        if not shared:
            k_sums, k_counts = cluster_statistics(k_hat, near_k, k)
            sums, counts = sums + k_sums, counts + k_counts
        routing.centroids = ema_update(centroids, sums, counts, float(ema_decay))
    if commitment:
        loss = commitment_loss(q_live, near_q, centroids)
        if not shared:
            loss = 0.5 * (loss + commitment_loss(k_live, near_k, centroids))
        routing.loss = loss
    if balanced:
        routing.query_indices = members_q
        routing.key_indices = members_k
    return routing
