"""Sorted-chunk attention: items sorted by bucket, cut into chunks, each
chunk attending to itself and the previous chunk.

The shared machinery of content-based bucketing (the Routing Transformer's
causal token routing now; the Reformer's LSH attention next): every query
and every key carries a bucket id (a nearest centroid, a hash); inside a
bucket, items are ordered by position (a key before the query of its
position) and cut into chunks of ``window`` members, aligned per bucket so
that a chunk never mixes buckets; a query attends to the keys of its own and
of the previous chunk of its bucket that are not after it. With shared
queries and keys every token is one member, both query and key, and sees
itself only when nothing else is visible. Everything a query sees is
decided by tokens at or before it: strictly causal. Computed as dense
``window x 2 window`` blocks: O(n * window * d), nothing of size ``n^2``.
:func:`sorted_chunk_mask` is the same attention as a dense mask (O(n^2), the
reference).

Shape legend: B batch, T query length, S key length, H heads, d head size,
dv value head size, k buckets, w window (members of a chunk), G chunks, L
slots (``G * w``).
"""

import math

import numpy as np
from keras import ops

from keras_longattn.kernels import backend_ops
from keras_longattn.kernels import compiled
from keras_longattn.ops.blocked import block_attention
from keras_longattn.ops.fused import fused_dot_product_attention
from keras_longattn.ops.patterns import exclude_self_unless_alone
from keras_longattn.ops.reference import MASKED_LOGIT
from keras_longattn.ops.reference import softmax_with_lse
from keras_longattn.ops.segments import flat_token_ids
from keras_longattn.ops.segments import gather_tokens
from keras_longattn.ops.segments import row_bincount
from keras_longattn.ops.segments import static_dim
from keras_longattn.ops.segments import take_rows
from keras_longattn.ops.shapes import is_static
from keras_longattn.ops.shapes import larger
from keras_longattn.ops.shapes import length


def sorted_chunk_layout(item_buckets, item_keys, num_buckets, window):
    """Lays the items of each cluster out in chunk-aligned slots.

    Items (queries and/or keys) are sorted by ``item_keys`` (cluster first,
    then position); cluster ``c`` gets ``ceil(n_c / window)`` whole chunks of
    ``window`` slots, so that a chunk never mixes clusters. Items of cluster
    ``num_buckets`` (padding) get no slot. The buffer has a static size of
    ``(ceil(N / window) + num_buckets) * window`` slots.

    Args:
        item_buckets: int ``(B, H, N)`` in ``[0, num_buckets]``.
        item_keys: int ``(B, H, N)`` unique sort keys, increasing with the
            cluster.
        num_buckets: k.
        window: chunk size.

    Returns:
        A dict with int32 ``source`` ``(B, H, L)`` (item of each slot),
        boolean ``filled`` ``(B, H, L)``, int32 ``cluster`` ``(B, H, L)``
        (-1 for empty slots), int32 ``slot`` ``(B, H, N)`` (slot of each
        item, clipped) and boolean ``placed`` ``(B, H, N)``.
    """
    k = int(num_buckets)
    w = int(window)
    N = length(item_buckets, -1)
    item_buckets = ops.cast(item_buckets, "int32")
    order = ops.cast(ops.argsort(item_keys, axis=-1), "int32")  # (B, H, N)
    sorted_buckets = ops.take_along_axis(item_buckets, order, axis=-1)
    counts = row_bincount(item_buckets, k)  # (B, H, k)
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
    H = item_buckets.shape[1]
    rank = ops.reshape(rank, (-1, H, num_chunks * w))
    cluster = ops.reshape(cluster, (-1, H, num_chunks * w))
    filled = ops.less(rank, ops.take_along_axis(counts, cluster, axis=-1))
    sorted_index = ops.clip(
        ops.take_along_axis(start, cluster, axis=-1) + rank, 0, N - 1
    )
    source = ops.take_along_axis(order, sorted_index, axis=-1)
    cluster = ops.where(filled, cluster, -1)
    # Slot of every item (inverse of the layout).
    safe = ops.minimum(sorted_buckets, k - 1)
    sorted_rank = ops.arange(N, dtype="int32") - ops.take_along_axis(start, safe, axis=-1)
    slot_sorted = ops.take_along_axis(base, safe, axis=-1) * w + sorted_rank
    inverse = ops.cast(ops.argsort(order, axis=-1), "int32")
    slot = ops.take_along_axis(slot_sorted, inverse, axis=-1)
    placed = ops.less(item_buckets, k)
    slot = ops.where(placed, ops.clip(slot, 0, num_chunks * w - 1), 0)
    return {
        "source": source,
        "filled": filled,
        "cluster": cluster,
        "slot": slot,
        "placed": placed,
    }


