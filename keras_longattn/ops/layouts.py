"""Block layouts of block-sparse attention: which ``(query block, key
block)`` tiles a kernel visits, and the token arrangements that make a
pattern's allowed pairs fall in few tiles.

A layout is coarse (blocks that may hold an allowed pair); the kernel's
element-level predicate is exact, so a layout that lists more blocks than
needed costs time, never correctness. Layouts are built with NumPy where
they depend only on static shapes (cached per shape), and with
``keras.ops`` where they depend on the data (:meth:`BlockLayout.from_block_mask`
of a tensor, e.g. BigBird's per-example random blocks).

The kernel (:mod:`keras_longattn.kernels.jax.pallas_attention`, reached
through :mod:`keras_longattn.ops.block_sparse`) takes a layout as its
arrays ``rows`` and ``cols`` and its block sizes.

Arrangements (tokens keep their original positions, so a predicate keeps
meaning what it means in the dense reference):

* band (local attention, strided A): tokens in order, a band of blocks;
* columns (strided B: ``(i - j) mod l == 0``): tokens sorted by
  ``position mod l``, then position; a column is a contiguous run;
* own block (fixed A): tokens in order, groups of ``l``;
* summary keys (fixed B): every query in order against only the keys in
  the last ``c`` cells of each block;
* dilated windows: per dilation ``r``, tokens sorted by ``position mod r``
  (a band on each residue);
* clusters: each head's tokens gathered cluster by cluster.

Shape legend: T query length, S key length, b block size, nq / nk number
of query / key blocks, M width of a layout row, L layouts (1 or the batch),
l stride / block length, c summary width.
"""

import dataclasses
import functools

import numpy as np
from keras import ops

from keras_longattn.kernels.arrangements import column_order
from keras_longattn.kernels.arrangements import every_tile  # noqa: F401 (part of this module's API)

#: Largest kernel block (GPU/TPU tiles of 128 rows).
MAX_BLOCK = 128
#: Smallest kernel block.
MIN_BLOCK = 16


