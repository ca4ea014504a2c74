"""The ``implementation="pallas"`` paths of the block-sparse layers (JAX only).

Each function arranges the tokens of one layer's pattern so that the pairs
it allows fall in few ``(query block, key block)`` tiles, builds the block
layout of that arrangement (NumPy, cached per static shape; in the graph
where it depends on the data, as BigBird's random blocks do) and hands
both, with the layer's own pattern as the in-kernel predicate, to
:func:`keras_longattn.kernels.jax.pallas_attention.block_sparse_attention`.

Arrangements (tokens keep their original positions, so the predicate is
the very pattern of the dense reference):

* band (local attention, strided A): tokens in order, a band of blocks;
* columns (strided B: ``(i - j) mod l == 0``): tokens sorted by
  ``position mod l``, then position; a column is a contiguous run;
* own block (fixed A): tokens in order, groups of ``l``;
* summary keys (fixed B): every query in order against only the keys in
  the last ``c`` cells of each block;
* BigBird: tokens in order, the layer's own block mask per example;
* Longformer: per dilation ``r``, tokens sorted by ``position mod r`` (a
  band on each residue), plus the global keys and the global rows;
* Routing: each head's tokens gathered cluster by cluster, positions
  encoded as ``cluster * stride + position`` (:class:`ClusterPattern`).

Imported lazily by the layers, only on the JAX backend.

Shape legend: B batch, T query length, S key length, H heads, d head size,
b kernel block size, l stride / block length, c summary width.
"""

import functools

import jax.numpy as jnp
import numpy as np

from keras_longattn.kernels.jax import pallas_attention as pa
from keras_longattn.ops import patterns as la_patterns
from keras_longattn.ops import reference as la_reference
from keras_longattn.ops import sparse as la_sparse

#: Largest kernel block (GPU/TPU tiles of 128 rows).
MAX_BLOCK = 128
#: Smallest kernel block.
MIN_BLOCK = 16


