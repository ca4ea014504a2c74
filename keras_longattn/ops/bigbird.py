"""BigBird's block-sparse pattern (Zaheer et al. 2020) and its computation in
O(n * b * (w + g + r)) time and memory, never a ``(T, S)`` tensor.

The sequence is cut into blocks of ``b`` positions. Query block ``i`` attends
to key blocks:

* window: ``i - w // 2 .. i + w // 2`` (``w`` odd, 3 in the paper);
* global: ``0 .. g - 1``; and the queries of those ``g`` blocks attend to
  every key (global rows);
* random: ``r`` further blocks, neither window nor global, chosen by
  :func:`key_block_table`.

Causal mode ANDs everything with ``j <= i`` at the token level: the window
keeps the ``w // 2`` previous blocks and the diagonal block (masked inside),
random blocks are drawn among the blocks before the window only, a global
key block is seen by the queries at or after it and a global row is a
causal full-attention row.

Random blocks are data, not state: candidate key block ``j`` of query block
``i`` gets the integer score :func:`block_scores` ``(seed, i, j)``, a hash
computed inside the graph (32-bit integer arithmetic, identical on every
backend), and the ``r`` best-scoring candidates among the blocks in use
are taken. A score depends on ``(seed, i, j)`` only, never on the length,
so the blocks are computed in the graph for lengths unknown while tracing
(TensorFlow retracing with ``None`` lengths). The blocks in use are those
up to the last real (unpadded) key of the example, so the random blocks of
an example are a deterministic function of ``(seed, its number of
blocks)``: the same alone or padded in a batch. Blocks that cannot be
filled (fewer candidates than ``r``, e.g. on short inputs) stay empty;
short inputs take the same path.

Shape legend: B batch, T query length, S key length, H heads, d key/query
head size, dv value head size, b block size, nq / nk query / key blocks,
K key blocks per query block (``w' + g + r``), C = K * b keys per block.
"""

import math
import numbers

import numpy as np
from keras import ops

from keras_longattn._validation import non_negative_int
from keras_longattn._validation import positive_int
from keras_longattn.kernels import compiled
from keras_longattn.ops.blocked import fused_blocks
from keras_longattn.ops.blocked import pad_axis
from keras_longattn.ops.fused import fused_dot_product_attention
from keras_longattn.ops.patterns import AttentionPattern
from keras_longattn.ops.reference import masked_softmax
from keras_longattn.ops.reference import reference_attention
from keras_longattn.ops.segments import take_rows
from keras_longattn.ops.shapes import ceil_div
from keras_longattn.ops.shapes import is_static
from keras_longattn.ops.shapes import larger
from keras_longattn.ops.shapes import length
from keras_longattn.ops.shapes import smaller


# ------------------------------------------------------------- arguments
def check_window_blocks(window_blocks):
    """``window_blocks`` as a positive odd int (a window centred on the
    query block), or a ValueError naming it."""
    if (
        isinstance(window_blocks, bool)
        or not isinstance(window_blocks, numbers.Integral)
        or window_blocks < 1
        or window_blocks % 2 == 0
    ):
        raise ValueError(
            "`window_blocks` must be a positive odd integer (the query block "
            "and as many blocks on each side). Received: "
            f"window_blocks={window_blocks!r}"
        )
    return int(window_blocks)


def check_seed(seed):
    """``seed`` as a non-negative int, or a ValueError naming it."""
    return non_negative_int("seed", seed)


def check_arguments(block_size, window_blocks, global_blocks, random_blocks, seed):
    """All BigBird arguments checked (each error names its argument)."""
    return (
        positive_int("block_size", block_size),
        check_window_blocks(window_blocks),
        non_negative_int("global_blocks", global_blocks),
        non_negative_int("random_blocks", random_blocks),
        check_seed(seed),
    )


# ----------------------------------------------------------- the pattern
#: Multipliers of the score hash (:func:`block_scores`), as signed int32.
_HASH_SEED, _HASH_I, _HASH_J = -1640531535, -2048144777, -1028477379
_HASH_M1, _HASH_M2 = -2048144789, -1028477387
#: A score is ``(hash & 0x3FFF) * 2**17 + j``: unique per query block for
#: up to 2**17 key blocks, and below 2**31.
_HASH_BITS, _J_BITS = 0x3FFF, 17


