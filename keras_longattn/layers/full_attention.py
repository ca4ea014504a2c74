"""Dense softmax attention, the baseline every mechanism is measured against."""

import keras
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.dispatch import CONTEXT_PARALLEL
from keras_longattn.layers.dispatch import context_parallel_axes
from keras_longattn.layers.dispatch import context_parallel_refusal
from keras_longattn.layers.dispatch import implementation


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
        ``"context_parallel"`` (JAX, under a
        :class:`keras_longattn.parallel.ContextParallel` distribution,
        where ``"auto"`` picks it first): ring attention
        (:func:`keras_longattn.parallel.ring_attention`), the sequence split
        over the distribution's sequence axis; no dense ``attention_mask``,
        no attention dropout in training, lengths a multiple of the
        devices (2 x the devices when causal, equal lengths).
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

    supports_attention_mask = True
    # The reference is as quadratic as the fused path: nothing to warn of.
    warns_on_reference_fallback = False

    @implementation("fused", kind="fused", dropout=False)
    def _fused(self, query, key, value, context):
        """``keras.ops.dot_product_attention`` under the call's masks."""
        mask = None
        key_padding = context.padding.key_mask
        if key_padding is not None:
            mask = ops.cast(key_padding, "bool")[:, None, None, :]  # (B, 1, 1, S)
        if context.attention_mask is not None:
            dense = ops.cast(context.attention_mask, "bool")[:, None]  # (B, 1, T, S)
            mask = dense if mask is None else ops.logical_and(mask, dense)
        return la_ops.fused_dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            scale=self._inverse_sqrt_key_dim,
            is_causal=context.causal,
        )

    @implementation("context_parallel", kind=CONTEXT_PARALLEL, dropout=False)
    def _context_parallel(self, query, key, value, context):
        """Ring attention over the sequence axis of the
        :class:`~keras_longattn.parallel.ContextParallel` in scope (key and
        value blocks passed around the ring, causal load balanced)."""
        from keras_longattn.parallel.context import ring_attention

        return ring_attention(
            query, key, value, causal=context.causal,
            key_mask=context.padding.key_mask, scale=self._inverse_sqrt_key_dim,
            **context_parallel_axes(query.shape[0]),
        )

    @_context_parallel.refuses
    def _context_parallel(self, context):
        # Causal: the zigzag layout cuts the sequence into 2 x devices chunks.
        return context_parallel_refusal(
            context, multiple=2 if context.causal else 1, self_attention=context.causal)

    def full_attention_limit(self, sequence_length):
        return {}, 1e-6

    # -------------------------------------------------------------- decoding
    def decode_refusal(self):
        return None

    def cache_shape(self, batch_size, max_length):
        """``(batch_size, 2, max_length, num_key_value_heads, key_dim)``: the keys
        (``[:, 0]``) and values (``[:, 1]``) of every position, as
        keras-hub's ``CachedMultiHeadAttention`` keeps them."""
        return (batch_size, 2, max_length, self.num_key_value_heads, self.key_dim)

    def _decode(self, query, key, value, cache, index, training):
        """Writes the new keys and values at ``index`` and attends the new
        queries to every cached position up to their own."""
        T, S = query.shape[1], cache.shape[2]
        cache, keys, values = self._written_full_cache(cache, key, value, index)
        q_pos = index + ops.arange(T, dtype="int32")
        visible = ops.arange(S, dtype="int32")[None, :] <= q_pos[:, None]  # (T, S)
        out = la_ops.reference_attention(
            query, self.expand_key_value_heads(keys), self.expand_key_value_heads(values),
            mask=visible[None], scale=self._inverse_sqrt_key_dim,
            dropout_fn=self._dropout_fn(training))
        return out, cache
