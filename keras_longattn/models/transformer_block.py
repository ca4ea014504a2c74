"""A Transformer block around any attention layer."""

import keras

from keras_longattn.models.attention_sublayer import AttentionSublayer
from keras_longattn.models.feedforward_sublayer import FeedForwardSublayer


@keras.saving.register_keras_serializable(package="keras_longattn")
class TransformerBlock(keras.layers.Layer):
    """Self-attention sublayer followed by a feed-forward sublayer.

    The ``"sf"`` pair of a layer pattern: an :class:`AttentionSublayer`
    (norm + attention + dropout + residual) then a
    :class:`FeedForwardSublayer` (norm + MLP + dropout + residual). Pre-norm
    by default; ``normalize_first=False`` gives the post-norm block of
    Vaswani et al. Works with every layer of :mod:`keras_longattn.layers`
    and with ``keras.layers.MultiHeadAttention``.

    Padding: the block supports Keras masking. The mask of its input (e.g.
    from ``Embedding(mask_zero=True)``) or an explicit ``mask`` reaches the
    attention as ``query_mask``/``value_mask`` and stays on the output.

    Serialisation: ``get_config()`` holds the attention's serialized config
    and ``from_config`` builds a fresh attention from it, so blocks save and
    load in ``.keras`` files and work in functional models.

    Args:
        attention: the attention layer, either an instance (the block uses
            it; an instance cannot serve two blocks, whose weights would be
            shared silently), a config dict ``{"class_name": ...,
            "config": {...}}`` as produced by
            ``keras.saving.serialize_keras_object(layer)`` /
            ``keras.layers.serialize(layer)`` (each block makes its own
            layer: import ``keras_longattn.layers`` first so that the
            library's classes are registered), or a class name such as
            ``"FullAttention"`` for layers whose defaults suffice.
        feedforward_dim: hidden width of the MLP. Defaults to 4 times the
            input width.
        dropout: dropout rate on the attention and MLP outputs. Defaults to 0.
        activation: activation of the MLP. Defaults to ``"gelu"``.
        normalize_first: pre-norm (True, default) or post-norm (False).
        causal: passed to the attention as ``use_causal_mask``. Defaults to
            False.
        layer_norm_epsilon: epsilon of both LayerNormalizations. Defaults to
            1e-5.
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Call arguments:
        inputs: ``(B, n, dim)``.
        mask: optional boolean ``(B, n)``; False marks padded positions.
            Defaults to the input's Keras mask.
        training: whether dropout is active.
        use_causal_mask: overrides ``causal`` for this call when not None.
        cache: optional decoding cache of the attention layer, with
            ``cache_update_index`` (see :class:`AttentionSublayer`); the
            block then returns ``(output, new_cache)``.
        cache_update_index: the position of the first token of ``inputs``,
            with ``cache``.

    Returns:
        ``(B, n, dim)``; ``(output, new_cache)`` when decoding with a cache.

    Example:

    >>> import keras
    >>> import numpy as np
    >>> from keras_longattn.layers import LocalAttention
    >>> from keras_longattn.models import TransformerBlock
    >>> config = keras.saving.serialize_keras_object(
    ...     LocalAttention(num_heads=2, key_dim=8, window=4))
    >>> tokens = keras.Input((24,), dtype="int32")
    >>> x = keras.layers.Embedding(30, 16, mask_zero=True)(tokens)
    >>> x = TransformerBlock(config, causal=True)(x)
    >>> x = TransformerBlock(config, causal=True)(x)  # its own attention
    >>> model = keras.Model(tokens, x)
    >>> tuple(model(np.ones((2, 24), "int32")).shape)
    (2, 24, 16)
    """

    def __init__(
        self,
        attention,
        feedforward_dim=None,
        dropout=0.0,
        activation="gelu",
        normalize_first=True,
        causal=False,
        layer_norm_epsilon=1e-5,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.attention_sublayer = AttentionSublayer(
            attention,
            dropout=dropout,
            normalize_first=normalize_first,
            causal=causal,
            layer_norm_epsilon=layer_norm_epsilon,
            dtype=self.dtype_policy,
            name="attention_sublayer",
        )
        self.feedforward_sublayer = FeedForwardSublayer(
            feedforward_dim=feedforward_dim,
            activation=activation,
            dropout=dropout,
            normalize_first=normalize_first,
            layer_norm_epsilon=layer_norm_epsilon,
            dtype=self.dtype_policy,
            name="feedforward_sublayer",
        )
        self.feedforward_dim = self.feedforward_sublayer.feedforward_dim
        self.dropout = self.attention_sublayer.dropout
        self.activation = self.feedforward_sublayer.activation
        self.normalize_first = bool(normalize_first)
        self.causal = bool(causal)
        self.layer_norm_epsilon = float(layer_norm_epsilon)

    @property
    def attention(self):
        """The block's attention layer."""
        return self.attention_sublayer.attention

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        self.attention_sublayer.build(input_shape)
        self.feedforward_sublayer.build(input_shape)
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
        if cache is not None or cache_update_index is not None:
            x, cache = self.attention_sublayer(
                inputs,
                mask=mask,
                training=training,
                use_causal_mask=use_causal_mask,
                cache=cache,
                cache_update_index=cache_update_index,
            )
            return self.feedforward_sublayer(x, training=training), cache
        x = self.attention_sublayer(
            inputs, mask=mask, training=training, use_causal_mask=use_causal_mask
        )
        return self.feedforward_sublayer(x, training=training)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "attention": keras.saving.serialize_keras_object(self.attention),
                "feedforward_dim": self.feedforward_dim,
                "dropout": self.dropout,
                "activation": keras.activations.serialize(self.activation),
                "normalize_first": self.normalize_first,
                "causal": self.causal,
                "layer_norm_epsilon": self.layer_norm_epsilon,
            }
        )
        return config