@compiled(
    ("num_buckets", "window", "shared", "scale", "dropout_fn", "fused", "causal",
     "return_lse")
)
def sorted_chunk_attention(
    query,
    key,
    value,
    query_buckets,
    key_buckets,
    num_buckets,
    window,
    shared=False,
    scale=None,
    dropout_fn=None,
    fused=False,
    causal=True,
    return_lse=False,
):
    """Strictly causal attention inside buckets, in sorted chunks (see the
    module docstring).

    Each query and each key belongs to the bucket in ``query_buckets`` /
    ``key_buckets`` (``num_buckets`` marks padding: such a key is never
    seen, such a query gets zeros). Inside a bucket, queries and keys are
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
        query_buckets: int ``(B, H, T)`` in ``[0, num_buckets]``.
        key_buckets: int ``(B, H, S)`` in ``[0, num_buckets]`` (ignored
            when ``shared``).
        num_buckets: k.
        window: chunk size (members).
        shared: queries and keys are the same tokens.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights.
        fused: compute the chunks with ``keras.ops.dot_product_attention``
            (each chunk one batch item of the fused kernel). Not with
            ``dropout_fn``.
        causal: when False, a query sees every key of its own chunk and of
            the previous chunk of its bucket, whatever their positions (the
            bidirectional mode of LSH attention); the self rule of
            ``shared`` still applies.
        return_lse: also return, per query, the float32 log-sum-exp of its
            logits over the keys it sees (``MASKED_LOGIT`` where it sees
            none) and whether it sees a key other than itself (to combine
            several hashing rounds). Not with ``fused``.

    Returns:
        ``(B, T, H, dv)``; with ``return_lse`` also float32 ``(B, H, T)``
        and boolean ``(B, H, T)``.
    """
    if fused and dropout_fn is not None:
        raise ValueError("`fused=True` does not support attention dropout.")
    if fused and return_lse:
        raise ValueError("`fused=True` cannot return the log-sum-exp.")
    T, S = length(query, 1), length(key, 1)
    H = query.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    w = int(window)
    query_buckets = ops.cast(query_buckets, "int32")
    if shared:
        if is_static(T, S) and T != S:
            raise ValueError(
                "Shared query/key routing needs as many keys as queries. "
                f"Received: query length {T}, key length {S}"
            )
        item_buckets = query_buckets
        positions = ops.arange(T, dtype="int32")
        item_keys = item_buckets * T + positions
        layout = sorted_chunk_layout(item_buckets, item_keys, num_buckets, w)
        src = layout["source"]
        q_rows = k_rows = src  # every slot holds one token, query and key
        is_key = is_query = layout["filled"]
    else:
        key_buckets = ops.cast(key_buckets, "int32")
        P = larger(T, S)
        item_buckets = ops.concatenate([query_buckets, key_buckets], axis=-1)
        q_pos = ops.arange(T, dtype="int32")
        k_pos = ops.arange(S, dtype="int32")
        positions = ops.concatenate([q_pos, k_pos], axis=0)
        kind = ops.concatenate(
            [ops.ones((T,), "int32"), ops.zeros((S,), "int32")], axis=0
        )  # 1 = query; a key sorts before the query of its position
        item_keys = item_buckets * (2 * P) + 2 * positions + kind
        layout = sorted_chunk_layout(item_buckets, item_keys, num_buckets, w)
        src = layout["source"]
        is_q_item = ops.less(src, T)
        q_rows = ops.clip(src, 0, T - 1)
        k_rows = ops.clip(src - T, 0, S - 1)
        is_key = ops.logical_and(layout["filled"], ops.logical_not(is_q_item))
        is_query = ops.logical_and(layout["filled"], is_q_item)
    L = length(src, -1)
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
    # both query and key; see the self rule below); every slot when not
    # causal.
    own = np.tril(np.ones((w, w), bool), k=0 if shared else -1)
    if not causal:
        own = np.ones((w, w), bool)
    band = np.concatenate([np.ones((w, w), bool), own], axis=1)  # (w, 2w)
    is_self = None
    if shared:
        is_self = np.concatenate([np.zeros((w, w), bool), np.eye(w, dtype=bool)], axis=1)
    slot = layout["slot"][..., :T]
    placed = layout["placed"][..., :T]
    if fused:
        return _sorted_chunks_fused(
            query, key, value, q_rows, is_query, context(k_rows), col_ok, band,
            is_self, slot, placed, scale,
        )
    qb = blocks(gather_tokens(query, q_rows))
    kb = context(gather_tokens(key, k_rows))
    vb = context(gather_tokens(value, k_rows))
    mask = _chunk_mask(col_ok[..., None, :], band, is_self)
    if return_lse:
        return _chunks_with_lse(
            qb, kb, vb, mask, col_ok, band, is_self, slot, placed, scale, dropout_fn
        )
    out, _ = block_attention(qb, kb, vb, mask, scale, dropout_fn)
    out = ops.reshape(out, (-1, H, L, out.shape[-1]))
    out = ops.take_along_axis(out, slot[..., None], axis=2)  # (B, H, T, dv)
    out = ops.where(placed[..., None], out, ops.zeros_like(out))
    return ops.transpose(out, (0, 2, 1, 3))


