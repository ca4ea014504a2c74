"""Dense masked attention: the specification every efficient path is checked
against; and the softmax pieces that efficient paths share (a masked
softmax, its log-sum-exp, and the exact merge of attention parts computed
over disjoint key sets).

Shape legend: B batch, T query length, S key length, H heads, d key/query
head size, dv value head size.
"""

from keras import ops

from keras_longattn.kernels.constants import MASKED_LOGIT


def masked_softmax(scores, mask=None, axis=-1):
    """Softmax in float32 over ``axis`` with a boolean ``mask``.

    Masked entries get probability exactly 0 (and exactly zero gradient);
    a row with no visible entry gets all zeros instead of a uniform row.
    The result has the dtype of ``scores``.

    Args:
        scores: logits of any float dtype.
        mask: optional boolean tensor broadcastable to ``scores``.
        axis: the axis to normalise.
    """
    dtype = scores.dtype
    scores = ops.cast(scores, "float32")
    if mask is None:
        return ops.cast(ops.softmax(scores, axis=axis), dtype)
    mask = ops.cast(mask, "bool")
    scores = ops.where(mask, scores, MASKED_LOGIT)
    probs = ops.softmax(scores, axis=axis)
    probs = ops.where(mask, probs, 0.0)
    return ops.cast(probs, dtype)


def reference_attention(
    query,
    key,
    value,
    mask=None,
    scale=None,
    dropout_fn=None,
    return_scores=False,
):
    """Dense multi-head scaled dot-product attention with a boolean mask.

    Memory is O(B * H * T * S): this is the specification, not a fast path.

    Args:
        query: ``(B, T, H, d)``.
        key: ``(B, S, H, d)``.
        value: ``(B, S, H, dv)``.
        mask: optional boolean mask, True where attention is allowed,
            broadcastable to ``(B, T, S)`` (rank 2 or 3) or to
            ``(B, H, T, S)`` (rank 4).
        scale: multiplier of the logits. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights.
        return_scores: also return the ``(B, H, T, S)`` weights.

    Returns:
        ``(B, T, H, dv)``, and the weights when ``return_scores=True``.
        A query with no visible key gets a zero output.
    """
    if scale is None:
        scale = 1.0 / float(query.shape[-1]) ** 0.5
    query = ops.multiply(query, ops.cast(scale, query.dtype))
    # (B, T, H, d) x (B, S, H, d) -> (B, H, T, S)
    scores = ops.einsum("bthd,bshd->bhts", query, key)
    if mask is not None:
        mask = ops.cast(mask, "bool")
        rank = len(mask.shape)
        if rank == 2:  # (T, S)
            mask = mask[None, None, :, :]
        elif rank == 3:  # (B, T, S)
            mask = ops.expand_dims(mask, 1)
        elif rank != 4:
            raise ValueError(
                "`mask` must have rank 2, 3 or 4. "
                f"Received: mask.shape={tuple(mask.shape)}"
            )
    probs = masked_softmax(scores, mask, axis=-1)
    weights = probs
    if dropout_fn is not None:
        probs = dropout_fn(probs)
    # (B, H, T, S) x (B, S, H, dv) -> (B, T, H, dv)
    out = ops.einsum("bhts,bshd->bthd", probs, value)
    if return_scores:
        return out, weights
    return out


def merge_attention_parts(parts):
    """Merges attention computed over disjoint key sets into one softmax
    (the log-sum-exp merge: e.g. a band part and a global-token part).

    Each part is ``(out, lse)``: its normalised output ``(B, T, H, dv)`` and
    the log-sum-exp of its logits ``(B, T, H)`` (float32, ``MASKED_LOGIT``
    where the part sees no key). The result is
    ``sum_p out_p * exp(lse_p - lse)`` with ``lse = logaddexp_p(lse_p)``,
    finite everywhere (rows that see no key in any part stay zero).
    """
    dtype = parts[0][0].dtype
    lse = parts[0][1]
    for _, other in parts[1:]:
        lse = ops.logaddexp(lse, other)
    total = None
    for out, part_lse in parts:
        weight = ops.exp(part_lse - lse)[..., None]
        term = ops.cast(out, "float32") * weight
        total = term if total is None else total + term
    return ops.cast(total, dtype)


def softmax_with_lse(scores, mask):
    """Masked softmax in float32 over the last axis, and its log-sum-exp.

    Returns ``(probs, lse)``: ``probs`` in the dtype of ``scores``, exactly 0
    on masked entries and on rows with no visible entry (as
    :func:`keras_longattn.ops.masked_softmax`); ``lse`` float32 without the
    last axis, about ``MASKED_LOGIT`` on rows with no visible entry. Finite
    values and gradients everywhere.
    """
    dtype = scores.dtype
    mask = ops.cast(mask, "bool")
    scores = ops.where(mask, ops.cast(scores, "float32"), MASKED_LOGIT)
    top = ops.stop_gradient(ops.max(scores, axis=-1, keepdims=True))
    e = ops.exp(scores - top)
    total = ops.sum(e, axis=-1, keepdims=True)
    probs = ops.where(mask, e / total, 0.0)
    # A row with no visible entry has lse = MASKED_LOGIT + log(count), which
    # rounds to MASKED_LOGIT in float32: finite, and weightless when merged.
    lse = ops.squeeze(top + ops.log(total), -1)
    return ops.cast(probs, dtype), lse
