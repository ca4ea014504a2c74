"""The backend's fused attention kernel under the library's contract.

Every ``"fused"`` implementation (``FullAttention``, and the block layouts
of local, sparse and routing attention) calls
:func:`fused_dot_product_attention`: ``keras.ops.dot_product_attention``
(PyTorch's ``scaled_dot_product_attention``, flash attention on its CPU;
XLA's fused attention on JAX) with two guarantees the bare kernel lacks:

* a query that sees no key gets a zero output (the kernel would average
  every key, or return NaN);
* any value head size works (the backend table pads where a kernel needs
  equal head sizes).

Shape legend: B batch, T query length, S key length, H heads, d key/query
head size, dv value head size.
"""

from keras import ops

from keras_longattn.kernels import backend_ops
from keras_longattn.ops.shapes import length


def fused_dot_product_attention(q, k, v, mask=None, is_causal=False, scale=None):
    """Fused scaled dot-product attention with zero rows where no key is
    visible.

    Args:
        q: ``(B, T, H, d)``.
        k: ``(B, S, H, d)``.
        v: ``(B, S, H, dv)``.
        mask: optional boolean, True where attention is allowed,
            broadcastable to ``(B, H, T, S)`` (missing leading axes are
            added).
        is_causal: also mask keys after the query (top-left aligned).
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.

    Returns:
        ``(B, T, H, dv)``.
    """
    if mask is not None:
        mask = ops.cast(mask, "bool")
        while len(mask.shape) < 4:
            mask = ops.expand_dims(mask, 0)
    out = backend_ops().dot_product_attention(
        q, k, v, mask=mask, is_causal=is_causal, scale=scale
    )
    visible = visible_rows(mask, is_causal, length(q, 1), length(k, 1))
    if visible is None:
        return out
    return ops.where(visible, out, ops.zeros_like(out))


def visible_rows(mask, is_causal, query_length, key_length):
    """Whether each query sees at least one key: boolean broadcastable to
    ``(B, T, H, 1)``, or None when every query does.

    Args:
        mask: None or boolean rank-4 ``(B|1, H|1, T|1, S)``.
        is_causal: keys after the query are masked too.
        query_length: T (an int, or a scalar tensor while tracing).
        key_length: S.
    """
    if mask is None:
        return None  # with is_causal, query t sees key 0
    if is_causal:
        if mask.shape[2] == 1:
            # Key padding only: query t sees a key iff some key <= t is
            # valid; one cumulative sum instead of a (T, S) product.
            seen = ops.cumsum(ops.cast(mask[:, :, 0, :], "int32"), axis=-1) > 0
            last = ops.minimum(ops.arange(query_length, dtype="int32"), key_length - 1)
            rows = ops.take(seen, last, axis=-1)  # (B|1, H|1, T)
        else:
            t = ops.arange(length(mask, 2), dtype="int32")[:, None]
            s = ops.arange(key_length, dtype="int32")[None, :]
            rows = ops.any(ops.logical_and(mask, s <= t), axis=-1)
    else:
        rows = ops.any(mask, axis=-1)  # (B|1, H|1, T|1)
    return ops.transpose(rows, (0, 2, 1))[..., None]