def _chunks_with_lse(qb, kb, vb, mask, col_ok, band, is_self, slot, placed, scale,
                     dropout_fn):
    """The chunks of :func:`sorted_chunk_attention` with explicit einsums,
    returning each query's output ``(B, T, H, dv)``, the log-sum-exp of its
    logits ``(B, H, T)`` and whether it sees a key other than itself
    ``(B, H, T)``."""
    H, G, w = qb.shape[1], length(qb, 2), qb.shape[3]
    L = G * w
    qs = ops.multiply(qb, ops.cast(scale, qb.dtype))
    scores = ops.einsum("bhgqd,bhgkd->bhgqk", qs, kb)  # (B, H, G, w, 2w)
    probs, lse = softmax_with_lse(scores, mask)
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    out = ops.einsum("bhgqk,bhgkd->bhgqd", probs, vb)
    seen = ops.logical_and(ops.convert_to_tensor(band), col_ok[..., None, :])
    if is_self is not None:
        seen = ops.logical_and(seen, ops.logical_not(ops.convert_to_tensor(is_self)))
    other = ops.any(seen, axis=-1)  # (B, H, G, w)

    out = ops.reshape(out, (-1, H, L, out.shape[-1]))
    out = ops.take_along_axis(out, slot[..., None], axis=2)  # (B, H, T, dv)
    out = ops.where(placed[..., None], out, ops.zeros_like(out))
    lse = ops.take_along_axis(ops.reshape(lse, (-1, H, L)), slot, axis=2)
    lse = ops.where(placed, lse, MASKED_LOGIT)
    other = ops.take_along_axis(ops.reshape(other, (-1, H, L)), slot, axis=2)
    other = ops.logical_and(other, placed)
    return ops.transpose(out, (0, 2, 1, 3)), lse, other


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
    :func:`_sorted_chunks_fused` takes: all of them, or as many as the
    backend's ``max_scores_per_call`` allows (see
    :mod:`keras_longattn.kernels`)."""
    limit = backend_ops().max_scores_per_call
    if limit is None:
        return items
    return max(1, limit // (wq * wk))


def _sorted_chunks_fused(
    query, key, value, q_rows, is_query, k_rows, col_ok, band, is_self, slot, placed,
    scale,
):
    """The chunks of :func:`sorted_chunk_attention` through
    :func:`~keras_longattn.ops.fused.fused_dot_product_attention`.

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
    T, H, d = length(query, 1), query.shape[2], query.shape[3]
    S, dv = length(key, 1), value.shape[3]
    G, w2 = length(k_rows, 2), k_rows.shape[3]
    w = w2 // 2
    L = G * w
    batch = static_dim(query, 0)
    q_ids = ops.reshape(flat_token_ids(q_rows, batch, H, T), (-1, w))
    k_ids = ops.reshape(flat_token_ids(k_rows, batch, H, S), (-1, w2))
    ok = ops.reshape(col_ok, (-1, 1, 1, w2))
    position = None  # compact index of each kept chunk
    # Backends that run data-dependent shapes eagerly (torch) drop the
    # chunks that hold no query (sorted_chunk_attention is a compiled
    # kernel: never traced by torch.compile).
    kept = None
    if isinstance(batch, int):
        has_query = ops.any(ops.reshape(is_query, (-1, w)), axis=-1)  # (I,)
        kept = backend_ops().kept_items(has_query)
    if kept is not None:
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


@compiled(("num_buckets", "window", "shared", "causal"))
def sorted_chunk_mask(query_buckets, key_buckets, num_buckets, window, shared=False,
                      causal=True):
    """Dense boolean ``(B, H, T, S)`` mask of :func:`sorted_chunk_attention`
    (without the self rule of ``shared``), from ranks counted densely;
    ``causal=False``: the keys of the query's own and previous chunk
    whatever their positions.

    O(T * S): for the reference path and tests.
    """
    k = int(num_buckets)
    w = int(window)
    cq = ops.cast(query_buckets, "int32")
    T = length(cq, -1)
    t_pos = ops.arange(T, dtype="int32")
    if shared:
        same = ops.equal(cq[..., :, None], cq[..., None, :])  # (B, H, T, T)
        before = ops.less(t_pos[None, :], t_pos[:, None])  # [i, j]: j < i
        rank_q = ops.sum(ops.cast(ops.logical_and(same, before), "int32"), axis=-1)
        rank_k = rank_q
        ck = cq
        S = T
    else:
        ck = ops.cast(key_buckets, "int32")
        S = length(ck, -1)
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
    if causal:
        mask = ops.logical_and(
            mask, ops.less_equal(s_pos[None, :], t_pos[:, None])[None, None]
        )
    else:
        mask = ops.logical_and(
            mask, ops.less_equal(chunk_k[..., None, :], chunk_q[..., :, None])
        )
    mask = ops.logical_and(
        mask, ops.greater_equal(chunk_k[..., None, :], chunk_q[..., :, None] - 1)
    )
    return mask
