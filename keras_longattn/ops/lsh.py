"""LSH attention (Reformer, Kitaev et al. 2020): what is specific to that
paper.

Queries and keys are shared: the key of a token is its query divided by its
norm. Each of ``R`` hashing rounds draws a random rotation ``Rot`` ``(d, c)``
per head and puts a token in bucket ``argmax([x Rot, -x Rot])`` (angular
LSH: nearby directions tend to share a bucket), one of ``2c`` buckets.
Inside each round, attention is sorted-chunk attention
(:func:`keras_longattn.ops.chunked.sorted_chunk_attention`): tokens sorted
by (bucket, position) and cut into chunks of ``window`` members that never
mix buckets; a token attends to the keys of its own and of the previous
chunk of its bucket (causal: those not after it), not to itself unless
nothing else is visible. The rounds are combined by their log-sum-exps, as
in the paper: ``o = sum_r exp(lse_r - logsumexp_r lse_r) o_r``, which is one
softmax over the union of the rounds in which a key counts once per round
that shows it. The paper's self rule holds over that union: a round in
which a token sees only itself is dropped when another round shows it
another key.

Rounds are computed together as ``R * H`` heads (one sorted-chunk call, no
loop over rounds in the attention); hashing loops over rounds to keep its
``(B, H, n, c)`` projections one round at a time.

Shape legend: B batch, n (= T = S) length, H heads, d head size, dv value
head size, R hashing rounds, c rotation columns (half the buckets).
"""

import math

from keras import ops

from keras_longattn.ops.chunked import sorted_chunk_attention
from keras_longattn.ops.chunked import sorted_chunk_mask
from keras_longattn.ops.kmeans import l2_normalize
from keras_longattn.ops.patterns import combine_dense_masks
from keras_longattn.ops.reference import MASKED_LOGIT
from keras_longattn.ops.reference import masked_softmax


