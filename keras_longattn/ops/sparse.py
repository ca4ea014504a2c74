"""The factorized patterns of the Sparse Transformer and their block-sparse
computation: O(n * sqrt(n)) time and memory, never a ``(T, S)`` tensor.

Child et al. (2019) split attention between two patterns, A and B, such that
every position can reach every earlier one in two steps. With ``l`` the
block length (the stride), ``c`` the summary width, query ``i`` and key ``j``:

* **strided**: A attends ``{j : i - l < j <= i}`` (bidirectional:
  ``|i - j| < l``), which is ``LocalPattern(l - 1, 0)`` (or
  ``LocalPattern(l - 1, l - 1)``); B attends ``{j : (i - j) mod l == 0}``
  (:class:`StridedPattern`).
* **fixed**: A attends ``{j : floor(j / l) == floor(i / l)}``
  (:class:`BlockPattern`); B attends ``{j : j mod l in [l - c, l)}``, the
  last ``c`` cells of every block (:class:`SummaryPattern`).

Causal calls AND both with ``j <= i`` (:class:`CausalPattern`). The patterns
are predicates (see :mod:`keras_longattn.ops.patterns`): the dense reference
builds its mask from them, and the functions below evaluate the very same
predicates on the (query, key) pairs of their blocks only, so the layout is
how it is computed, never what it means.

Layouts (the sequence padded to ``N = m * l``, ``m`` blocks of ``l``):

* strided A: band attention over blocks of ``l`` (the own block and one
  neighbour on each allowed side): O(n * l);
* strided B: the padded sequence seen as ``(m, l)``; each column (positions
  with the same residue mod ``l``) attends within itself over the ``m``
  rows: O(n * m);
* fixed A: attention inside each block, no neighbours: O(n * l);
* fixed B: every query against the ``m * c`` summary keys (slice
  ``[l - c, l)`` of each block): O(n * m * c).

Shape legend: B batch, T query length, S key length, H heads, d key/query
head size, dv value head size, N padded length, m number of blocks, l block
length, c summary width.
"""

import math

import numpy as np
from keras import ops

from keras_longattn._validation import positive_int as _check_positive_int
from keras_longattn.kernels import backend_ops
from keras_longattn.ops.blocked import band_blocks
from keras_longattn.ops.blocked import band_part
from keras_longattn.ops.blocked import fused_blocks
from keras_longattn.ops.blocked import pad_axis
from keras_longattn.ops.fused import fused_dot_product_attention
from keras_longattn.ops.patterns import AttentionPattern
from keras_longattn.ops.patterns import CausalPattern
from keras_longattn.ops.patterns import Difference
from keras_longattn.ops.patterns import LocalPattern
from keras_longattn.ops.reference import merge_attention_parts
from keras_longattn.ops.reference import softmax_with_lse
from keras_longattn.ops.shapes import ceil_div
from keras_longattn.ops.shapes import is_static
from keras_longattn.ops.shapes import larger
from keras_longattn.ops.shapes import length
from keras_longattn.ops.subset import key_subset_attention

#: Values of the ``pattern`` argument.
SPARSE_PATTERNS = ("strided", "fixed")
#: Values of the ``combination`` argument.
SPARSE_COMBINATIONS = ("multihead", "merged", "first", "second")

#: Cap of the default summary width (the paper uses c in {8, 16, 32}).
_MAX_DEFAULT_SUMMARY_WIDTH = 32


# ---------------------------------------------------------------- patterns
class StridedPattern(AttentionPattern):
    """Every ``stride``-th position: query ``i`` attends keys ``j`` with
    ``(i - j) mod stride == 0`` (in both directions; AND it with
    :class:`CausalPattern` for ``j <= i``).

    Head B of the Sparse Transformer's *strided* pattern.

    Args:
        stride: the stride ``l`` (>= 1).
    """

    def __init__(self, stride):
        self.stride = _check_positive_int("stride", stride)

    def segments(self):
        stride = self.stride

        def column(pos):
            return np.asarray(pos, np.int64) % stride

        return column, column, None, None

    def allowed(self, q_pos, k_pos):
        return ops.equal(ops.mod(q_pos, self.stride), ops.mod(k_pos, self.stride))

    def _fields(self):
        return {"stride": self.stride}