def _int32(value):
    """A Python int wrapped to the signed int32 range."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def block_scores(seed, query_blocks, key_blocks):
    """Int32 scores of key blocks ``key_blocks`` (int32 ``(nk,)``) as
    random-block candidates of query blocks ``query_blocks`` (int32
    ``(nq,)``): ``(nq, nk)``, non-negative, distinct within a row.

    A hash of ``(seed, i, j)`` in wrapping int32 arithmetic (multiplies,
    xors and arithmetic right shifts, which every backend computes alike):
    ``h = seed * A ^ i * B ^ j * C``, then ``h ^= h >> 16; h *= M1;
    h ^= h >> 13; h *= M2; h ^= h >> 16``, and the score
    ``(h & 0x3FFF) * 2**17 + j``. Lengths may be unknown while tracing.
    """
    seed_term = _int32(int(seed) * (_HASH_SEED & 0xFFFFFFFF))
    i = ops.cast(query_blocks, "int32")[:, None]
    j = ops.cast(key_blocks, "int32")[None, :]

    def const(v):
        return ops.convert_to_tensor(np.int32(v))

    h = ops.bitwise_xor(ops.multiply(i, const(_HASH_I)), ops.multiply(j, const(_HASH_J)))
    h = ops.bitwise_xor(h, const(seed_term))
    h = ops.bitwise_xor(h, ops.right_shift(h, const(16)))
    h = ops.multiply(h, const(_HASH_M1))
    h = ops.bitwise_xor(h, ops.right_shift(h, const(13)))
    h = ops.multiply(h, const(_HASH_M2))
    h = ops.bitwise_xor(h, ops.right_shift(h, const(16)))
    h = ops.bitwise_and(h, const(_HASH_BITS))
    return ops.add(ops.left_shift(h, const(_J_BITS)), j)


def window_offsets(window_blocks, causal):
    """Key-block offsets of the window: ``-w//2 .. w//2`` (``.. 0`` when
    causal)."""
    half = check_window_blocks(window_blocks) // 2
    return tuple(range(-half, 1 if causal else half + 1))


def used_key_blocks(key_mask, key_length, block_size):
    """Int32 ``(B,)`` (or ``(1,)`` without a mask): the key blocks up to the
    last real key of each example. ``key_length`` may be a tensor."""
    b = int(block_size)
    if key_mask is None:
        return ops.reshape(ops.cast(ceil_div(key_length, b), "int32"), (1,))
    pos = ops.arange(1, key_length + 1, dtype="int32")
    last = ops.max(ops.where(ops.cast(key_mask, "bool"), pos[None, :], 0), axis=1)
    return ops.cast((last + b - 1) // b, "int32")


def key_block_table(num_query_blocks, num_key_blocks, used_blocks, window_blocks,
                    global_blocks, random_blocks, seed, causal, query_blocks=None):
    """The key blocks each query block attends to, without duplicates.

    Args:
        num_query_blocks: ``nq`` (an int, or a scalar tensor while tracing
            with unknown lengths).
        num_key_blocks: ``nk`` (likewise).
        used_blocks: int32 ``(B or 1,)``, the key blocks in use per example
            (:func:`used_key_blocks`): random blocks are drawn among them.
        window_blocks, global_blocks, random_blocks, seed, causal: the
            pattern (see the module docstring).
        query_blocks: optional int32 ``(R,)``: the rows of these query
            blocks only (``R`` rows instead of ``nq``; a row depends on its
            block index, not on the others).

    Returns:
        ``(table, valid)``: int32 ``(B or 1, nq, K)`` key-block indices
        (window, then global, then random) and boolean ``(B or 1, nq, K)``:
        whether the entry is a block to attend (False for blocks outside
        the sequence, window blocks that are global, and random slots with
        no candidate left). The global rows (every key for the queries of
        the first ``g`` blocks) are not in the table.
    """
    nq, nk = num_query_blocks, num_key_blocks
    g = int(global_blocks)
    offsets = window_offsets(window_blocks, causal)
    half = int(window_blocks) // 2
    rows = ops.arange(nq, dtype="int32") if query_blocks is None else ops.cast(
        query_blocks, "int32")
    nq = nq if query_blocks is None else query_blocks.shape[0]
    i = rows[:, None]  # (nq, 1)
    win = i + ops.convert_to_tensor(np.asarray(offsets, "int32"))[None, :]  # (nq, w')
    win_ok = ops.logical_and(ops.logical_and(win >= 0, win < nk), win >= g)
    glob = ops.broadcast_to(ops.arange(g, dtype="int32")[None, :], (nq, g))
    glob_ok = glob < nk
    table = ops.clip(ops.concatenate([win, glob], axis=1), 0, larger(nk - 1, 0))[None]
    valid = ops.concatenate([win_ok, glob_ok], axis=1)[None]
    r = int(random_blocks)
    if r == 0 or (is_static(nq) and int(nq) == 0):
        return table, valid
    j = ops.arange(nk, dtype="int32")[None, :]  # (1, nk)
    if causal:
        candidate = ops.logical_and(j >= g, j < i - half)
    else:
        candidate = ops.logical_and(j >= g, ops.abs(j - i) > half)  # (nq, nk)
    used = ops.reshape(ops.cast(used_blocks, "int32"), (-1, 1, 1))
    candidate = ops.logical_and(candidate[None], j[None] < used)  # (B or 1, nq, nk)
    scores = block_scores(seed, rows, ops.arange(nk, dtype="int32"))
    scores = ops.where(candidate, scores[None], -1)
    # At least r columns, so that top_k is defined on short inputs.
    scores = pad_axis(scores, 2, larger(nk, r), value=-1)
    best, chosen = ops.top_k(scores, r, sorted=True)
    rand_ok = best >= 0
    chosen = ops.where(rand_ok, ops.cast(chosen, "int32"), 0)
    batch = ops.shape(chosen)[0]
    table = ops.concatenate(
        [ops.broadcast_to(table, (batch, nq, table.shape[2])), chosen], axis=2)
    valid = ops.concatenate(
        [ops.broadcast_to(valid, (batch, nq, valid.shape[2])), rand_ok], axis=2)
    return table, valid


def block_mask(num_query_blocks, num_key_blocks, used_blocks, window_blocks,
               global_blocks, random_blocks, seed, causal, query_blocks=None):
    """Boolean ``(B or 1, nq, nk)``: which key blocks each query block sees
    (the table of :func:`key_block_table` plus the global rows); with
    ``query_blocks`` (int32 ``(R,)``) the rows of those blocks only."""
    nq, nk = int(num_query_blocks), int(num_key_blocks)
    table, valid = key_block_table(nq, nk, used_blocks, window_blocks,
                                   global_blocks, random_blocks, seed, causal,
                                   query_blocks=query_blocks)
    k = ops.arange(nk, dtype="int32")
    hit = ops.logical_and(ops.equal(table[..., None], k), valid[..., None])
    mask = ops.any(hit, axis=2)  # (B or 1, nq, nk)
    if query_blocks is None:
        is_global_row = ops.convert_to_tensor(np.arange(nq) < int(global_blocks))
    else:
        is_global_row = ops.cast(query_blocks, "int32") < int(global_blocks)
    return ops.logical_or(mask, is_global_row[None, :, None])


def dense_mask(query_length, key_length, block_size, window_blocks, global_blocks,
               random_blocks, seed, causal, key_mask=None):
    """Boolean ``(B or 1, T, S)``: the pattern at the token level (the
    reference's mask, O(T * S)); random blocks per example when
    ``key_mask`` is given (see the module docstring). Key padding itself is
    not applied."""
    T, S, b = int(query_length), int(key_length), int(block_size)
    nq, nk = -(-T // b), -(-S // b)
    used = used_key_blocks(key_mask, S, b)
    blocks = block_mask(nq, nk, used, window_blocks, global_blocks, random_blocks,
                        seed, causal)
    mask = ops.repeat(ops.repeat(blocks, b, axis=1), b, axis=2)[:, :T, :S]
    if causal:
        causal_mask = np.tril(np.ones((T, S), bool))
        mask = ops.logical_and(mask, ops.convert_to_tensor(causal_mask)[None])
    return mask


class BigBirdPattern(AttentionPattern):
    """BigBird's block pattern for sequences of given lengths (window,
    global and random blocks; see :mod:`keras_longattn.ops.bigbird`).

    The random blocks depend on the number of key blocks, so the pattern
    is made for one ``(query_length, key_length)``; :meth:`allowed` is
    meant for positions inside them.

    Args:
        block_size: ``b``.
        window_blocks: ``w``, odd.
        global_blocks: ``g``.
        random_blocks: ``r``.
        seed: the seed of the random blocks.
        causal: whether query ``i`` only sees keys ``j <= i``.
        query_length: T.
        key_length: S.
    """

    def __init__(self, block_size, window_blocks, global_blocks, random_blocks,
                 seed, causal, query_length, key_length):
        (self.block_size, self.window_blocks, self.global_blocks,
         self.random_blocks, self.seed) = check_arguments(
            block_size, window_blocks, global_blocks, random_blocks, seed)
        self.causal = bool(causal)
        self.query_length = non_negative_int("query_length", query_length)
        self.key_length = non_negative_int("key_length", key_length)

    @property
    def is_causal(self):
        return self.causal

    def block_mask(self):
        """Numpy boolean ``(nq, nk)``: the key blocks of each query block."""
        b = self.block_size
        nq, nk = -(-self.query_length // b), -(-self.key_length // b)
        m = block_mask(nq, nk, -(-self.key_length // b), self.window_blocks,
                       self.global_blocks, self.random_blocks, self.seed, self.causal)
        return ops.convert_to_numpy(m[0])

    def allowed(self, q_pos, k_pos):
        b = self.block_size
        nq, nk = -(-self.query_length // b), -(-self.key_length // b)
        qb, kb = ops.floor_divide(q_pos, b), ops.floor_divide(k_pos, b)
        if len(q_pos.shape) == 2 and q_pos.shape[1] == 1 and len(k_pos.shape) == 2 and (
                k_pos.shape[0] == 1) and q_pos.shape[0] is not None:
            # A column of queries against a row of keys (decoding): only the
            # rows of their query blocks.
            rows = ops.clip(qb[:, 0], 0, max(nq - 1, 0))
            blocks = block_mask(nq, nk, nk, self.window_blocks, self.global_blocks,
                                self.random_blocks, self.seed, self.causal,
                                query_blocks=rows)[0]  # (T, nk)
            inside = ops.logical_and(
                ops.logical_and(qb >= 0, qb < nq), ops.logical_and(kb >= 0, kb < nk))
            picked = ops.take(blocks, ops.clip(kb[0], 0, max(nk - 1, 0)), axis=1)  # (T, S)
            result = ops.logical_and(inside, picked)
            if self.causal:
                result = ops.logical_and(result, ops.less_equal(k_pos, q_pos))
            return result
        # The block mask as a tensor (not through NumPy), so that a compiled
        # function may build it.
        blocks = block_mask(nq, nk, nk, self.window_blocks, self.global_blocks,
                            self.random_blocks, self.seed, self.causal)[0]
        flat = ops.reshape(blocks, (-1,))
        inside = ops.logical_and(
            ops.logical_and(qb >= 0, qb < nq), ops.logical_and(kb >= 0, kb < nk))
        index = ops.clip(qb, 0, max(nq - 1, 0)) * nk + ops.clip(kb, 0, max(nk - 1, 0))
        result = ops.logical_and(inside, ops.take(flat, index))
        if self.causal:
            result = ops.logical_and(result, ops.less_equal(k_pos, q_pos))
        return result

    def _fields(self):
        return {
            "block_size": self.block_size,
            "window_blocks": self.window_blocks,
            "global_blocks": self.global_blocks,
            "random_blocks": self.random_blocks,
            "seed": self.seed,
            "causal": self.causal,
            "query_length": self.query_length,
            "key_length": self.key_length,
        }


# ------------------------------------------------------------ computation
@compiled(("block_size", "window_blocks", "global_blocks", "random_blocks", "seed",
           "causal", "scale", "dropout_fn", "fused"))
def bigbird_attention(
    query,
    key,
    value,
    block_size,
    window_blocks=3,
    global_blocks=2,
    random_blocks=3,
    seed=0,
    causal=False,
    key_mask=None,
    scale=None,
    dropout_fn=None,
    fused=False,
):
    """BigBird block-sparse attention in O(n * b * (w + g + r)).

    Equal to dense attention under :func:`dense_mask` (the specification,
    checked by the tests). Each query block gathers its ``K`` key blocks
    (one row gather of whole blocks) and attends to them in one softmax;
    the queries of the ``g`` global blocks attend to every key.

    Args:
        query: ``(B, T, H, d)``; ``T`` may be unknown while tracing.
        key: ``(B, S, H, d)``; likewise ``S``.
        value: ``(B, S, H, dv)``.
        block_size: ``b``.
        window_blocks: ``w``, odd. Defaults to 3.
        global_blocks: ``g``. Defaults to 2.
        random_blocks: ``r``. Defaults to 3.
        seed: seed of the random blocks. Defaults to 0.
        causal: whether query ``i`` only sees keys ``j <= i``.
        key_mask: optional boolean ``(B, S)``; False marks padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights
            (not with ``fused=True``).
        fused: compute the blocks and the global rows with
            :func:`keras_longattn.ops.fused_dot_product_attention`; no
            dropout.

    Returns:
        ``(B, T, H, dv)``. Queries with no visible key get zeros.
    """
    if fused and dropout_fn is not None:
        raise ValueError("`fused=True` does not support attention dropout.")
    b, w, g, r, seed = check_arguments(block_size, window_blocks, global_blocks,
                                       random_blocks, seed)
    T, S = length(query, 1), length(key, 1)  # tensors when unknown
    H, d = query.shape[2], query.shape[3]
    dv = value.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    nq, nk = ceil_div(T, b), ceil_div(S, b)
    batch = ops.shape(query)[0]
    km = None if key_mask is None else ops.cast(key_mask, "bool")
    table, valid = key_block_table(nq, nk, used_key_blocks(km, S, b), w, g, r, seed,
                                   causal)
    K = table.shape[2]
    table = ops.broadcast_to(table, (batch, nq, K))
    valid = ops.broadcast_to(valid, (batch, nq, K))

    q = pad_axis(ops.multiply(query, ops.cast(scale, query.dtype)), 1, nq * b)
    q = ops.reshape(q, (-1, nq, b, H, d))
    keys = ops.reshape(pad_axis(key, 1, nk * b), (-1, b * H * d))  # (B * nk, .)
    values = ops.reshape(pad_axis(value, 1, nk * b), (-1, b * H * dv))
    key_ok = ops.arange(nk * b, dtype="int32")[None, :] < S  # (1, nk * b)
    if km is not None:
        key_ok = ops.logical_and(key_ok, pad_axis(km, 1, nk * b, value=False))
    key_ok = ops.reshape(ops.broadcast_to(key_ok, (batch, nk * b)), (-1, b))

    # One gather of whole blocks: row e * nk + j is block j of example e.
    rows = ops.reshape(
        ops.arange(batch, dtype="int32")[:, None, None] * nk + table, (-1,))
    kg = ops.reshape(take_rows(keys, rows), (-1, nq, K * b, H, d))
    vg = ops.reshape(take_rows(values, rows), (-1, nq, K * b, H, dv))
    ok = ops.reshape(ops.take(key_ok, rows, axis=0), (-1, nq, K, b))
    ok = ops.logical_and(ok, valid[..., None])
    mask = ops.reshape(ok, (-1, nq, 1, K * b))  # (B, nq, 1, C)
    if causal:
        k_pos = ops.reshape(table[..., None] * b + ops.arange(b, dtype="int32"),
                            (-1, nq, 1, K * b))
        q_pos = ops.reshape(ops.arange(nq * b, dtype="int32"), (1, nq, b, 1))
        mask = ops.logical_and(mask, k_pos <= q_pos)  # (B, nq, b, C)
    mask = ops.broadcast_to(mask, (batch, nq, b, K * b))

    if fused:
        out = fused_blocks(q, kg, vg, mask, scale=1.0)
    else:
        # (B, nq, b, H, d) x (B, nq, C, H, d) -> (B, nq, H, b, C)
        scores = ops.einsum("bnqhd,bnkhd->bnhqk", q, kg)
        probs = masked_softmax(scores, mask[:, :, None], axis=-1)
        if dropout_fn is not None:
            probs = dropout_fn(probs)
        # (B, nq, H, b, C) x (B, nq, C, H, dv) -> (B, nq, b, H, dv)
        out = ops.einsum("bnhqk,bnkhd->bnqhd", probs, vg)
    out = ops.reshape(out, (-1, nq * b, H, dv))[:, :T]

    if g == 0 or (is_static(T) and T == 0):
        return out
    # The global rows: the queries of the first g blocks against every key.
    rows_g = smaller(T, g * b)
    visible = ops.ones((1, 1, 1, 1), dtype="bool")
    if km is not None:
        visible = ops.logical_and(visible, km[:, None, None, :])
    if causal:
        lower = (ops.arange(rows_g, dtype="int32")[:, None]
                 >= ops.arange(S, dtype="int32")[None, :])
        visible = ops.logical_and(visible, lower[None, None])
    if fused:
        top = fused_dot_product_attention(query[:, :rows_g], key, value,
                                          mask=visible, scale=scale)
    else:
        top = reference_attention(query[:, :rows_g], key, value, mask=visible,
                                  scale=scale, dropout_fn=dropout_fn)
    return ops.concatenate([ops.cast(top, out.dtype), out[:, rows_g:]], axis=1)
