"""The layers' block-sparse paths (``implementation="pallas"``): each
layer's pattern on the block-sparse flash-attention kernel.

Each function arranges the tokens of one pattern so that the pairs it
allows fall in few ``(query block, key block)`` tiles, builds the block
layout of that arrangement (:mod:`keras_longattn.ops.layouts`: NumPy,
cached per static shape; with ``keras.ops`` where it depends on the data,
as BigBird's random blocks do) and hands both, with the layer's own
pattern as the in-kernel predicate, to the backend's block-sparse kernel
(:meth:`keras_longattn.kernels.BackendOps.block_sparse_attention`: the
Pallas kernel of ``kernels/jax/pallas_attention.py`` on JAX; refused
elsewhere, :func:`refusal`).

Arrangements (tokens keep their original positions, so the predicate is
the very pattern of the dense reference): see
:mod:`keras_longattn.ops.layouts`; BigBird uses the layer's own block mask
per example; Longformer, per dilation ``r``, tokens sorted by ``position
mod r`` plus the global keys and the global rows; Routing, each head's
tokens gathered cluster by cluster, positions encoded as ``cluster *
stride + position`` (:class:`ClusterPattern`).

Shape legend: B batch, T query length, S key length, H heads, d head size,
b kernel block size, l stride / block length, c summary width.
"""

import numpy as np
from keras import ops

from keras_longattn.kernels import backend_ops
from keras_longattn.kernels.constants import MASKED_LOGIT
from keras_longattn.ops import layouts as la_layouts
from keras_longattn.ops import patterns as la_patterns
from keras_longattn.ops import reference as la_reference
from keras_longattn.ops import sparse as la_sparse


def refusal():
    """Why the block-sparse kernel cannot run on the active backend (None
    on JAX, where it compiles on GPU/TPU and is interpreted on the CPU)."""
    return backend_ops().block_sparse_refusal()


def attention(query, key, value, layout, predicate=None, q_pos=None, k_pos=None,
              k_valid=None, scale=None):
    """Block-sparse attention of ``(B, T, H, d)`` heads under ``layout`` (a
    :class:`keras_longattn.ops.layouts.BlockLayout`) and the element
    ``predicate`` (an :class:`keras_longattn.ops.AttentionPattern` on the
    positions ``q_pos`` / ``k_pos``, default ``0 ..``), keys where
    ``k_valid``; ``(out (B, T, H, dv), lse (B, T, H))``, a row that sees
    no key zeros and ``MASKED_LOGIT``. Only where :func:`refusal` is None."""
    return backend_ops().block_sparse_attention(
        query, key, value, layout.rows, layout.cols, layout.block_q, layout.block_k,
        predicate=predicate, q_pos=q_pos, k_pos=k_pos, k_valid=k_valid, scale=scale)


def _key_valid(key_mask):
    return None if key_mask is None else ops.cast(key_mask, "bool")


# ------------------------------------------------------------------- band
def band_attention(query, key, value, look_back, look_ahead, key_mask=None, scale=None,
                   block=None, predicate=None, return_lse=False):
    """Query ``i`` against keys ``i - look_back .. i + look_ahead``.

    ``predicate`` (default: ``LocalPattern(look_back, look_ahead)``) may
    narrow the band further (e.g. a causal AND).
    """
    T, S = query.shape[1], key.shape[1]
    b = block or la_layouts.default_block(max(T, S))
    layout = la_layouts.cached_band_layout(T, S, b, look_back, look_ahead)
    if predicate is None:
        predicate = la_patterns.LocalPattern(look_back, look_ahead)
    out, lse = attention(query, key, value, layout, predicate=predicate,
                         k_valid=_key_valid(key_mask), scale=scale)
    return (out, lse) if return_lse else out


