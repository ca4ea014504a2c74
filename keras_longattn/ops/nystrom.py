"""Nyström attention (Nyströmformer, Xiong et al. 2021): what is specific
to that paper.

The softmax matrix ``S = softmax(Q K^T / sqrt(d))`` is approximated from
``m`` landmarks, the means of consecutive segments of the queries
(``Q~``) and of the keys (``K~``)::

    S ~ F A^+ B,   F = softmax(Q K~^T),  A = softmax(Q~ K~^T),
                   B = softmax(Q~ K^T)   (each scaled by 1 / sqrt(d))

with ``A^+`` the Moore-Penrose pseudo-inverse of the ``(m, m)`` matrix
``A``, approximated by the iteration of Razavi et al. (2014) that the paper
uses. The output ``F (A^+ (B V))`` costs O(n * m * d + m^3) per head: no
``n x n`` tensor. :func:`nystrom_weights` is the explicit ``(T, S)`` form of
the same approximation (the reference).

Landmarks are the segment means of
:func:`keras_longattn.ops.segments.contiguous_segment_means`: the real
tokens of an example (padding excluded, wherever it is) are cut into
segments of ``ceil(n_real / m)`` consecutive tokens, so any length works
and an example's landmarks do not depend on the padding of its batch.
Slots past the last real segment are empty: they take no part in any
softmax (an empty landmark is a zero row and column of ``A``, whose
pseudo-inverse is zero there too).

Shape legend: B batch, T query length, S key length, H heads, d head size,
dv value head size, m landmarks.
"""

import math

from keras import ops

from keras_longattn.kernels import compiled
from keras_longattn.ops.reference import masked_softmax
from keras_longattn.ops.segments import contiguous_segment_matrix
from keras_longattn.ops.segments import contiguous_segment_means
from keras_longattn.ops.segments import dims

#: The paper's number of pseudo-inverse iterations.
DEFAULT_PINV_ITERATIONS = 6