class BlockPattern(AttentionPattern):
    """Attention inside fixed blocks: query ``i`` attends keys ``j`` with
    ``floor(j / l) == floor(i / l)``.

    Head A of the Sparse Transformer's *fixed* pattern.

    Args:
        block_length: the block length ``l`` (>= 1).
    """

    def __init__(self, block_length):
        self.block_length = _check_positive_int("block_length", block_length)

    def segments(self):
        l = self.block_length

        def block(pos):
            return np.asarray(pos, np.int64) // l

        return block, block, None, None

    def allowed(self, q_pos, k_pos):
        l = self.block_length
        return ops.equal(ops.floor_divide(q_pos, l), ops.floor_divide(k_pos, l))

    def _fields(self):
        return {"block_length": self.block_length}


class SummaryPattern(AttentionPattern):
    """The last ``c`` cells of every block of ``l`` are summaries that every
    query sees: query ``i`` attends keys ``j`` with ``j mod l in [l - c, l)``.

    Head B of the Sparse Transformer's *fixed* pattern.

    Args:
        block_length: the block length ``l`` (>= 2).
        summary_width: the number ``c`` of summary cells per block,
            ``1 <= c < l``.
    """

    def __init__(self, block_length, summary_width):
        self.block_length = _check_positive_int("block_length", block_length)
        self.summary_width = _check_positive_int("summary_width", summary_width)
        _check_summary_width(self.summary_width, self.block_length)

    def segments(self):
        l, c = self.block_length, self.summary_width

        def every_query(pos):
            return np.zeros(np.shape(pos), np.int64)

        def summary_key(pos):
            return np.where(np.asarray(pos, np.int64) % l >= l - c, 0, -1)

        return every_query, summary_key, None, None

    def allowed(self, q_pos, k_pos):
        l, c = self.block_length, self.summary_width
        # `q_pos * 0` broadcasts the result to the (query, key) shape.
        return ops.greater_equal(ops.mod(k_pos, l) + q_pos * 0, l - c)

    def _fields(self):
        return {"block_length": self.block_length, "summary_width": self.summary_width}


def sparse_transformer_patterns(pattern, block_length, summary_width=None, causal=False):
    """The two factorized patterns ``(A, B)`` of the Sparse Transformer.

    Args:
        pattern: ``"strided"`` or ``"fixed"``.
        block_length: ``l``, the stride or block length.
        summary_width: ``c`` (fixed only). Defaults to
            :func:`default_summary_width`.
        causal: AND both patterns with ``j <= i``.

    Returns:
        ``(A, B)``, two :class:`AttentionPattern` objects (see the module
        docstring for the sets they allow).
    """
    check_sparse_pattern(pattern)
    l = _check_positive_int("block_length", block_length)
    if pattern == "strided":
        if summary_width is not None:
            raise ValueError(
                "`summary_width` only applies to pattern='fixed'. "
                f"Received: pattern='strided', summary_width={summary_width!r}"
            )
        first = LocalPattern(l - 1, 0 if causal else l - 1)
        second = StridedPattern(l)
    else:
        c = default_summary_width(l) if summary_width is None else summary_width
        first = BlockPattern(l)
        second = SummaryPattern(l, c)
    if causal:
        if pattern != "strided":  # LocalPattern(l - 1, 0) is already causal.
            first = first & CausalPattern()
        second = second & CausalPattern()
    return first, second


def default_block_length(length, summary_width=None):
    """Block length used when none is given: the integer nearest to
    ``sqrt(length)`` (halves round up), at least 2 and at least
    ``summary_width + 1``."""
    length = max(int(length), 1)
    l = max(2, int(math.floor(math.sqrt(length) + 0.5)))
    if summary_width is not None:
        l = max(l, int(summary_width) + 1)
    return l


