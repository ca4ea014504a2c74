"""Every query against a fixed subset of the keys.

The shared machinery of attention parts whose keys are a small set chosen by
position: the Sparse Transformer's summary cells (the last cells of every
block), Longformer's and BigBird's global tokens, any "memory" or summary
keys. The keys of the subset are given already selected, with their static
positions; the attention pattern is evaluated on (query position, key
position) pairs of the subset only, so nothing of size ``T * S`` is built.
The queries can be split into groups that each read only a prefix of the
subset (causal attention reads only the keys up to the group's end). The
explicit form returns the log-sum-exp of each query's logits too, so the
part can be merged exactly with other parts
(:func:`keras_longattn.ops.merge_attention_parts`).

Shape legend: B batch, T query length, K keys in the subset, H heads, d
head size, dv value head size.
"""

import keras
import numpy as np
from keras import ops

from keras_longattn.ops.fused import fused_dot_product_attention
from keras_longattn.ops.reference import softmax_with_lse
from keras_longattn.ops.shapes import is_static
from keras_longattn.ops.shapes import length

#: Above this many scores per example in one query group, the explicit form
#: recomputes the group's attention in the backward pass (keras.remat)
#: instead of storing its weights, so that long sequences fit in memory.
REMAT_SCORES = 1 << 25


def key_subset_attention(
    query,
    keys,
    values,
    key_positions,
    key_valid,
    pattern,
    query_groups=None,
    scale=None,
    dropout_fn=None,
    fused=False,
):
    """Attention of every query over a subset of the keys.

    Args:
        query: ``(B, T, H, d)``; query ``t`` is at position ``t``.
        keys: ``(B, K, H, d)``, the keys of the subset.
        values: ``(B, K, H, dv)``.
        key_positions: int ``(K,)``, the position of each key of the
            subset (ascending when ``query_groups`` read prefixes), static
            or a tensor; or int ``(B, K)``, positions per example (global
            tokens chosen per example).
        key_valid: boolean ``(B or 1, K)``; False marks padded keys.
        pattern: an :class:`~keras_longattn.ops.AttentionPattern` evaluated
            on the (query, key) position pairs.
        query_groups: optional list of ``(start, stop, read)``: queries
            ``start:stop`` attend to the first ``read`` keys of the subset
            only (keys beyond are known to be masked for them). Defaults to
            one group of every query reading every key.
        scale: logit multiplier. Defaults to ``1 / sqrt(d)``.
        dropout_fn: optional callable applied to the attention weights (not
            with ``fused=True``).
        fused: through :func:`~keras_longattn.ops.fused_dot_product_attention`
            (no log-sum-exp is returned then).

    Returns:
        ``(out, lse)``: ``out`` ``(B, T, H, dv)`` (zeros where a query sees
        no key of the subset) and the float32 log-sum-exp ``(B, T, H)`` of
        each query's logits over the subset (None with ``fused=True``).
    """
    if fused and dropout_fn is not None:
        raise ValueError("`fused=True` does not support attention dropout.")
    T, H, d = length(query, 1), query.shape[2], query.shape[3]
    K = length(keys, 1)
    if scale is None:
        scale = 1.0 / float(d) ** 0.5
    if query_groups is None:
        query_groups = [(0, T, K)]
    if not hasattr(key_positions, "dtype") or isinstance(key_positions, np.ndarray):
        key_positions = np.asarray(key_positions, dtype="int32")
    outs, lses = [], []
    for start, stop, read in query_groups:
        if is_static(start, stop):
            q_pos = ops.convert_to_tensor(np.arange(start, stop, dtype="int32"))
        else:
            q_pos = ops.arange(start, stop, dtype="int32")
        k_pos = ops.convert_to_tensor(key_positions, dtype="int32")
        if len(k_pos.shape) == 2:  # per example: (B, K) -> (B, 1, 1, read)
            k_pos = k_pos[:, None, None, :read]
        else:
            k_pos = k_pos[None, None, None, :read]
        allowed = pattern.allowed(q_pos[None, None, :, None], k_pos)  # (B or 1, 1, Tg, read)
        mask = ops.logical_and(allowed, ops.cast(key_valid, "bool")[:, None, None, :read])
        q = query[:, start:stop]
        if fused:
            outs.append(
                fused_dot_product_attention(
                    q, keys[:, :read], values[:, :read], mask=mask, scale=scale
                )
            )
            continue

        def attend(q, k, v, mask=mask):
            if scale != 1.0:
                q = ops.multiply(q, ops.cast(scale, q.dtype))
            # (B, Tg, H, d) x (B, read, H, d) -> (B, H, Tg, read)
            scores = ops.einsum("bqhd,bkhd->bhqk", q, k)
            probs, lse = softmax_with_lse(scores, mask)  # lse: (B, H, Tg)
            if dropout_fn is not None:
                probs = dropout_fn(probs)
            # (B, H, Tg, read) x (B, read, H, dv) -> (B, Tg, H, dv)
            return ops.einsum("bhqk,bkhd->bqhd", probs, v), lse

        if (
            dropout_fn is None
            and is_static(start, stop, read)
            and (stop - start) * read * H > REMAT_SCORES
        ):
            attend = keras.remat(attend)
        out, lse = attend(q, keys[:, :read], values[:, :read])
        outs.append(out)
        lses.append(ops.transpose(lse, (0, 2, 1)))
    out = outs[0] if len(outs) == 1 else ops.concatenate(outs, axis=1)
    if fused:
        return out, None
    lse = lses[0] if len(lses) == 1 else ops.concatenate(lses, axis=1)
    return out, lse