def arranged_attention(query, key, value, arranged, predicate, key_mask=None, scale=None):
    """Attention on reordered tokens (``arranged``: ``(q_order, k_order,
    layout)`` of :func:`keras_longattn.ops.layouts.arrangement`), returned
    in the original order: ``(out (B, T, H, dv), lse (B, T, H))``."""
    q_order, k_order, layout = arranged
    B, T, H = query.shape[:3]
    if len(k_order) == 0:
        out = ops.zeros((B, T, H, value.shape[3]), query.dtype)
        return out, ops.full((B, T, H), MASKED_LOGIT, "float32")
    q = query if q_order is None else ops.take(query, q_order, axis=1)
    k = ops.take(key, k_order, axis=1)
    v = ops.take(value, k_order, axis=1)
    valid = _key_valid(key_mask)
    if valid is not None:
        valid = ops.take(valid, k_order, axis=1)
    out, lse = attention(
        q, k, v, layout, predicate=predicate,
        q_pos=None if q_order is None else q_order.astype(np.int32),
        k_pos=k_order.astype(np.int32), k_valid=valid, scale=scale)
    if q_order is not None:
        inverse = np.argsort(q_order)
        out = ops.take(out, inverse, axis=1)
        lse = ops.take(lse, inverse, axis=1)
    return out, lse


# ------------------------------------------------------- Sparse Transformer
def sparse_attention(query, key, value, pattern, block_length, summary_width,
                     combination, causal, key_mask=None, scale=None, block=None):
    """The Sparse Transformer's strided or fixed attention (the layer's
    ``combination``), equal to dense attention under
    :func:`keras_longattn.ops.sparse.sparse_head_patterns`."""
    l = int(block_length)
    c = summary_width if pattern == "fixed" else None
    first, second = la_sparse.sparse_transformer_patterns(pattern, l, c, causal)
    T, S = query.shape[1], key.shape[1]
    b = block or la_layouts.default_block(max(T, S))

    def part_a(q, k, v):
        if pattern == "strided":
            return band_attention(q, k, v, l - 1, 0 if causal else l - 1, key_mask,
                                  scale, b, predicate=first, return_lse=True)
        arranged = la_layouts.arrangement("blocks", T, S, l, c, causal, b)
        return arranged_attention(q, k, v, arranged, first, key_mask, scale)

    def part_b(q, k, v, predicate):
        kind = "columns" if pattern == "strided" else "summary"
        arranged = la_layouts.arrangement(kind, T, S, l, c, causal, b)
        return arranged_attention(q, k, v, arranged, predicate, key_mask, scale)

    if combination == "first":
        return part_a(query, key, value)[0]
    if combination == "second":
        return part_b(query, key, value, second)[0]
    if combination == "merged":
        # One softmax over A | B: B without the keys A already has.
        return la_reference.merge_attention_parts([
            part_a(query, key, value),
            part_b(query, key, value, la_patterns.Difference(second, first)),
        ])
    h = la_sparse.multihead_split(query.shape[2])
    out = part_a(query[:, :, :h], key[:, :, :h], value[:, :, :h])[0]
    if h == query.shape[2]:
        return out
    rest = part_b(query[:, :, h:], key[:, :, h:], value[:, :, h:], second)[0]
    return ops.concatenate([out, rest], axis=2)