def default_block(length):
    """Kernel block size for sequences of ``length``: a power of two in
    ``[16, 128]``, about an eighth of the length (so short sequences still
    have several blocks)."""
    b = int(pa.pl.next_power_of_2(max(1, -(-int(length) // 8))))
    return int(min(MAX_BLOCK, max(MIN_BLOCK, b)))


def _key_valid(key_mask):
    return None if key_mask is None else jnp.asarray(key_mask).astype(bool)


# ------------------------------------------------------------------- band
@functools.lru_cache(maxsize=256)
def _band_layout(T, S, b, look_back, look_ahead):
    return pa.band_layout(T, S, b, b, look_back, look_ahead)


def band_attention(query, key, value, look_back, look_ahead, key_mask=None, scale=None,
                   block=None, predicate=None, return_lse=False):
    """Query ``i`` against keys ``i - look_back .. i + look_ahead``.

    ``predicate`` (default: ``LocalPattern(look_back, look_ahead)``) may
    narrow the band further (e.g. a causal AND).
    """
    T, S = query.shape[1], key.shape[1]
    b = block or default_block(max(T, S))
    layout = _band_layout(T, S, b, look_back, look_ahead)
    if predicate is None:
        predicate = la_patterns.LocalPattern(look_back, look_ahead)
    out, lse = pa.block_sparse_attention(
        query, key, value, layout, predicate=predicate, k_valid=_key_valid(key_mask),
        scale=scale)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------- arrangements
def _column_order(n, l):
    """Positions ``0 .. n-1`` sorted by ``position mod l``, then position."""
    pos = np.arange(n)
    return pos[np.lexsort((pos, pos % l))]


def _layout(q_order, q_group, k_order, k_group, b, look_back, look_ahead):
    nq, nk = -(-len(q_order) // b), -(-len(k_order) // b)
    pad_q, pad_k = nq * b - len(q_order), nk * b - len(k_order)
    q_group = np.concatenate([q_group, np.full(pad_q, -1)])
    k_group = np.concatenate([k_group, np.full(pad_k, -1)])
    q_pos = np.concatenate([q_order, np.zeros(pad_q, np.int64)])
    k_pos = np.concatenate([k_order, np.zeros(pad_k, np.int64)])
    pairs = pa.segment_pairs(q_group, q_pos, k_group, k_pos, b, b, look_back, look_ahead)
    return pa.BlockLayout.from_pairs(*pairs, nq, nk, b, b)


@functools.lru_cache(maxsize=256)
def arrangement(kind, T, S, l, c, causal, b):
    """``(q_order, k_order, layout)`` of one Sparse Transformer part.

    ``q_order`` is a permutation of ``0 .. T-1`` (None: in order),
    ``k_order`` the key positions used, in their order, and ``layout`` the
    block layout of the arranged sequences. ``kind``: ``"columns"``
    (strided B), ``"blocks"`` (fixed A) or ``"summary"`` (fixed B).
    """
    ahead = 0 if causal else None
    if kind == "columns":
        q_order, k_order = _column_order(T, l), _column_order(S, l)
        layout = _layout(q_order, q_order % l, k_order, k_order % l, b, None, ahead)
        return q_order, k_order, layout
    q_order = np.arange(T)
    if kind == "blocks":
        k_order = np.arange(S)
        layout = _layout(q_order, q_order // l, k_order, k_order // l, b, None, ahead)
        return None, k_order, layout
    if kind == "summary":
        k_order = np.flatnonzero(np.arange(S) % l >= l - c)
        layout = _layout(q_order, q_order * 0, k_order, k_order * 0, b, None, ahead)
        return None, k_order, layout
    raise ValueError(f"unknown arrangement {kind!r}")


def arranged_attention(query, key, value, arranged, predicate, key_mask=None, scale=None):
    """Attention on reordered tokens (see :func:`arrangement`), returned in
    the original order: ``(out (B, T, H, dv), lse (B, T, H))``."""
    q_order, k_order, layout = arranged
    B, T, H = query.shape[:3]
    if len(k_order) == 0:
        out = jnp.zeros((B, T, H, value.shape[3]), query.dtype)
        return out, jnp.full((B, T, H), pa.MASKED_LOGIT, jnp.float32)
    q = query if q_order is None else jnp.take(query, q_order, axis=1)
    k = jnp.take(key, k_order, axis=1)
    v = jnp.take(value, k_order, axis=1)
    valid = _key_valid(key_mask)
    if valid is not None:
        valid = jnp.take(valid, k_order, axis=1)
    out, lse = pa.block_sparse_attention(
        q, k, v, layout, predicate=predicate,
        q_pos=None if q_order is None else q_order.astype(np.int32),
        k_pos=k_order.astype(np.int32), k_valid=valid, scale=scale)
    if q_order is not None:
        inverse = np.argsort(q_order)
        out = jnp.take(out, inverse, axis=1)
        lse = jnp.take(lse, inverse, axis=1)
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
    b = block or default_block(max(T, S))

    def part_a(q, k, v):
        if pattern == "strided":
            return band_attention(q, k, v, l - 1, 0 if causal else l - 1, key_mask,
                                  scale, b, predicate=first, return_lse=True)
        arranged = arrangement("blocks", T, S, l, c, causal, b)
        return arranged_attention(q, k, v, arranged, first, key_mask, scale)

    def part_b(q, k, v, predicate):
        kind = "columns" if pattern == "strided" else "summary"
        arranged = arrangement(kind, T, S, l, c, causal, b)
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
    return jnp.concatenate([out, rest], axis=2)


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
    layout = pa.BlockLayout.from_block_mask(jnp.asarray(mask), b, b)
    predicate = la_patterns.CausalPattern() if causal else None
    out, _ = pa.block_sparse_attention(query, key, value, layout, predicate=predicate,
                                       k_valid=valid, scale=scale)
    return out


# --------------------------------------------------------------- Longformer
@functools.lru_cache(maxsize=256)
def dilated_arrangement(T, S, dilation, look_back, look_ahead, b):
    """``(q_order, k_order, layout)`` of a window dilated by ``r``: tokens
    sorted by ``position mod r`` (then position), so that each residue is a
    contiguous plain band of ``look_back`` / ``look_ahead`` steps."""
    r = int(dilation)
    if r == 1:
        return None, np.arange(S), _band_layout(T, S, b, look_back, look_ahead)
    q_order, k_order = _column_order(T, r), _column_order(S, r)
    layout = _layout(q_order, q_order % r, k_order, k_order % r, b,
                     look_back * r, look_ahead * r)
    return q_order, k_order, layout


@functools.lru_cache(maxsize=256)
def _all_pairs(T, S, bq, bk):
    """Every query block visits every key block."""
    return pa.band_layout(T, S, bq, bk, None, None)


def _small_block(n):
    """Kernel block for ``n`` tokens that are all visited (global slots)."""
    return int(min(MAX_BLOCK, max(MIN_BLOCK, pa.pl.next_power_of_2(max(1, int(n))))))


def longformer_attention(query, key, value, window, dilations, causal, slots=None,
                         global_query=None, global_key=None, global_value=None,
                         key_mask=None, scale=None):
    """Longformer attention with every part in the Pallas kernel: the
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
        positions = jnp.broadcast_to(jnp.asarray(slots.positions), (B, slots.positions.shape[1]))
        G = positions.shape[1]
        q_valid = jnp.broadcast_to(jnp.asarray(slots.query_valid), (B, G))
        k_valid = jnp.broadcast_to(jnp.asarray(slots.key_valid), (B, G))
        if local_keys is not None:  # a padded global key is no key at all
            k_valid = jnp.logical_and(k_valid, jnp.take_along_axis(
                local_keys, jnp.clip(positions, 0, S - 1), axis=1))
        hot_k = jnp.asarray(la_longformer.slot_matrix(positions, k_valid, S))  # (B, G, S)
        not_global = jnp.logical_not(jnp.any(hot_k, axis=1))
        local_keys = not_global if local_keys is None else jnp.logical_and(local_keys, not_global)

    b = default_block(max(T, S))
    groups = {}
    for h, r in enumerate(dilations):
        groups.setdefault(int(r), []).append(h)
    outs, lses, order = [], [], []
    for r, heads in groups.items():
        idx = np.asarray(heads)
        pick = (lambda x: x) if len(heads) == H else (lambda x, idx=idx: jnp.take(x, idx, axis=2))
        arranged = dilated_arrangement(T, S, r, look_back, look_ahead, b)
        out, lse = arranged_attention(
            pick(query), pick(key), pick(value), arranged,
            la_patterns.DilatedPattern(look_back, look_ahead, r), local_keys, scale)
        outs.append(out)
        lses.append(lse)
        order.extend(heads)
    out, lse = outs[0], lses[0]
    if len(outs) > 1:
        inverse = np.argsort(np.asarray(order))
        out = jnp.take(jnp.concatenate(outs, axis=2), inverse, axis=2)
        lse = jnp.take(jnp.concatenate(lses, axis=2), inverse, axis=2)
    if slots is None:
        return out

    # Every query against the global keys (positions per example), gathered
    # by index: (B, G, H, d).
    keys_g = jnp.asarray(la_longformer.gather_slots(key, positions, k_valid))
    values_g = jnp.asarray(la_longformer.gather_slots(value, positions, k_valid))
    bg = _small_block(G)
    subset = pa.block_sparse_attention(
        query, keys_g, values_g, _all_pairs(T, G, b, bg), predicate=subset_predicate,
        q_pos=None, k_pos=positions, k_valid=k_valid, scale=scale)
    out = la_reference.merge_attention_parts([(out, lse), subset])

    # The global rows: each global query against every key.
    if global_query is None:
        global_query = jnp.asarray(la_longformer.gather_slots(query, positions, q_valid))
    global_key = key if global_key is None else global_key
    global_value = value if global_value is None else global_value
    rows, _ = pa.block_sparse_attention(
        global_query, global_key, global_value, _all_pairs(G, S, bg, b),
        predicate=subset_predicate, q_pos=positions, k_pos=None,
        k_valid=_key_valid(key_mask), scale=scale)
    # Written over the merged rows by index: (B, T, H, dv).
    return jnp.asarray(la_longformer.scatter_slots(rows, positions, q_valid, out))


# ------------------------------------------------------------------ Routing
class ClusterPattern:
    """In-kernel predicate of balanced clusters: a token's position is
    encoded as ``cluster * stride + position`` (``stride`` a power of two
    above every position); a query sees the keys of its own cluster (and,
    when ``causal``, only those at or before its position)."""

    def __init__(self, stride, causal):
        self.stride = int(stride)
        self.causal = bool(causal)
        self._shift = self.stride.bit_length() - 1

    def allowed(self, q_pos, k_pos):
        same = jnp.right_shift(q_pos, self._shift) == jnp.right_shift(k_pos, self._shift)
        if not self.causal:
            return same
        low = self.stride - 1
        return jnp.logical_and(same, jnp.bitwise_and(k_pos, low) <= jnp.bitwise_and(q_pos, low))

    def __eq__(self, other):
        return type(other) is ClusterPattern and (self.stride, self.causal) == (
            other.stride, other.causal)

    def __hash__(self):
        return hash(("ClusterPattern", self.stride, self.causal))


def cluster_stride(length):
    """The ``stride`` of :class:`ClusterPattern` for sequences of ``length``."""
    return int(pa.pl.next_power_of_2(int(length) + 1))


@functools.lru_cache(maxsize=256)
def _cluster_layout(k, wq, wk, b):
    """Cluster ``c`` holds arranged queries ``[c * wq, (c + 1) * wq)`` and
    keys ``[c * wk, (c + 1) * wk)``: the key blocks of its own clusters."""
    q, kk = np.arange(k * wq), np.arange(k * wk)
    return _layout(q, q // wq, kk, kk // wk, b, None, None)


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
        g = jnp.reshape(g, (B, H, -1, x.shape[3]))
        return jnp.transpose(g, (0, 2, 1, 3))

    cluster = (jnp.arange(k, dtype=jnp.int32) * stride)[None, None, :, None]
    q_pos = jnp.reshape(jnp.asarray(query_indices, jnp.int32) + cluster, (B, H, k * wq))
    k_pos = jnp.reshape(jnp.asarray(key_indices, jnp.int32) + cluster, (B, H, k * wk))
    valid = None
    if key_mask is not None:
        valid = la_segments.gather_flags(jnp.asarray(key_mask)[:, None], key_indices) > 0
        valid = jnp.reshape(valid, (B, H, k * wk))
    layout = _cluster_layout(k, wq, wk, default_block(max(k * wq, k * wk)))
    out, lse = pa.block_sparse_attention(
        arrange(query, query_indices), arrange(key, key_indices),
        arrange(value, key_indices), layout, predicate=ClusterPattern(stride, causal),
        q_pos=q_pos, k_pos=k_pos, k_valid=valid, scale=scale)
    out = jnp.reshape(jnp.transpose(out, (0, 2, 1, 3)), (B, H, k, wq, -1))
    seen = jnp.reshape(jnp.transpose(lse, (0, 2, 1)) > pa.MASKED_LOGIT / 2, (B, H, k, wq))
    return la_segments.scatter_mean(out, query_indices, T, weights=seen)