def rotation_columns(length, bucket_size, num_buckets=None):
    """Number of rotation columns ``c`` (half the buckets): ``num_buckets /
    2``, or ``ceil(n / (2 bucket_size))`` (at least 1) for a length ``n``,
    so that buckets hold ``bucket_size`` tokens on average."""
    if num_buckets is not None:
        return int(num_buckets) // 2
    return max(1, -(-int(length) // (2 * int(bucket_size))))


def hash_buckets(x, rotations, valid=None):
    """Angular LSH buckets of every round and head.

    Bucket of ``x`` with rotation ``Rot`` (``c`` columns):
    ``argmax([x Rot, -x Rot])``, numbered ``j`` for column ``j`` of
    ``x Rot`` and ``c + j`` for column ``j`` of ``-x Rot``. The products and the argmax are float32 whatever
    the dtype of ``x`` (a bucket must not follow the rounding of a low
    compute dtype). No gradient.

    Args:
        x: ``(B, n, H, d)`` vectors to hash (the shared queries).
        rotations: float32 ``(R, c, H, d)``.
        valid: optional boolean ``(B, n)``; False: bucket ``2c`` (no bucket).

    Returns:
        int32 ``(B, R * H, n)`` in ``[0, 2c]``, round-major (round ``r``,
        head ``h`` is row ``r * H + h``).
    """
    x = ops.stop_gradient(ops.cast(x, "float32"))
    num_rounds, c = rotations.shape[0], rotations.shape[1]
    rounds = []
    for r in range(num_rounds):
        proj = ops.einsum("bnhd,chd->bhnc", x, rotations[r])  # (B, H, n, c)
        j = ops.cast(ops.argmax(ops.abs(proj), axis=-1), "int32")  # (B, H, n)
        value = ops.take_along_axis(proj, j[..., None], axis=-1)[..., 0]
        rounds.append(j + ops.cast(ops.where(value < 0.0, c, 0), "int32"))
    buckets = ops.concatenate(rounds, axis=1) if num_rounds > 1 else rounds[0]
    if valid is not None:
        buckets = ops.where(ops.cast(valid, "bool")[:, None, :], buckets, 2 * c)
    return ops.stop_gradient(buckets)


def shared_keys(query):
    """The keys of shared-QK attention: each query divided by its norm
    (float32 arithmetic, the query's dtype)."""
    return ops.cast(l2_normalize(query), query.dtype)


def lsh_attention(
    query,
    value,
    buckets,
    num_buckets,
    window,
    causal=False,
    scale=None,
    dropout_fn=None,
):
    """Multi-round LSH attention with shared queries and keys (see the
    module docstring): O(R * n * window * d).

    Args:
        query: ``(B, n, H, d)`` (the keys are the normalised queries).
        value: ``(B, n, H, dv)``.
        buckets: int ``(B, R * H, n)`` from :func:`hash_buckets`
            (``num_buckets`` for tokens that take no part: padding).
        num_buckets: the static bucket count ``2c``.
        window: chunk size (members).
        causal: a token sees no key after it.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to each round's weights.

    Returns:
        ``(B, n, H, dv)``; zeros for tokens that take no part.
    """
    H = query.shape[2]
    num_rounds = buckets.shape[1] // H
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    keys = shared_keys(query)
    tile = (1, 1, num_rounds, 1)
    out, lse, other = sorted_chunk_attention(
        ops.tile(query, tile),
        ops.tile(keys, tile),
        ops.tile(value, tile),
        buckets,
        None,
        num_buckets,
        window,
        shared=True,
        scale=scale,
        dropout_fn=dropout_fn,
        causal=causal,
        return_lse=True,
    )  # (B, n, R*H, dv), (B, R*H, n), (B, R*H, n)
    return combine_rounds(out, lse, other, num_rounds)


def combine_rounds(out, lse, other, num_rounds):
    """One softmax over the rounds: ``sum_r exp(lse_r - logsumexp(lse)) o_r``,
    leaving out the rounds in which a token saw only itself when another
    round showed it another key.

    Args:
        out: ``(B, n, R * H, dv)``.
        lse: float32 ``(B, R * H, n)``.
        other: boolean ``(B, R * H, n)``: the round showed a key other than
            the token itself.
        num_rounds: R.

    Returns:
        ``(B, n, H, dv)`` in the dtype of ``out``.
    """
    dv = out.shape[-1]
    H = out.shape[2] // num_rounds
    n = out.shape[1] if out.shape[1] is not None else ops.shape(out)[1]
    lse = ops.reshape(lse, (-1, num_rounds, H, n))
    other = ops.reshape(other, (-1, num_rounds, H, n))
    keep = ops.logical_or(other, ops.logical_not(ops.any(other, axis=1, keepdims=True)))
    lse = ops.where(keep, lse, MASKED_LOGIT)
    weights = ops.exp(lse - ops.logsumexp(lse, axis=1, keepdims=True))  # (B, R, H, n)
    weights = ops.transpose(weights, (0, 3, 1, 2))[..., None]  # (B, n, R, H, 1)
    parts = ops.reshape(ops.cast(out, "float32"), (-1, n, num_rounds, H, dv))
    return ops.cast(ops.sum(parts * weights, axis=2), out.dtype)


def lsh_weights(query, buckets, num_buckets, window, causal=False, scale=None,
                extra_mask=None):
    """Dense float32 ``(B, H, n, n)`` weights of :func:`lsh_attention`: for
    every round the dense mask of its buckets and chunks
    (:func:`~keras_longattn.ops.chunked.sorted_chunk_mask`), the self rule
    over the union of the rounds, and a softmax in which key ``j`` of query
    ``i`` counts as many times as rounds show it:
    ``N_ij exp(s_ij) / sum_j N_ij exp(s_ij)``. O(R * n^2): the reference.

    Args:
        query: ``(B, n, H, d)``.
        buckets: int ``(B, R * H, n)``.
        num_buckets: the static bucket count.
        window: chunk size.
        causal: no key after the query.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        extra_mask: optional boolean mask broadcastable to ``(B, H, n, n)``
            (a dense ``attention_mask``), ANDed into every round.
    """
    H = query.shape[2]
    num_rounds = buckets.shape[1] // H
    if scale is None:
        scale = 1.0 / math.sqrt(float(query.shape[-1]))
    q = ops.cast(query, "float32")
    keys = l2_normalize(q)
    scores = ops.einsum("bthd,bshd->bhts", q * scale, keys)
    n = scores.shape[-1] if scores.shape[-1] is not None else ops.shape(scores)[-1]
    pos = ops.arange(n, dtype="int32")
    not_self = ops.not_equal(pos[:, None], pos[None, :])[None, None]
    masks = []
    for r in range(num_rounds):
        mask = sorted_chunk_mask(
            buckets[:, r * H : (r + 1) * H], None, num_buckets, window,
            shared=True, causal=causal,
        )
        masks.append(combine_dense_masks(mask, extra_mask))
    any_other = None
    for mask in masks:
        other = ops.any(ops.logical_and(mask, not_self), axis=-1, keepdims=True)
        any_other = other if any_other is None else ops.logical_or(any_other, other)
    count = None
    for mask in masks:
        mask = ops.where(any_other, ops.logical_and(mask, not_self), mask)
        term = ops.cast(mask, "float32")
        count = term if count is None else count + term
    logits = scores + ops.log(ops.maximum(count, 1.0))
    return masked_softmax(logits, count > 0.0)