# ----------------------------------------------------------------- BigBird
def bigbird_attention(query, key, value, block_size, window_blocks, global_blocks,
                      random_blocks, seed, causal, key_mask=None, scale=None):
    """BigBird's window, global and random blocks: the layer's own block mask
    (per example when keys are padded, since the random blocks depend on
    the real length) is the layout, with kernel blocks of ``block_size``;
    the predicate is only causality."""
    from keras_longattn.ops import bigbird as la_bigbird

    b = int(block_size)
    T, S = query.shape[1], key.shape[1]
    nq, nk = -(-T // b), -(-S // b)
    valid = _key_valid(key_mask)
    used = la_bigbird.used_key_blocks(valid, S, b)
    mask = la_bigbird.block_mask(nq, nk, used, window_blocks, global_blocks,
                                 random_blocks, seed, causal)
    layout = la_layouts.BlockLayout.from_block_mask(ops.convert_to_tensor(mask), b, b)
    predicate = la_patterns.CausalPattern() if causal else None
    out, _ = attention(query, key, value, layout, predicate=predicate, k_valid=valid,
                       scale=scale)
    return out


# --------------------------------------------------------------- Longformer
def longformer_attention(query, key, value, window, dilations, causal, slots=None,
                         global_query=None, global_key=None, global_value=None,
                         key_mask=None, scale=None):
    """Longformer attention with every part in the block-sparse kernel: the
    (dilated) window per group of heads with one dilation, every query
    against the global keys (merged with the window by log-sum-exp), and
    the global rows (global queries against every key, with the global
    projections), written over the merged rows. Same arguments as
    :func:`keras_longattn.ops.longformer.longformer_attention`."""
    from keras_longattn.ops import longformer as la_longformer

    T, S = query.shape[1], key.shape[1]
    B, H = query.shape[0], query.shape[2]
    if scale is None:
        scale = 1.0 / float(query.shape[3]) ** 0.5
    look_back, look_ahead = la_longformer.window_extents(window, causal)
    local_keys = _key_valid(key_mask)
    subset_predicate = la_patterns.CausalPattern() if causal else None
    if slots is not None:
        G = slots.positions.shape[1]
        positions = ops.broadcast_to(ops.convert_to_tensor(slots.positions), (B, G))
        q_valid = ops.broadcast_to(ops.convert_to_tensor(slots.query_valid), (B, G))
        k_valid = ops.broadcast_to(ops.convert_to_tensor(slots.key_valid), (B, G))
        if local_keys is not None:  # a padded global key is no key at all
            k_valid = ops.logical_and(k_valid, ops.take_along_axis(
                local_keys, ops.clip(positions, 0, S - 1), axis=1))
        hot_k = la_longformer.slot_matrix(positions, k_valid, S)  # (B, G, S)
        not_global = ops.logical_not(ops.any(hot_k, axis=1))
        local_keys = not_global if local_keys is None else ops.logical_and(local_keys,
                                                                           not_global)

    b = la_layouts.default_block(max(T, S))
    groups = {}
    for h, r in enumerate(dilations):
        groups.setdefault(int(r), []).append(h)
    outs, lses, order = [], [], []
    for r, heads in groups.items():
        idx = np.asarray(heads)
        pick = (lambda x: x) if len(heads) == H else (lambda x, idx=idx: ops.take(x, idx, axis=2))
        arranged = la_layouts.dilated_arrangement(T, S, r, look_back, look_ahead, b)
        out, lse = arranged_attention(
            pick(query), pick(key), pick(value), arranged,
            la_patterns.DilatedPattern(look_back, look_ahead, r), local_keys, scale)
        outs.append(out)
        lses.append(lse)
        order.extend(heads)
    out, lse = outs[0], lses[0]
    if len(outs) > 1:
        inverse = np.argsort(np.asarray(order))
        out = ops.take(ops.concatenate(outs, axis=2), inverse, axis=2)
        lse = ops.take(ops.concatenate(lses, axis=2), inverse, axis=2)
    if slots is None:
        return out

    # Every query against the global keys (positions per example), gathered
    # by index: (B, G, H, d).
    keys_g = la_longformer.gather_slots(key, positions, k_valid)
    values_g = la_longformer.gather_slots(value, positions, k_valid)
    bg = la_layouts.small_block(G)
    subset = attention(
        query, keys_g, values_g, la_layouts.all_pairs_layout(T, G, b, bg),
        predicate=subset_predicate, q_pos=None, k_pos=positions, k_valid=k_valid,
        scale=scale)
    out = la_reference.merge_attention_parts([(out, lse), subset])

    # The global rows: each global query against every key.
    if global_query is None:
        global_query = la_longformer.gather_slots(query, positions, q_valid)
    global_key = key if global_key is None else global_key
    global_value = value if global_value is None else global_value
    rows, _ = attention(
        global_query, global_key, global_value, la_layouts.all_pairs_layout(G, S, bg, b),
        predicate=subset_predicate, q_pos=positions, k_pos=None,
        k_valid=_key_valid(key_mask), scale=scale)
    # Written over the merged rows by index: (B, T, H, dv).
    return la_longformer.scatter_slots(rows, positions, q_valid, out)


# ------------------------------------------------------------------ Routing
class ClusterPattern(la_patterns.AttentionPattern):
    """Predicate of balanced clusters: a token's position is encoded as
    ``cluster * stride + position`` (``stride`` a power of two above every
    position, :func:`keras_longattn.ops.layouts.cluster_stride`); a query
    sees the keys of its own cluster (and, when ``causal``, only those at
    or before its position)."""

    def __init__(self, stride, causal):
        self.stride = int(stride)
        self.causal = bool(causal)
        self._shift = self.stride.bit_length() - 1

    def allowed(self, q_pos, k_pos):
        same = ops.equal(ops.right_shift(q_pos, self._shift),
                         ops.right_shift(k_pos, self._shift))
        if not self.causal:
            return same
        low = self.stride - 1
        return ops.logical_and(
            same, ops.less_equal(ops.bitwise_and(k_pos, low), ops.bitwise_and(q_pos, low)))

    def _fields(self):
        return {"stride": self.stride, "causal": self.causal}


#: The position stride of :class:`ClusterPattern` for a sequence length.
cluster_stride = la_layouts.cluster_stride


def cluster_attention(query, key, value, query_indices, key_indices, causal,
                      key_mask=None, scale=None):
    """Attention inside balanced clusters (dense blocks of gathered tokens),
    a query's output the mean over the clusters in which it sees a key, as
    :func:`keras_longattn.ops.routing.balanced_cluster_attention` without
    ``exclude_self``. ``query_indices`` ``(B, H, k, wq)`` and
    ``key_indices`` ``(B, H, k, wk)`` (per head: positions ride along with
    each gathered token)."""
    from keras_longattn.ops import segments as la_segments

    B, T, H = query.shape[:3]
    S = key.shape[1]
    k, wq = query_indices.shape[2], query_indices.shape[3]
    wk = key_indices.shape[3]
    stride = cluster_stride(max(T, S))

    def arrange(x, indices):  # (B, n, H, .) -> (B, k * w, H, .)
        g = la_segments.gather_tokens(x, indices)  # (B, H, k, w, .)
        g = ops.reshape(g, (B, H, -1, x.shape[3]))
        return ops.transpose(g, (0, 2, 1, 3))

    cluster = ops.reshape(ops.arange(k, dtype="int32") * stride, (1, 1, k, 1))
    q_pos = ops.reshape(ops.cast(query_indices, "int32") + cluster, (B, H, k * wq))
    k_pos = ops.reshape(ops.cast(key_indices, "int32") + cluster, (B, H, k * wk))
    valid = None
    if key_mask is not None:
        flags = la_segments.gather_flags(ops.expand_dims(key_mask, 1), key_indices)
        valid = ops.reshape(ops.greater(flags, 0), (B, H, k * wk))
    layout = la_layouts.cluster_layout(k, wq, wk, la_layouts.default_block(max(k * wq, k * wk)))
    out, lse = attention(
        arrange(query, query_indices), arrange(key, key_indices),
        arrange(value, key_indices), layout, predicate=ClusterPattern(stride, causal),
        q_pos=q_pos, k_pos=k_pos, k_valid=valid, scale=scale)
    out = ops.reshape(ops.transpose(out, (0, 2, 1, 3)), (B, H, k, wq, -1))
    seen = ops.reshape(ops.greater(ops.transpose(lse, (0, 2, 1)), MASKED_LOGIT / 2),
                       (B, H, k, wq))
    return la_segments.scatter_mean(out, query_indices, T, weights=seen)
