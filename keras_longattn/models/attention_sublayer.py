"""The residual attention sublayer (``"s"`` of a layer pattern)."""

import keras

from keras_longattn.models import _attention_config
from keras_longattn.models._validation import check_rate


@keras.saving.register_keras_serializable(package="keras_longattn")
class AttentionSublayer(keras.layers.Layer):
    """Norm + self-attention + dropout + residual.

    Pre-norm (default): ``x + dropout(attention(norm(x)))``. Post-norm:
    ``norm(x + dropout(attention(x)))``. Any layer with the call signature
    of ``keras.layers.MultiHeadAttention`` works (every layer of
    :mod:`keras_longattn.layers`, MultiHeadAttention itself).

    Padding masks propagate: the Keras mask of the input (e.g. from
    ``Embedding(mask_zero=True)``), or an explicit ``mask``, is passed to the
    attention as ``query_mask`` and ``value_mask``, and is kept on the output.

    Args:
        attention: the attention layer: an instance (used as is; one
            instance cannot serve two sublayers, which would share its
            weights silently), or a config dict ``{"class_name": ...,
            "config": {...}}`` as produced by
            ``keras.saving.serialize_keras_object(layer)`` (the sublayer
            makes its own layer), or a class name such as
            ``"FullAttention"``. Its output must have the input's width
            (the default of MultiHeadAttention-like layers).
        dropout: dropout rate on the attention output. Defaults to 0.
        normalize_first: pre-norm (True, default) or post-norm (False).
        causal: passed to the attention as ``use_causal_mask``. Defaults
            to False. An attention without that mode (``supports_causal``
            or ``supports_bidirectional`` False) is refused with a
            ``ValueError``.
        layer_norm_epsilon: epsilon of the LayerNormalization. Defaults to
            1e-5.
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Call arguments:
        inputs: ``(B, n, dim)``.
        mask: optional boolean ``(B, n)``, False at padded positions.
            Defaults to the input's Keras mask.
        training: whether dropout is active.
        use_causal_mask: overrides ``causal`` for this call when not None.
        cache: optional decoding cache of the attention layer (its
            ``init_cache(batch_size, max_length)`` makes an empty one), with
            keras-hub's convention: given with ``cache_update_index``, the
            call is causal self-attention of the new tokens at positions
            ``cache_update_index ..`` over the cached ones, and returns
            ``(output, new_cache)``. No padding mask may be given then.
        cache_update_index: the position of the first token of ``inputs``
            (an int or a scalar integer tensor), with ``cache``.

    Returns:
        ``(B, n, dim)``, with the input's mask; ``(output, new_cache)`` when
        decoding with a cache.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.layers import LocalAttention
    >>> from keras_longattn.models import AttentionSublayer
    >>> sublayer = AttentionSublayer(
    ...     LocalAttention(num_heads=2, key_dim=8, window=4), causal=True)
    >>> tuple(sublayer(np.zeros((2, 24, 16), "float32")).shape)
    (2, 24, 16)
    """

    def __init__(
        self,
        attention,
        dropout=0.0,
        normalize_first=True,
        causal=False,
        layer_norm_epsilon=1e-5,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.causal = bool(causal)
        layer = _attention_config.deserialize_attention(attention)
        _attention_config.check_capabilities(
            layer, "attention", attention, causal=self.causal
        )
        self.attention = _attention_config.adopt(layer, self)
        self.dropout = check_rate("dropout", dropout)
        self.normalize_first = bool(normalize_first)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name="norm"
        )
        self.dropout_layer = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        self.norm.build(input_shape)
        if not self.attention.built:
            self.attention.build(input_shape, input_shape)
        self.built = True

    def call(
        self,
        inputs,
        mask=None,
        training=None,
        use_causal_mask=None,
        cache=None,
        cache_update_index=None,
    ):
        causal = self.causal if use_causal_mask is None else bool(use_causal_mask)
        h = self.norm(inputs) if self.normalize_first else inputs
        if cache is not None or cache_update_index is not None:
            return self._call_with_cache(
                inputs, h, mask, training, causal, cache, cache_update_index
            )
        h = self.attention(
            h,
            h,
            query_mask=mask,
            value_mask=mask,
            training=training,
            use_causal_mask=causal,
        )
        h = self.dropout_layer(h, training=training)
        out = inputs + h
        if not self.normalize_first:
            out = self.norm(out)
        return out

    def _call_with_cache(self, inputs, h, mask, training, causal, cache, index):
        """The residual branch with the attention's decoding cache; returns
        ``(output, new_cache)``."""
        if mask is not None:
            raise ValueError(
                f"{self.name} decodes without a padding mask (the cache holds "
                "real tokens only; decode each sequence from its own length). "
                "Received: mask with a cache"
            )
        if not callable(getattr(self.attention, "decode_refusal", None)):
            raise ValueError(
                f"{type(self.attention).__name__} (in {self.name}) has no "
                "decoding cache: it does not take `cache` and "
                "`cache_update_index`. Received: cache="
                f"{'given' if cache is not None else None}"
            )
        h, cache = self.attention(
            h,
            h,
            training=training,
            use_causal_mask=causal,
            cache=cache,
            cache_update_index=index,
        )
        h = self.dropout_layer(h, training=training)
        out = inputs + h
        if not self.normalize_first:
            out = self.norm(out)
        return out, cache

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "attention": keras.saving.serialize_keras_object(self.attention),
                "dropout": self.dropout,
                "normalize_first": self.normalize_first,
                "causal": self.causal,
                "layer_norm_epsilon": self.layer_norm_epsilon,
            }
        )
        return config
