"""The call shared by the Llama and Mistral decoder blocks with our attention (their gated feed-forward and RMS norms kept)."""

from keras import ops

from keras_longattn.hub._keras_hub import clone_initializer
from keras_longattn.hub.attention import _AttentionSpecMixin
from keras_longattn.hub.attention import _make_attention
from keras_longattn.hub.attention import _padding
from keras_longattn.hub.attention import _refuse_dense_mask
from keras_longattn.hub.attention import _replace_attention


def _gated_decoder_call(
    block,
    decoder_sequence,
    decoder_padding_mask,
    decoder_attention_mask,
    self_attention_cache,
    self_attention_cache_update_index,
    training,
):
    """The call of keras-hub's Llama and Mistral decoder blocks (pre-norm,
    gated feed-forward network) with our attention: padding as
    ``value_mask``, causal, decoding through the layer's cache."""
    _refuse_dense_mask(block, "decoder_attention_mask", decoder_attention_mask)
    residual = decoder_sequence
    x = block._self_attention_layernorm(decoder_sequence)
    if self_attention_cache is not None:
        x, self_attention_cache = block._self_attention_layer(
            x, x, use_causal_mask=True, cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index,
            training=training)
    else:
        x = block._self_attention_layer(
            x, x, value_mask=_padding(decoder_padding_mask),
            use_causal_mask=True, training=training)
    x = block._self_attention_dropout(x, training=training)
    x = x + residual
    residual = x
    x = block._feedforward_layernorm(x)
    gate_output = block._feedforward_gate_dense(x)
    gate_output = ops.cast(gate_output, "float32")
    gate_output = block.activation(gate_output)
    gate_output = ops.cast(gate_output, block.compute_dtype)
    x = block._feedforward_intermediate_dense(x)
    x = block._feedforward_output_dense(ops.multiply(x, gate_output))
    x = x + residual
    if self_attention_cache is not None:
        return x, self_attention_cache
    return x


class _GatedDecoderMixin(_AttentionSpecMixin):
    """The build and call shared by the Llama and Mistral blocks: our layer
    with the block's query and key/value heads, no biases and its rotary
    wavelength, in place of keras-hub's attention."""

    def __init__(self, intermediate_dim, num_query_heads, num_key_value_heads, attention,
                 **kwargs):
        super().__init__(intermediate_dim, num_query_heads, num_key_value_heads, **kwargs)
        self._set_attention(attention)

    def _head_size(self, hidden_dim):
        return hidden_dim // self.num_query_heads

    def build(self, decoder_sequence_shape):
        super().build(decoder_sequence_shape)
        hidden_dim = decoder_sequence_shape[-1]
        layer = _make_attention(
            self.attention,
            name="self_attention",
            dtype=self.dtype_policy,
            num_heads=self.num_query_heads,
            key_dim=self._head_size(hidden_dim),
            num_key_value_heads=self.num_key_value_heads,
            use_bias=False,
            rotary_max_wavelength=self.rope_max_wavelength,
            dropout=self.dropout,
            kernel_initializer=clone_initializer(self.kernel_initializer),
        )
        layer.build(decoder_sequence_shape, decoder_sequence_shape)
        _replace_attention(self, layer)

    def call(
        self,
        decoder_sequence,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        training=None,
    ):
        return _gated_decoder_call(
            self, decoder_sequence, decoder_padding_mask, decoder_attention_mask,
            self_attention_cache, self_attention_cache_update_index, training)
