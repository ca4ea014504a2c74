"""Dense softmax attention, the baseline every mechanism is measured against."""

import keras
from keras import ops

from keras_longattn.layers.base_attention import BaseAttention


@keras.saving.register_keras_serializable(package="keras_longattn")
class FullAttention(BaseAttention):
    """Full (dense) multi-head attention: every query sees every key.

    The baseline of the library, and a drop-in replacement for
    ``keras.layers.MultiHeadAttention`` with identical outputs on copied
    weights. Cost: O(n^2 * d) time; memory O(n^2) where the backend
    materialises the scores (the ``"reference"`` path, and
    ``keras.ops.dot_product_attention`` on JAX and TensorFlow on CPU),
    O(n) where the backend has a streaming flash kernel (PyTorch's
    ``scaled_dot_product_attention``).

    Implementations:
        ``"fused"``: ``keras.ops.dot_product_attention`` with the backend's
        flash/fused kernels; used whenever attention weights are not
        requested and no attention dropout is active.
        ``"reference"``: explicit scores, masked softmax and dropout.

    Accepts a dense ``attention_mask`` ``(B, T, S)`` on every path.

    Args:
        See :class:`keras_longattn.layers.BaseAttention` (the arguments of
        ``keras.layers.MultiHeadAttention``), plus ``implementation``.

    Example:

    >>> import numpy as np
    >>> import keras_longattn
    >>> layer = keras_longattn.layers.FullAttention(num_heads=2, key_dim=8)
    >>> x = np.random.rand(2, 16, 32).astype("float32")
    >>> tuple(layer(x, x, use_causal_mask=True).shape)
    (2, 16, 32)

    Reference:
        Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
    """

    implementations = ("fused",)
    supports_attention_mask = True

    def _unsupported_fused(self, context):
        if self.dropout > 0.0 and context.training:
            return "attention dropout in training needs explicit weights"
        return None

    def _attention_fused(self, query, key, value, context):
        mask = None
        key_padding = context.padding.key_mask
        if key_padding is not None:
            mask = ops.cast(key_padding, "bool")[:, None, None, :]  # (B, 1, 1, S)
        if context.attention_mask is not None:
            dense = ops.cast(context.attention_mask, "bool")[:, None]  # (B, 1, T, S)
            mask = dense if mask is None else ops.logical_and(mask, dense)
        out = ops.dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            scale=self._inverse_sqrt_key_dim,
            is_causal=context.causal,
        )
        # Backends give a uniform row where no key is visible; the contract
        # is a zero output there.
        visible = self._rows_with_visible_keys(context)
        if visible is not None:
            out = ops.where(visible[:, :, None, None], out, ops.zeros_like(out))
        return out

    def _rows_with_visible_keys(self, context):
        """``(B, T)`` or ``(B, 1)``: does a query see at least one key?"""
        key_padding = context.padding.key_mask
        if context.attention_mask is not None:
            return ops.any(self.reference_mask(context), axis=-1)
        if key_padding is None:
            return None
        kp = ops.cast(key_padding, "int32")
        if not context.causal:
            return ops.any(ops.cast(kp, "bool"), axis=-1, keepdims=True)
        T, S = context.query_length, context.key_length
        seen = ops.cumsum(kp, axis=1) > 0  # (B, S): a key <= j is visible
        last = ops.minimum(ops.arange(T, dtype="int32"), S - 1)
        return ops.take(seen, last, axis=1)  # (B, T)