def next_power_of_2(n):
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def default_block(length):
    """Kernel block size for sequences of ``length``: a power of two in
    ``[16, 128]``, about an eighth of the length (so short sequences still
    have several blocks)."""
    b = next_power_of_2(max(1, -(-int(length) // 8)))
    return int(min(MAX_BLOCK, max(MIN_BLOCK, b)))


def small_block(n):
    """Kernel block for ``n`` tokens that are all visited (global slots)."""
    return int(min(MAX_BLOCK, max(MIN_BLOCK, next_power_of_2(max(1, int(n))))))


# ----------------------------------------------------------------- layouts
@dataclasses.dataclass(frozen=True, eq=False)
class BlockLayout:
    """Which key blocks each query block visits, and the transpose.

    Attributes:
        rows: int32 ``(L, nq, M)``: row ``i`` of batch entry ``e`` is
            ``[count, kb_0, kb_1, ...]``, the number of key blocks query
            block ``i`` visits, then their indices (increasing; the tail
            repeats the last one). ``L`` is 1 (one layout for the batch)
            or B.
        cols: int32 ``(L, nk, M')``: the same for each key block and the
            query blocks that visit it (for the ``dk``/``dv`` pass).
        block_q: query block size.
        block_k: key block size.
    """

    rows: object
    cols: object
    block_q: int
    block_k: int

    @property
    def num_query_blocks(self):
        return int(self.rows.shape[1])

    @property
    def num_key_blocks(self):
        return int(self.cols.shape[1])

    @classmethod
    def from_pairs(cls, q_blocks, k_blocks, num_q_blocks, num_k_blocks, block_q,
                   block_k):
        """A static layout from NumPy arrays of visited ``(query block, key
        block)`` pairs (duplicates allowed)."""
        q_blocks = np.asarray(q_blocks, np.int64).reshape(-1)
        k_blocks = np.asarray(k_blocks, np.int64).reshape(-1)
        nq, nk = int(num_q_blocks), int(num_k_blocks)
        flat = np.unique(q_blocks * nk + k_blocks)
        qb, kb = flat // nk, flat % nk
        rows = _table_from_sorted_pairs(qb, kb, nq)
        order = np.lexsort((qb, kb))
        cols = _table_from_sorted_pairs(kb[order], qb[order], nk)
        return cls(rows[None], cols[None], int(block_q), int(block_k))

    @classmethod
    def from_block_mask(cls, mask, block_q, block_k):
        """A layout from a boolean block mask ``(nq, nk)`` or ``(L, nq, nk)``
        (NumPy with one layout: a static layout; a tensor: computed with
        ``keras.ops``, e.g. per example, rows as wide as ``nk`` allows).
        Block-level only: ``nq * nk`` entries, never tokens."""
        if isinstance(mask, np.ndarray):
            mask = mask if mask.ndim == 3 else mask[None]
            if mask.shape[0] == 1:
                return cls.from_pairs(*np.nonzero(mask[0]), mask.shape[1], mask.shape[2],
                                      block_q, block_k)
        mask = ops.cast(mask, "bool")
        if len(mask.shape) == 2:
            mask = ops.expand_dims(mask, 0)
        rows = _table_from_mask(mask)
        cols = _table_from_mask(ops.swapaxes(mask, 1, 2))
        return cls(rows, cols, int(block_q), int(block_k))

    def block_mask(self):
        """The layout as a NumPy boolean ``(L, nq, nk)`` (for tests)."""
        rows = np.asarray(ops.convert_to_numpy(self.rows))
        out = np.zeros((rows.shape[0], rows.shape[1], self.num_key_blocks), bool)
        for e in range(rows.shape[0]):
            for i in range(rows.shape[1]):
                count = rows[e, i, 0]
                out[e, i, rows[e, i, 1:1 + count]] = True
        return out


def _row_width(max_count):
    """Width of a layout row: count + entries, a power of two."""
    return next_power_of_2(int(max_count) + 1)


def _table_from_sorted_pairs(major, minor, n_major):
    """``(n_major, M)`` rows ``[count, minor...]`` from pairs sorted by
    ``(major, minor)``."""
    counts = np.bincount(major, minlength=n_major).astype(np.int64)
    width = _row_width(counts.max() if counts.size else 0)
    table = np.zeros((n_major, width), np.int32)
    table[:, 0] = counts
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(major.size) - np.repeat(starts, counts)
    table[major, 1 + slot] = minor
    # Padding repeats the last visited block (no extra block fetch where a
    # pipeline prefetches the next entry).
    for i in np.flatnonzero(counts):
        table[i, 1 + counts[i]:] = table[i, counts[i]]
    return table


def _table_from_mask(mask):
    """int32 ``(L, n, M)`` rows from a boolean ``(L, n, m)`` tensor."""
    m = mask.shape[2]
    counts = ops.sum(ops.cast(mask, "int32"), axis=2)
    # Visited indices first, in increasing order: every sort key is
    # distinct, so the order needs no stable sort.
    slots = ops.arange(m, dtype="int32")
    order = ops.cast(ops.argsort(ops.where(mask, slots, slots + m), axis=2), "int32")
    width = _row_width(m)
    pad = width - 1 - m
    last = ops.take_along_axis(order, ops.expand_dims(ops.maximum(counts - 1, 0), -1), axis=2)
    order = ops.where(slots < ops.expand_dims(counts, -1), order, last)
    if pad:
        tail = ops.broadcast_to(last, tuple(order.shape[:2]) + (pad,))
        order = ops.concatenate([order, tail], axis=2)
    return ops.concatenate([ops.expand_dims(counts, -1), order], axis=2)


def segment_pairs(q_group, q_pos, k_group, k_pos, block_q, block_k, look_back=None,
                  look_ahead=None):
    """The visited ``(query block, key block)`` pairs of a static
    arrangement of tokens, as NumPy arrays.

    Each token of the (arranged, padded) query and key sequences has a
    group id (``-1``: padding, never visited) and a position. Query block
    ``i`` visits key block ``j`` when they hold tokens of a common group
    whose positions can be within ``look_back`` before / ``look_ahead``
    after each other (None: unbounded). Within a group, positions must
    increase along the arrangement. The result is a superset of the block
    pairs that hold an allowed pair of any predicate that only allows
    pairs of one group within those extents: the kernel's predicate is
    exact, so a superset costs time, never correctness.
    """
    qs = _segments(np.asarray(q_group), np.asarray(q_pos), block_q)
    ks = _segments(np.asarray(k_group), np.asarray(k_pos), block_k)
    if qs[0].size == 0 or ks[0].size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    q_blk, q_grp, q_min, q_max = qs
    k_blk, k_grp, k_min, k_max = ks
    order = np.lexsort((k_min, k_grp))
    k_blk, k_grp, k_min, k_max = (a[order] for a in (k_blk, k_grp, k_min, k_max))
    if np.any(np.diff(k_max)[np.diff(k_grp) == 0] < 0):
        raise ValueError("positions must increase within each group of the arrangement")
    span = 1 << 40
    off = 1 << 39

    def key(group, pos):
        return group.astype(np.int64) * span + np.clip(pos.astype(np.int64) + off, 0, span - 1)

    low = q_min - (off if look_back is None else int(look_back))
    high = q_max + (off if look_ahead is None else int(look_ahead))
    lo = np.searchsorted(key(k_grp, k_max), key(q_grp, low), side="left")
    hi = np.searchsorted(key(k_grp, k_min), key(q_grp, high), side="right")
    counts = np.maximum(hi - lo, 0)
    q_out = np.repeat(q_blk, counts)
    idx = np.repeat(lo - np.cumsum(np.concatenate([[0], counts[:-1]])), counts)
    idx = idx + np.arange(counts.sum())
    return q_out, k_blk[idx]


def _segments(group, pos, block):
    """Runs of one group inside one block: ``(block, group, min, max)``."""
    n = group.size
    blk = np.arange(n) // block
    change = np.ones(n, bool)
    change[1:] = (blk[1:] != blk[:-1]) | (group[1:] != group[:-1])
    starts = np.flatnonzero(change)
    if starts.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, empty
    seg_min = np.minimum.reduceat(pos, starts)
    seg_max = np.maximum.reduceat(pos, starts)
    keep = group[starts] >= 0
    return blk[starts][keep], group[starts][keep], seg_min[keep], seg_max[keep]


def band_layout(query_length, key_length, block_q, block_k, look_back=None,
                look_ahead=None, q_start=0, k_start=0):
    """The static layout of a band ``k_pos - q_pos in [-look_back,
    look_ahead]`` on positions in order (None: unbounded on that side)."""
    nq, nk = -(-int(query_length) // block_q), -(-int(key_length) // block_k)
    q_grp = _padded(np.zeros(query_length, np.int64), nq * block_q)
    k_grp = _padded(np.zeros(key_length, np.int64), nk * block_k)
    q_pos = np.arange(nq * block_q) + q_start
    k_pos = np.arange(nk * block_k) + k_start
    pairs = segment_pairs(q_grp, q_pos, k_grp, k_pos, block_q, block_k, look_back,
                          look_ahead)
    return BlockLayout.from_pairs(*pairs, nq, nk, block_q, block_k)


def _padded(group, total):
    out = np.full(total, -1, np.int64)
    out[: group.size] = group
    return out


# ----------------------------------------------------------- arrangements
@functools.lru_cache(maxsize=256)
def cached_band_layout(T, S, b, look_back, look_ahead):
    """:func:`band_layout` with square blocks of ``b``, cached per shape."""
    return band_layout(T, S, b, b, look_back, look_ahead)


@functools.lru_cache(maxsize=256)
def all_pairs_layout(T, S, bq, bk):
    """Every query block visits every key block (cached per shape)."""
    return band_layout(T, S, bq, bk, None, None)


def _column_order(n, l):
    """Positions ``0 .. n-1`` sorted by ``position mod l``, then position
    (:func:`keras_longattn.kernels.arrangements.column_order`, int64)."""
    return column_order(int(n), int(l)).astype(np.int64)


# ---------------------------------------------------- candidate tiles
def _tile_ids(tiles, nk):
    qb, kb = tiles
    return np.asarray(qb, np.int64) * nk + np.asarray(kb, np.int64)


def _from_ids(ids, nk):
    return ids // nk, ids % nk


def union_tiles(tile_sets, num_k, block):
    """The union of ``(qb, kb)`` tile sets (sorted, no duplicate)."""
    nk = max(1, -(-int(num_k) // block))
    ids = np.unique(np.concatenate([_tile_ids(t, nk) for t in tile_sets] or [np.zeros(0, np.int64)]))
    return _from_ids(ids, nk)


def intersect_tiles(tile_sets, num_k, block):
    """The intersection of ``(qb, kb)`` tile sets (sorted, no duplicate)."""
    nk = max(1, -(-int(num_k) // block))
    ids = None
    for tiles in tile_sets:
        own = np.unique(_tile_ids(tiles, nk))
        ids = own if ids is None else np.intersect1d(ids, own, assume_unique=True)
    return _from_ids(ids, nk)


def segment_tiles(q_group, q_positions, k_group, k_positions, block, look_back, look_ahead):
    """Candidate tiles of a pattern described by segments (see
    :meth:`keras_longattn.ops.patterns.AttentionPattern.segments`): pairs of
    one group within ``look_back`` / ``look_ahead`` positions, on arranged
    tokens (group ``-1``: never). Every tile when the keys' positions do not
    increase within a group along the arrangement (the search of
    :func:`segment_pairs` needs that order)."""
    q_group, k_group = np.asarray(q_group, np.int64), np.asarray(k_group, np.int64)
    q_positions = np.asarray(q_positions, np.int64)
    k_positions = np.asarray(k_positions, np.int64)
    try:
        return segment_pairs(q_group, q_positions, k_group, k_positions, block, block,
                             look_back, look_ahead)
    except ValueError:
        return every_tile(q_group.size, k_group.size, block)


def arranged_layout(q_order, q_group, k_order, k_group, b, look_back, look_ahead):
    """The layout (square blocks of ``b``) of arranged queries and keys:
    token ``i`` of the query arrangement is position ``q_order[i]`` of
    group ``q_group[i]`` (keys alike); see :func:`segment_pairs`."""
    nq, nk = -(-len(q_order) // b), -(-len(k_order) // b)
    pad_q, pad_k = nq * b - len(q_order), nk * b - len(k_order)
    q_group = np.concatenate([q_group, np.full(pad_q, -1)])
    k_group = np.concatenate([k_group, np.full(pad_k, -1)])
    q_pos = np.concatenate([q_order, np.zeros(pad_q, np.int64)])
    k_pos = np.concatenate([k_order, np.zeros(pad_k, np.int64)])
    pairs = segment_pairs(q_group, q_pos, k_group, k_pos, b, b, look_back, look_ahead)
    return BlockLayout.from_pairs(*pairs, nq, nk, b, b)


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
        layout = arranged_layout(q_order, q_order % l, k_order, k_order % l, b, None, ahead)
        return q_order, k_order, layout
    q_order = np.arange(T)
    if kind == "blocks":
        k_order = np.arange(S)
        layout = arranged_layout(q_order, q_order // l, k_order, k_order // l, b, None, ahead)
        return None, k_order, layout
    if kind == "summary":
        k_order = np.flatnonzero(np.arange(S) % l >= l - c)
        layout = arranged_layout(q_order, q_order * 0, k_order, k_order * 0, b, None, ahead)
        return None, k_order, layout
    raise ValueError(
        "`kind` must be 'columns', 'blocks' or 'summary'. "
        f"Received: kind={kind!r}")


@functools.lru_cache(maxsize=256)
def dilated_arrangement(T, S, dilation, look_back, look_ahead, b):
    """``(q_order, k_order, layout)`` of a window dilated by ``r``: tokens
    sorted by ``position mod r`` (then position), so that each residue is a
    contiguous plain band of ``look_back`` / ``look_ahead`` steps."""
    r = int(dilation)
    if r == 1:
        return None, np.arange(S), cached_band_layout(T, S, b, look_back, look_ahead)
    q_order, k_order = _column_order(T, r), _column_order(S, r)
    layout = arranged_layout(q_order, q_order % r, k_order, k_order % r, b,
                             look_back * r, look_ahead * r)
    return q_order, k_order, layout


@functools.lru_cache(maxsize=256)
def cluster_layout(k, wq, wk, b):
    """Cluster ``c`` holds arranged queries ``[c * wq, (c + 1) * wq)`` and
    keys ``[c * wk, (c + 1) * wk)``: the key blocks of its own clusters."""
    q, kk = np.arange(k * wq), np.arange(k * wk)
    return arranged_layout(q, q // wq, kk, kk // wk, b, None, None)


def cluster_stride(length):
    """The position stride of clustered tokens for sequences of ``length``
    (a power of two above every position, see
    :class:`keras_longattn.ops.block_sparse.ClusterPattern`)."""
    return next_power_of_2(int(length) + 1)