def segment_lengths(real_count, num_landmarks):
    """Tokens per landmark segment: ``ceil(n_real / m)``, at least 1.

    Args:
        real_count: int ``(*lead,)`` real tokens per row.
        num_landmarks: m.

    Returns:
        int32 ``(*lead,)``.
    """
    m = int(num_landmarks)
    real = ops.cast(real_count, "int32")
    return ops.maximum((real + (m - 1)) // m, 1)


def _real_count(mask, batch, n):
    if mask is None:
        return ops.full((batch,), n, dtype="int32")
    return ops.sum(ops.cast(ops.cast(mask, "bool"), "int32"), axis=-1)


def landmarks(x, num_landmarks, mask=None):
    """Segment-mean landmarks of every head, padding excluded.

    Args:
        x: ``(B, n, H, d)``.
        num_landmarks: m.
        mask: optional boolean ``(B, n)``, False for padding.

    Returns:
        ``(means, valid)``: float32 ``(B, m, H, d)`` and boolean ``(B, m)``
        (the segment holds at least one real token).
    """
    batch, n, H = dims(x)[:3]
    seg = segment_lengths(_real_count(mask, batch, n), num_landmarks)
    seg = ops.broadcast_to(seg[:, None], (batch, H))
    means, counts = contiguous_segment_means(
        ops.cast(x, "float32"), seg, int(num_landmarks), mask=mask
    )
    return means, counts[..., 0] > 0.0


def iterative_pinv(a, iterations):
    """Moore-Penrose pseudo-inverse of ``a`` by the iteration of Razavi et
    al. (2014), as in the Nyströmformer paper (its Eq. 13)::

        Z_0     = a^T / (||a||_1 ||a||_inf)
        Z_{j+1} = Z_j (13 I - a Z_j (15 I - a Z_j (7 I - a Z_j))) / 4

    ``||a||_1`` is the largest column sum and ``||a||_inf`` the largest row
    sum of ``|a|``, per matrix (the paper's initialisation; the authors'
    code takes the largest over the whole batch instead, which makes one
    example's result depend on the others). A zero matrix gives zeros. The
    error in the directions of singular values ``sigma`` shrinks once
    ``sigma^2 * 3.25^j`` passes about ``||a||_1 ||a||_inf``: six iterations
    (the paper's) resolve the well-conditioned part of a softmax matrix,
    more resolve smaller singular values.

    Args:
        a: ``(..., m, m)``; computed in float32.
        iterations: a positive int.

    Returns:
        float32 ``(..., m, m)``.
    """
    a = ops.cast(a, "float32")
    m = a.shape[-1]
    absolute = ops.abs(a)
    col = ops.max(ops.sum(absolute, axis=-2), axis=-1)  # ||a||_1
    row = ops.max(ops.sum(absolute, axis=-1), axis=-1)  # ||a||_inf
    norm = (col * row)[..., None, None]
    z = ops.swapaxes(a, -1, -2) / ops.maximum(norm, 1e-30)
    eye = ops.eye(m, dtype="float32")
    for _ in range(int(iterations)):
        az = ops.matmul(a, z)
        inner = 7.0 * eye - az
        inner = 15.0 * eye - ops.matmul(az, inner)
        inner = 13.0 * eye - ops.matmul(az, inner)
        z = 0.25 * ops.matmul(z, inner)
    return z


def _kernels(q, k, q_land, k_land, q_valid, k_valid, key_mask, scale, t=""):
    """The three softmax kernels ``F``, ``A``, ``B`` (float32). ``t`` is
    ``"t"`` when the key landmarks and the key mask are per query row (a
    dense attention mask): ``k_land`` ``(B, T, m, H, d)``, ``k_valid``
    ``(B, T, m)``, ``key_mask`` ``(B, T, S)``."""
    # F = softmax(Q K~^T): (B, H, T, m), over the valid key landmarks.
    f_mask = k_valid[:, None] if t else k_valid[:, None, None, :]
    f = masked_softmax(ops.einsum(f"bthd,b{t}mhd->bhtm", q * scale, k_land), f_mask)
    # A = softmax(Q~ K~^T): (B, H, [T,] m, m); empty landmarks: zero rows
    # and columns.
    kv = k_valid[:, None, :, None, :] if t else k_valid[:, None, None, :]
    qv = q_valid[:, None, None, :, None] if t else q_valid[:, None, :, None]
    a = masked_softmax(
        ops.einsum(f"bnhd,b{t}mhd->bh{t}nm", q_land * scale, k_land),
        ops.logical_and(kv, qv),
    )
    # B = softmax(Q~ K^T): (B, H, [T,] m, S) over the real keys.
    logits = ops.einsum("bnhd,bshd->bhns", q_land * scale, k)
    b_mask = qv
    if key_mask is not None:
        km = ops.cast(key_mask, "bool")
        km = km[:, None, :, None, :] if t else km[:, None, None, :]
        b_mask = ops.logical_and(km, qv)
    if t:
        shape = tuple(dims(logits))
        logits = ops.broadcast_to(
            logits[:, :, None], shape[:2] + (dims(key_mask)[1],) + shape[2:]
        )
    b = masked_softmax(logits, b_mask)
    return f, a, b


@compiled(("num_landmarks", "iterations", "scale"))
def nystrom_attention(
    query,
    key,
    value,
    num_landmarks,
    iterations=DEFAULT_PINV_ITERATIONS,
    query_mask=None,
    key_mask=None,
    scale=None,
):
    """Nyström attention ``F (A^+ (B V))`` (see the module docstring),
    computed in float32: O(n * m * d + m^3) time, O(n * m) memory per head.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        num_landmarks: m.
        iterations: pseudo-inverse iterations.
        query_mask: optional boolean ``(B, T)``: padded queries take no
            part in the query landmarks.
        key_mask: optional boolean ``(B, S)``: padded keys take no part in
            the key landmarks and get no weight.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.

    Returns:
        ``(B, T, H, dv)`` in the dtype of ``value``; zeros for an example
        without a real key.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    q, k, v = (ops.cast(x, "float32") for x in (query, key, value))
    if key_mask is not None:  # exact zeros: 0 * NaN would leak
        keep = ops.cast(key_mask, "bool")[:, :, None, None]
        v = ops.where(keep, v, 0.0)
    q_land, q_valid = landmarks(q, num_landmarks, query_mask)
    k_land, k_valid = landmarks(k, num_landmarks, key_mask)
    f, a, b = _kernels(q, k, q_land, k_land, q_valid, k_valid, key_mask, scale)
    z = iterative_pinv(a, iterations)  # (B, H, m, m)
    bv = ops.einsum("bhns,bshv->bhnv", b, v)  # (B, H, m, dv)
    zbv = ops.matmul(z, bv)  # (B, H, m, dv)
    out = ops.einsum("bhtm,bhmv->bthv", f, zbv)
    return ops.cast(out, value.dtype)


def _explicit_landmarks(x, num_landmarks, rows):
    """Landmarks by the explicit ``(m, n)`` averaging matrix. ``rows``:
    boolean ``(B, n)`` or ``(B, T, n)`` (one segmentation per query row) or
    None. Returns float32 ``(B, [T,] m, H, d)`` and boolean ``(B, [T,] m)``."""
    batch, n, H = dims(x)[:3]
    lead_t = rows is not None and len(rows.shape) == 3
    count = _real_count(rows, batch, n)  # (B,) or (B, T)
    seg = segment_lengths(count, num_landmarks)[..., None]  # (..., 1)
    seg = ops.broadcast_to(seg, tuple(dims(seg)[:-1]) + (H,))
    matrix, counts = contiguous_segment_matrix(seg, int(num_landmarks), n, mask=rows)
    t = "t" if lead_t else ""
    means = ops.einsum(f"b{t}mhs,bshd->b{t}mhd", matrix, ops.cast(x, "float32"))
    return means, counts[..., 0] > 0.0


@compiled(("num_landmarks", "iterations", "scale"))
def nystrom_weights(
    query,
    key,
    num_landmarks,
    iterations=DEFAULT_PINV_ITERATIONS,
    query_mask=None,
    key_mask=None,
    scale=None,
):
    """The explicit ``(B, H, T, S)`` matrix ``F A^+ B`` of
    :func:`nystrom_attention` (float32), with landmarks taken by the
    explicit averaging matrix. O(T * S): the reference.

    ``key_mask`` may be ``(B, S)`` or, for a dense attention mask, per query
    row ``(B, T, S)``: each query's key landmarks (and ``A``, ``B``) are
    then built from the keys it may see.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    q, k = ops.cast(query, "float32"), ops.cast(key, "float32")
    per_row = key_mask is not None and len(key_mask.shape) == 3
    t = "t" if per_row else ""
    q_land, q_valid = _explicit_landmarks(q, num_landmarks, query_mask)
    k_land, k_valid = _explicit_landmarks(k, num_landmarks, key_mask)
    f, a, b = _kernels(q, k, q_land, k_land, q_valid, k_valid, key_mask, scale, t)
    z = iterative_pinv(a, iterations)  # (B, H, [T,] m, m)
    if per_row:
        # Row t of F times Z_t times B_t.
        fz = ops.einsum("bhtm,bhtmn->bhtn", f, z)
        weights = ops.einsum("bhtn,bhtns->bhts", fz, b)
    else:
        weights = ops.matmul(ops.matmul(f, z), b)
    if key_mask is not None:
        km = ops.cast(key_mask, "bool")
        km = km[:, None] if per_row else km[:, None, None, :]
        weights = ops.where(km, weights, 0.0)
    return weights


def conv_matrix(kernel, length):
    """The ``(H, n, n)`` matrix of a per-head "same" convolution along the
    sequence with ``kernel`` ``(k, H)`` (k odd): ``C[h, t, s] =
    kernel[s - t + k // 2, h]`` inside the band, 0 outside. O(n^2): the
    explicit form of :func:`depthwise_sequence_conv`."""
    size = kernel.shape[0]
    half = size // 2
    pos = ops.arange(length, dtype="int32")
    offset = pos[None, :] - pos[:, None] + half  # (n, n)
    inside = ops.logical_and(offset >= 0, offset < size)
    taps = ops.take(
        ops.transpose(ops.cast(kernel, "float32")), ops.clip(offset, 0, size - 1), axis=1
    )  # (H, n, n)
    return ops.where(inside[None], taps, 0.0)


def depthwise_sequence_conv(value, kernel):
    """Per-head "same" convolution along the sequence (zero padding at the
    ends): head ``h`` of ``value`` ``(B, n, H, dv)`` is convolved with
    ``kernel[:, h]`` (``(k, H)``, k odd), the same filter for each of its
    ``dv`` features (the authors' depthwise convolution, one filter per
    head). Returns ``(B, n, H, dv)`` in float32."""
    batch, n, H, dv = dims(value)
    x = ops.reshape(ops.cast(value, "float32"), (batch, n, H * dv))
    size = kernel.shape[0]
    w = ops.repeat(ops.cast(kernel, "float32"), dv, axis=1)  # (k, H * dv)
    w = ops.reshape(w, (size, H * dv, 1))
    out = ops.depthwise_conv(x, w, strides=1, padding="same")
    return ops.reshape(out, (batch, n, H, dv))
