"""Gathers, scatters and segment reductions over token layouts.

One layout for tokens throughout: ``(B, n, H, d)``, the layers' own (no
transposed copies), with per-head indices ``(B, H, ...)`` of positions in
``[0, n)``. Backend-specific row gathers and segment sums come from the
backend table (:mod:`keras_longattn.kernels`).

Shape legend: B batch, n sequence length, H heads, d head size.
"""

from keras import ops

from keras_longattn.kernels import backend_ops
from keras_longattn.ops.shapes import length


def dims(x):
    """The shape of ``x``: ints where static, scalar tensors elsewhere."""
    dynamic = None
    result = []
    for i, size in enumerate(x.shape):
        if size is None:
            if dynamic is None:
                dynamic = ops.shape(x)
            size = dynamic[i]
        result.append(size)
    return tuple(result)


def static_dim(x, axis):
    """Static size of ``x`` along ``axis`` when known, else a tensor."""
    size = x.shape[axis]
    return size if size is not None else ops.shape(x)[axis]


def flat_token_ids(indices, batch, num_heads, length):
    """Row of each (example, head, position) in ``(B, n, H, .)`` tokens
    flattened to ``(B * n * H, .)``.

    Args:
        indices: int ``(B, H, ...)`` positions in ``[0, length)``.
        batch: B (int or scalar tensor).
        num_heads: H.
        length: n.

    Returns:
        int32 ``(B * H * prod(...),)``, in the order of ``indices``.
    """
    shape = tuple(indices.shape)
    tail = (1,) * (len(shape) - 2)
    indices = ops.cast(indices, "int32")
    b = ops.reshape(ops.arange(batch, dtype="int32") * (length * num_heads), (-1, 1) + tail)
    h = ops.reshape(ops.arange(num_heads, dtype="int32"), (1, num_heads) + tail)
    return ops.reshape(indices * num_heads + b + h, (-1,))


def take_rows(x, rows):
    """``x[rows]`` for a 2-D ``x`` and int ``rows`` ``(N,)`` (the backend's
    fastest row gather with a cheap gradient)."""
    return backend_ops().take_rows(x, rows)


def segment_sum(data, segment_ids, num_segments):
    """Sums of the rows of ``data`` per id in ``[0, num_segments)``."""
    return backend_ops().segment_sum(data, segment_ids, num_segments)


def gather_tokens(x, indices):
    """Gathers token vectors per head.

    Args:
        x: ``(B, n, H, d)``.
        indices: int ``(B, H, ...)`` positions in ``[0, n)``.

    Returns:
        ``(B, H, ..., d)``.
    """
    shape = dims(indices)
    H, n, d = shape[1], length(x, 1), x.shape[3]
    # One row gather from the flattened tokens, whose gradient is an indexed
    # add (take_along_axis would broadcast the indices to (..., d) instead).
    flat = flat_token_ids(indices, ops.shape(x)[0], H, n)
    out = take_rows(ops.reshape(x, (-1, d)), flat)
    return ops.reshape(out, (-1,) + shape[1:] + (d,))


def gather_flags(x, indices):
    """Gathers per-token scalars: ``x`` ``(B or 1, H or 1, n)``, ``indices``
    ``(B, H, ...)`` -> int32 ``(B, H, ...)``."""
    shape = dims(indices)
    flat = ops.reshape(indices, (ops.shape(indices)[0], shape[1], -1))
    x = ops.cast(x, "int32")
    if x.shape[1] == 1 and shape[1] != 1:
        x = ops.repeat(x, shape[1], axis=1)
    if x.shape[0] == 1:
        x = ops.broadcast_to(x, (ops.shape(flat)[0],) + dims(x)[1:])
    out = ops.take_along_axis(x, flat, axis=2)
    return ops.reshape(out, (-1,) + shape[1:])


def scatter_mean(values, indices, length, weights=None, return_counts=False):
    """Mean of the rows sent to each token position; zeros where none is.

    Args:
        values: ``(B, H, ..., dv)``, one row per index; rows whose weight is
            False must hold zeros.
        indices: int ``(B, H, ...)`` positions in ``[0, length)``.
        length: n.
        weights: optional boolean ``(B, H, ...)``: only rows with True
            count towards the mean (None: all).
        return_counts: also return the float32 counts ``(B, H, length)``.

    Returns:
        ``(B, length, H, dv)`` in the dtype of ``values`` (and the counts).
    """
    H, dv = values.shape[1], values.shape[-1]
    batch = static_dim(values, 0)
    ids = flat_token_ids(indices, batch, H, length)
    num = batch * H * length
    sums = segment_sum(ops.cast(ops.reshape(values, (-1, dv)), "float32"), ids, num)
    if weights is None:
        weights = ops.ones_like(ids, dtype="float32")
    counts = segment_sum(ops.reshape(ops.cast(weights, "float32"), (-1,)), ids, num)
    mean = ops.cast(sums / ops.maximum(counts, 1.0)[:, None], values.dtype)
    mean = ops.reshape(mean, (-1, length, H, dv))
    if not return_counts:
        return mean
    counts = ops.transpose(ops.reshape(counts, (-1, length, H)), (0, 2, 1))
    return mean, counts


def row_bincount(x, num_bins):
    """How many entries of each row of int ``x`` ``(B, H, N)`` equal
    ``0 .. num_bins - 1`` (other values ``num_bins`` are dropped): int32
    ``(B, H, num_bins)``, by one segment sum (no ``(N, num_bins)`` one-hot)."""
    k = int(num_bins)
    H = x.shape[1]
    batch = static_dim(x, 0)
    offsets = ops.reshape(ops.arange(batch * H, dtype="int32") * (k + 1), (-1, H, 1))
    ids = ops.reshape(ops.cast(x, "int32") + offsets, (-1,))
    counts = segment_sum(ops.ones_like(ids, dtype="float32"), ids, batch * H * (k + 1))
    counts = ops.reshape(counts, (-1, H, k + 1))[..., :k]
    return ops.cast(counts, "int32")


