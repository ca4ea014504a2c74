"""Dense masked attention: the specification every efficient path is checked
against.

Shape legend: B batch, T query length, S key length, H heads, d key/query
head size, dv value head size.
"""

from keras import ops

#: Logit given to masked entries before the softmax. Finite, so that a row
#: with no visible key stays finite; such rows are zeroed afterwards.
MASKED_LOGIT = -1e30


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
