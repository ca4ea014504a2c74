"""GPT-2's decoder block (keras-hub's ``TransformerDecoder``) with our attention."""

import keras

from keras_longattn.hub._keras_hub import TransformerDecoder
from keras_longattn.hub._keras_hub import clone_initializer
from keras_longattn.hub.attention import _AttentionSpecMixin
from keras_longattn.hub.attention import _make_attention
from keras_longattn.hub.attention import _padding
from keras_longattn.hub.attention import _refuse_dense_mask
from keras_longattn.hub.attention import _replace_attention


# ------------------------------------------------------------------- blocks
@keras.saving.register_keras_serializable(package="keras_longattn")
class LongTransformerDecoder(_AttentionSpecMixin, TransformerDecoder):
    """keras-hub's ``TransformerDecoder`` (decoder-only: no cross-attention)
    whose self-attention is one of our layers.

    The feed-forward network, norms and dropout are keras-hub's. The
    attention gets the padding mask as ``value_mask`` and causality as
    ``use_causal_mask``; with ``self_attention_cache`` and
    ``self_attention_cache_update_index`` it decodes through the layer's own
    cache (``layer.init_cache``), as keras-hub's ``CausalLM.call_with_cache``
    calls its blocks.

    Args:
        intermediate_dim: the feed-forward network's hidden size.
        num_heads: the number of attention heads (head size:
            ``hidden_dim // num_heads``).
        attention: the attention layer's config (see :func:`attention_spec`).
        **kwargs: the other arguments of keras-hub's ``TransformerDecoder``.
    """

    def __init__(self, intermediate_dim, num_heads, attention, **kwargs):
        shape = kwargs.pop("decoder_sequence_shape", None)
        if kwargs.pop("encoder_sequence_shape", None):
            raise ValueError(
                "LongTransformerDecoder has no cross-attention. Received: "
                "encoder_sequence_shape")
        super().__init__(intermediate_dim, num_heads, **kwargs)
        self._set_attention(attention)
        if shape:
            self.build(shape)

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        if encoder_sequence_shape:
            raise ValueError(
                "LongTransformerDecoder has no cross-attention. Received: "
                f"encoder_sequence_shape={encoder_sequence_shape}")
        super().build(decoder_sequence_shape)
        hidden_dim = decoder_sequence_shape[-1]
        layer = _make_attention(
            self.attention,
            name="self_attention",
            dtype=self.dtype_policy,
            num_heads=self.num_heads,
            key_dim=hidden_dim // self.num_heads,
            use_bias=True,
            dropout=self.dropout,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
        )
        layer.build(decoder_sequence_shape, decoder_sequence_shape)
        _replace_attention(self, layer)

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_padding_mask=None,
        encoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        cross_attention_cache_update_index=None,
        use_causal_mask=True,
        training=None,
    ):
        if encoder_sequence is not None:
            raise ValueError(
                "LongTransformerDecoder has no cross-attention. Received: "
                "encoder_sequence")
        _refuse_dense_mask(self, "decoder_attention_mask", decoder_attention_mask)
        x = decoder_sequence
        residual = x
        if self.normalize_first:
            x = self._self_attention_layer_norm(x)
        if self_attention_cache is not None:
            x, self_attention_cache = self._self_attention_layer(
                x, x, use_causal_mask=True, cache=self_attention_cache,
                cache_update_index=self_attention_cache_update_index,
                training=training)
        else:
            x = self._self_attention_layer(
                x, x, value_mask=_padding(decoder_padding_mask),
                use_causal_mask=use_causal_mask, training=training)
        x = self._self_attention_dropout(x, training=training)
        x = x + residual
        if not self.normalize_first:
            x = self._self_attention_layer_norm(x)
        residual = x
        if self.normalize_first:
            x = self._feedforward_layer_norm(x)
        x = self._feedforward_intermediate_dense(x)
        x = self._feedforward_output_dense(x)
        x = self._feedforward_dropout(x, training=training)
        x = x + residual
        if not self.normalize_first:
            x = self._feedforward_layer_norm(x)
        if self_attention_cache is not None:
            return x, self_attention_cache
        return x

    def get_config(self):
        config = super().get_config()
        config.pop("encoder_sequence_shape", None)
        config["attention"] = self.attention
        return config