def default_summary_width(block_length):
    """Summary width used when none is given:
    ``max(1, min(block_length // 8, 32))`` (the paper's ratio c = l / 8 for
    l <= 256, capped at 32 so that the fixed pattern stays O(n * sqrt(n)))."""
    return max(1, min(int(block_length) // 8, _MAX_DEFAULT_SUMMARY_WIDTH))


def check_sparse_pattern(pattern):
    if pattern not in SPARSE_PATTERNS:
        raise ValueError(
            f"`pattern` must be one of {SPARSE_PATTERNS}. Received: pattern={pattern!r}"
        )
    return pattern


def check_sparse_combination(combination):
    if combination not in SPARSE_COMBINATIONS:
        raise ValueError(
            f"`combination` must be one of {SPARSE_COMBINATIONS}. "
            f"Received: combination={combination!r}"
        )
    return combination


def multihead_split(num_heads):
    """Number of heads given pattern A by ``combination="multihead"``:
    the first ``ceil(H / 2)`` heads; the other ``floor(H / 2)`` get B."""
    return num_heads - num_heads // 2


def sparse_head_patterns(
    pattern, block_length, summary_width, combination, num_heads, causal
):
    """The pattern of each head, a tuple of ``num_heads`` patterns.

    ``"multihead"``: the first ``ceil(H / 2)`` heads A, the rest B;
    ``"merged"``: every head ``A | B``; ``"first"``: every head A;
    ``"second"``: every head B.
    """
    check_sparse_combination(combination)
    first, second = sparse_transformer_patterns(
        pattern, block_length, summary_width, causal
    )
    if combination == "multihead":
        h = multihead_split(num_heads)
        return (first,) * h + (second,) * (num_heads - h)
    if combination == "merged":
        return (first | second,) * num_heads
    if combination == "first":
        return (first,) * num_heads
    return (second,) * num_heads


# ------------------------------------------------------------ computation
def sparse_attention(
    query,
    key,
    value,
    pattern="strided",
    block_length=None,
    summary_width=None,
    combination="multihead",
    causal=False,
    key_mask=None,
    scale=None,
    dropout_fn=None,
    fused=False,
    band_kernel=False,
):
    """Sparse Transformer attention computed block-sparsely.

    Equal to dense attention under :func:`sparse_head_patterns` (the
    specification, checked by the tests), in O(n * (l + n / l)) time and
    memory for strided and O(n * (l + c * n / l)) for fixed: O(n * sqrt(n))
    with the default ``l ~ sqrt(n)``. No tensor of size ``T * S`` is built.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        pattern: ``"strided"`` or ``"fixed"``.
        block_length: ``l``. Defaults to :func:`default_block_length` of
            ``max(T, S)``.
        summary_width: ``c`` (fixed only). Defaults to
            :func:`default_summary_width`.
        combination: ``"multihead"``, ``"merged"``, ``"first"`` or
            ``"second"`` (see :func:`sparse_head_patterns`). ``"merged"``
            takes one softmax over the union of A and B, counting a key both
            allow once.
        causal: whether query ``i`` only sees keys ``j <= i``.
        key_mask: optional boolean ``(B, S)``; False marks padded keys.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights
            (not with ``fused=True``).
        fused: compute every part with ``keras.ops.dot_product_attention``
            (the backend's fused kernel: PyTorch's
            ``scaled_dot_product_attention``, flash attention on CPU) on the
            same block layouts, instead of explicit einsums and softmax.
            Causal parts without padding use the kernel's own causal mode;
            fixed B splits the queries into groups that only read the
            summaries up to their own end (about 56% of the summary scores
            with causal attention). Same result; no dropout; not with
            ``combination="merged"``, which needs each part's log-sum-exp.
        band_kernel: with ``fused=True`` and ``pattern="strided"``, compute
            part A (a sliding window of ``l`` keys) with the backend table's
            ``band_attention`` kernel instead of band blocks (where
            ``keras_longattn.kernels.backend_ops().band_attention_refusal``
            is None: PyTorch on the CPU, float32).

    Returns:
        ``(B, T, H, dv)``. Queries with no visible key get zeros.
    """
    check_sparse_pattern(pattern)
    if fused and dropout_fn is not None:
        raise ValueError("`fused=True` does not support attention dropout.")
    if fused and combination == "merged":
        raise ValueError(
            "`fused=True` does not support combination='merged' (the merge "
            "needs the log-sum-exp of each part)."
        )
    check_sparse_combination(combination)
    T, S = length(query, 1), length(key, 1)
    longest = larger(T, S)
    H = query.shape[2]
    d = query.shape[3]
    if scale is None:
        scale = 1.0 / float(d) ** 0.5
    if block_length is None:
        if not is_static(longest):
            raise ValueError(
                "Sparse attention derives its default `block_length` from the "
                "sequence length, which is unknown here: pass block_length=... . "
                f"Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}"
            )
        block_length = default_block_length(longest, summary_width)
    l = _check_positive_int("block_length", block_length)
    # Validates pattern, block_length and summary_width together.
    first, second = sparse_transformer_patterns(pattern, l, summary_width, causal)
    c = None
    if pattern == "fixed":
        c = default_summary_width(l) if summary_width is None else int(summary_width)

    m = ceil_div(longest, l)
    N = m * l
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    query = pad_axis(query, 1, N)
    key = pad_axis(key, 1, N)
    value = pad_axis(value, 1, N)
    valid = ops.expand_dims(ops.arange(N, dtype="int32") < S, 0)  # (1, N)
    if key_mask is not None:
        km = pad_axis(ops.cast(key_mask, "bool"), 1, N, value=False)
        valid = ops.logical_and(valid, km)  # (B or 1, N)

    # Statically known: no padded key anywhere (the fused parts then skip
    # their masks where the pattern alone is plain causal or full).
    all_valid = key_mask is None and S == N

    def part_a(q, k, v, pat):
        if pattern == "strided":
            before = 1 if l > 1 else 0
            after = 0 if causal else before
        else:
            before = after = 0
        if fused and band_kernel and pattern == "strided":
            # Queries are already scaled; padded keys are masked by `valid`.
            # The kernel's own block size (not l): its blocks are a tiling
            # only, and smaller ones waste fewer masked pairs.
            return backend_ops().band_attention(
                q, k, v, l - 1, 0 if causal else l - 1,
                key_mask=None if all_valid else valid,
                scale=1.0,
            ), None
        if fused:
            if pattern == "fixed" and all_valid:
                return _fused_fixed_blocks(q, k, v, l, causal), None
            q, k, v, mask = band_blocks(q, k, v, valid, pat, l, before, after)
            out = fused_blocks(q, k, v, mask, scale=1.0)  # queries already scaled
            return ops.reshape(out, (-1, length(q, 1) * l) + tuple(out.shape[3:])), None
        return band_part(q, k, v, valid, pat, l, before, after, dropout_fn)

    def part_b(q, k, v, pat):
        if pattern == "strided":
            if fused:
                return _fused_column_part(q, k, v, valid, pat, l, causal, all_valid), None
            return _column_part(q, k, v, valid, pat, l, dropout_fn)
        if fused:
            return _summary_part(q, k, v, valid, pat, l, c, causal=causal, fused=True)
        return _summary_part(q, k, v, valid, pat, l, c, dropout_fn, causal)

    if combination == "first":
        out, _ = part_a(query, key, value, first)
    elif combination == "second":
        out, _ = part_b(query, key, value, second)
    elif combination == "multihead":
        h = multihead_split(H)
        out, _ = part_a(query[:, :, :h], key[:, :, :h], value[:, :, :h], first)
        if h < H:
            out_b, _ = part_b(query[:, :, h:], key[:, :, h:], value[:, :, h:], second)
            out = ops.concatenate([out, out_b], axis=2)
    else:  # merged: one softmax over A and (B without A).
        out_a, lse_a = part_a(query, key, value, first)
        out_b, lse_b = part_b(query, key, value, Difference(second, first))
        out = merge_attention_parts([(out_a, lse_a), (out_b, lse_b)])
    return out[:, :T]


# ------------------------------------------------------------------ parts
# Positions are static: they are laid out with numpy in the shape of the
# scores, and the pattern predicate is evaluated on them as tensors.
def _column_part(query, key, value, valid, pattern, l, dropout_fn):
    """The padded sequence as ``(m rows, l columns)``; each column attends
    within itself over the rows (strided B). O(N * m)."""
    N, H, d = length(query, 1), query.shape[2], query.shape[3]
    dv = value.shape[3]
    m = N // l
    q = ops.reshape(query, (-1, m, l, H, d))  # position r * l + c at [r, c]
    k = ops.reshape(key, (-1, m, l, H, d))
    v = ops.reshape(value, (-1, m, l, H, dv))
    kv_valid = ops.transpose(ops.reshape(valid, (-1, m, l)), (0, 2, 1))  # (B, l, m)
    pos = _column_positions(l, m)  # (l, m)
    allowed = pattern.allowed(
        pos[None, :, None, :, None], pos[None, :, None, None, :]
    )  # (1, l, 1, m, m)
    mask = ops.logical_and(allowed, kv_valid[:, :, None, None, :])  # (B, l, 1, m, m)
    # (B, m, l, H, d) x (B, m, l, H, d) -> (B, l, H, m, m)
    scores = ops.einsum("brchd,bschd->bchrs", q, k)
    probs, lse = softmax_with_lse(scores, mask)  # lse: (B, l, H, m)
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    # (B, l, H, m, m) x (B, m, l, H, dv) -> (B, m, l, H, dv)
    out = ops.einsum("bchrs,bschd->brchd", probs, v)
    out = ops.reshape(out, (-1, N, H, dv))
    lse = ops.reshape(ops.transpose(lse, (0, 3, 1, 2)), (-1, N, H))
    return out, lse


#: Query groups of the summary part (fixed B) with causal attention.
_SUMMARY_GROUPS = 8
def _summary_keys(key, value, valid, l, c):
    """The summary keys (last ``c`` cells of every block), their values,
    validity ``(B or 1, m * c)`` and static positions ``(m * c,)``."""
    N, H, d = length(key, 1), key.shape[2], key.shape[3]
    dv = value.shape[3]
    m = N // l
    k = ops.reshape(ops.reshape(key, (-1, m, l, H, d))[:, :, l - c :], (-1, m * c, H, d))
    v = ops.reshape(ops.reshape(value, (-1, m, l, H, dv))[:, :, l - c :], (-1, m * c, H, dv))
    kv_valid = ops.reshape(ops.reshape(valid, (-1, m, l))[:, :, l - c :], (-1, m * c))
    if is_static(m):
        k_pos = np.arange(m, dtype="int32")[:, None] * l + np.arange(l - c, l, dtype="int32")
    else:
        k_pos = ops.arange(m, dtype="int32")[:, None] * l + ops.arange(l - c, l, dtype="int32")
    return k, v, kv_valid, ops.reshape(k_pos, (-1,)) if not is_static(m) else k_pos.reshape(-1)


def _summary_part(query, key, value, valid, pattern, l, c, dropout_fn=None, causal=True,
                  fused=False):
    """Every query against the summary keys, the last ``c`` cells of each
    block (fixed B), in the query groups of :func:`_summary_groups`
    (queries already scaled). O(N * m * c); returns ``(out, lse)`` (lse
    None when fused)."""
    m = length(query, 1) // l
    k, v, kv_valid, k_pos = _summary_keys(key, value, valid, l, c)
    groups = [
        (first * l, end * l, read * c) for first, end, read in _summary_groups(m, causal)
    ]
    return key_subset_attention(
        query, k, v, k_pos, kv_valid, pattern, query_groups=groups, scale=1.0,
        dropout_fn=dropout_fn, fused=fused,
    )


def _summary_groups(m, causal):
    """Query groups of the summary part: ``(first block, end block, summary
    blocks read)`` each. Causal: up to 8 groups of whole blocks, each
    reading the summaries up to its own last block (about 56% of the
    summary scores); bidirectional: one group reading every summary."""
    if not causal or not is_static(m):
        return [(0, m, m)]  # an unknown length: one group, masks decide
    groups = min(_SUMMARY_GROUPS, m)
    bounds = [round(g * m / groups) for g in range(groups + 1)]
    return [(bounds[g], bounds[g + 1], bounds[g + 1]) for g in range(groups)]


# ------------------------------------------------------------ fused parts
# The same layouts given to keras.ops.dot_product_attention, one call per
# part (queries are already scaled: the kernel gets scale=1).
def _dot_product_attention(q, k, v, mask=None, is_causal=False):
    # Queries are already scaled.
    return fused_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, scale=1.0)


def _fused_fixed_blocks(query, key, value, l, causal):
    """Fixed A without padding: each block of ``l`` attends within itself,
    causally or not, with no explicit mask."""
    N, H, d = length(query, 1), query.shape[2], query.shape[3]
    dv = value.shape[3]
    q = ops.reshape(query, (-1, l, H, d))
    k = ops.reshape(key, (-1, l, H, d))
    v = ops.reshape(value, (-1, l, H, dv))
    out = _dot_product_attention(q, k, v, is_causal=causal)
    return ops.reshape(out, (-1, N, H, dv))


def _fused_column_part(query, key, value, valid, pattern, l, causal, all_valid):
    """Strided B: each column of the ``(m, l)`` view attends within itself
    over the ``m`` rows; plain causal (or full) attention when no key is
    padded."""
    N, H, d = length(query, 1), query.shape[2], query.shape[3]
    dv = value.shape[3]
    m = N // l

    def columns(x):  # (B, N, H, e) -> (B * l, m, H, e)
        x = ops.reshape(x, (-1, m, l, H, x.shape[-1]))
        return ops.reshape(ops.transpose(x, (0, 2, 1, 3, 4)), (-1, m, H, x.shape[-1]))

    q, k, v = columns(query), columns(key), columns(value)
    if all_valid:
        out = _dot_product_attention(q, k, v, is_causal=causal)
    else:
        kv_valid = ops.transpose(ops.reshape(valid, (-1, m, l)), (0, 2, 1))  # (B, l, m)
        pos = _column_positions(l, m)
        allowed = pattern.allowed(pos[None, :, :, None], pos[None, :, None, :])  # (1, l, m, m)
        mask = ops.logical_and(allowed, kv_valid[:, :, None, :])  # (B, l, m, m)
        batch = ops.shape(query)[0]
        mask = ops.reshape(ops.broadcast_to(mask, (batch, l, m, m)), (-1, 1, m, m))
        out = _dot_product_attention(q, k, v, mask=mask)
    out = ops.transpose(ops.reshape(out, (-1, l, m, H, dv)), (0, 2, 1, 3, 4))
    return ops.reshape(out, (-1, N, H, dv))


def _column_positions(l, m):
    """int32 ``(l, m)``: the position ``r * l + c`` of row ``r``, column
    ``c`` of the ``(m, l)`` view (a constant when ``m`` is static)."""
    if is_static(m):
        pos = np.arange(l, dtype="int32")[:, None] + np.arange(m, dtype="int32") * l
        return ops.convert_to_tensor(pos, dtype="int32")
    return ops.arange(l, dtype="int32")[:, None] + ops.arange(m, dtype="int32") * l


# ---------------------------------------------------------------- helpers
def _check_summary_width(summary_width, block_length):
    if summary_width >= block_length:
        raise ValueError(
            "`summary_width` must be smaller than `block_length` (the summary "
            "cells are the last `summary_width` cells of each block). "
            f"Received: summary_width={summary_width}, block_length={block_length}"
        )