# ------------------------------------------------- contiguous segment means
def _real_ranks(mask, lead_shape, length):
    """Rank of each position among the real ones of its row (``-1`` before
    the first), whether it is real, and the count of real positions.

    ``mask``: optional boolean ``(*lead, n)``; None: every position is real.
    """
    if mask is None:
        rank = ops.broadcast_to(ops.arange(length, dtype="int32"), lead_shape + (length,))
        real = ops.ones_like(rank, dtype="bool")
        count = ops.full(lead_shape, length, dtype="int32")
        return rank, real, count
    real = ops.cast(mask, "bool")
    flags = ops.cast(real, "int32")
    rank = ops.cumsum(flags, axis=-1) - 1
    count = ops.sum(flags, axis=-1)
    return rank, real, count


def contiguous_segment_counts(real_count, segment_length, num_segments):
    """How many real tokens each contiguous segment holds.

    Segment ``j`` of a row holds the real tokens of ranks ``j * l`` to
    ``(j + 1) * l - 1``: ``clip(count - j * l, 0, l)``.

    Args:
        real_count: int ``(*lead,)`` real tokens per row.
        segment_length: int ``(*lead, H)``, at least 1.
        num_segments: M (int or scalar tensor).

    Returns:
        float32 ``(*lead, M, H)``.
    """
    j = ops.arange(num_segments, dtype="int32")[:, None]  # (M, 1)
    seg_len = ops.cast(segment_length, "int32")[..., None, :]  # (*lead, 1, H)
    count = ops.cast(real_count, "int32")[..., None, None]
    counts = ops.clip(count - j * seg_len, 0, seg_len)
    return ops.cast(counts, "float32")


def contiguous_segment_means(x, segment_length, num_segments, mask=None):
    """Means of consecutive runs of real tokens, per example and head, by
    one segment sum for all heads.

    The real tokens of each example (``mask`` True, wherever the padding
    is) are numbered ``0 .. n_b - 1`` in order; for head ``h`` the token of
    rank ``r`` belongs to segment ``r // segment_length[b, h]``. Padding
    takes no part in any mean, and an example's segments do not depend on
    how much padding its batch adds. Segments past the last real token
    (or at or beyond ``num_segments``) are empty: mean 0, count 0.

    Time and memory O(B * n * H * d + B * M * H * d): no ``(M, n)``
    matrix (:func:`contiguous_segment_matrix` is that explicit form).

    Args:
        x: ``(B, n, H, d)``.
        segment_length: int ``(B, H)``, at least 1.
        num_segments: M, the segment slots per example and head (int or
            scalar tensor).
        mask: optional boolean ``(B, n)``, False for padding.

    Returns:
        ``(means, counts)``: ``(B, M, H, d)`` in the dtype of ``x`` (summed
        in float32) and float32 ``(B, M, H)``.
    """
    batch, n, H, d = dims(x)
    rank, real, count = _real_ranks(mask, (batch,), n)
    seg_len = ops.cast(segment_length, "int32")
    seg = rank[:, :, None] // seg_len[:, None, :]  # (B, n, H)
    valid = ops.logical_and(real[:, :, None], seg < num_segments)
    b = ops.arange(batch, dtype="int32")[:, None, None]
    h = ops.arange(H, dtype="int32")[None, None, :]
    ids = (b * num_segments + seg) * H + h
    total = batch * num_segments * H
    ids = ops.where(valid, ids, total)  # padding -> one discarded row
    sums = segment_sum(
        ops.cast(ops.reshape(x, (-1, d)), "float32"), ops.reshape(ids, (-1,)), total + 1
    )
    sums = ops.reshape(sums[:total], (batch, num_segments, H, d))
    counts = contiguous_segment_counts(count, seg_len, num_segments)
    means = sums / ops.maximum(counts, 1.0)[..., None]
    return ops.cast(means, x.dtype), counts


def contiguous_segment_matrix(segment_length, num_segments, length, mask=None):
    """The explicit averaging matrix of :func:`contiguous_segment_means`.

    ``means = einsum("...mhn,bnhd->...mhd", matrix, x)``. O(M * n) memory per
    row: for references and tests.

    Args:
        segment_length: int ``(*lead, H)``, at least 1 (``lead`` is ``(B,)``
            or ``(B, T)``: one segmentation per query row, e.g. under a
            dense attention mask).
        num_segments: M.
        length: n.
        mask: optional boolean ``(*lead, n)`` (None: all real; then
            ``lead`` comes from ``segment_length``).

    Returns:
        ``(matrix, counts)``: float32 ``(*lead, M, H, n)`` whose rows
        average the members of each segment (zero rows for empty ones), and
        float32 counts ``(*lead, M, H)``.
    """
    seg_len = ops.cast(segment_length, "int32")
    lead = tuple(dims(seg_len)[:-1])
    rank, real, count = _real_ranks(mask, lead, length)
    seg = rank[..., None, :] // seg_len[..., :, None]  # (*lead, H, n)
    j = ops.arange(num_segments, dtype="int32")[:, None, None]  # (M, 1, 1)
    member = ops.logical_and(
        ops.expand_dims(seg, -3) == j, real[..., None, None, :]
    )  # (*lead, M, H, n)
    counts = contiguous_segment_counts(count, seg_len, num_segments)
    matrix = ops.cast(member, "float32") / ops.maximum(counts, 1.0)[..., None]
    return matrix, counts
