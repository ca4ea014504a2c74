"""BERT's and RoBERTa's encoder block (keras-hub's ``TransformerEncoder``) with our attention."""

import keras

from keras_longattn.hub._keras_hub import TransformerEncoder
from keras_longattn.hub._keras_hub import clone_initializer
from keras_longattn.hub.attention import _AttentionSpecMixin
from keras_longattn.hub.attention import _make_attention
from keras_longattn.hub.attention import _padding
from keras_longattn.hub.attention import _refuse_dense_mask
from keras_longattn.hub.attention import _replace_attention


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongTransformerEncoder(_AttentionSpecMixin, TransformerEncoder):
    """keras-hub's ``TransformerEncoder`` whose self-attention is one of our
    layers (bidirectional; the padding mask goes to it as ``value_mask``,
    so padded keys are hidden from every query and padded queries still
    get an output, as in keras-hub).

    Args:
        intermediate_dim: the feed-forward network's hidden size.
        num_heads: the number of attention heads (head size:
            ``hidden_dim // num_heads``).
        attention: the attention layer's config (see :func:`attention_spec`).
        **kwargs: the other arguments of keras-hub's ``TransformerEncoder``.
    """

    def __init__(self, intermediate_dim, num_heads, attention, **kwargs):
        super().__init__(intermediate_dim, num_heads, **kwargs)
        self._set_attention(attention)

    def build(self, inputs_shape):
        super().build(inputs_shape)
        hidden_dim = inputs_shape[-1]
        layer = _make_attention(
            self.attention,
            name="self_attention_layer",
            dtype=self.dtype_policy,
            num_heads=self.num_heads,
            key_dim=hidden_dim // self.num_heads,
            use_bias=True,
            dropout=self.dropout,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
        )
        layer.build(inputs_shape, inputs_shape)
        _replace_attention(self, layer)

    def call(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
    ):
        _refuse_dense_mask(self, "attention_mask", attention_mask)
        x = inputs
        residual = x
        if self.normalize_first:
            x = self._self_attention_layer_norm(x)
        result = self._self_attention_layer(
            x, x, value_mask=_padding(padding_mask),
            return_attention_scores=return_attention_scores, training=training)
        x, scores = result if return_attention_scores else (result, None)
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
        if return_attention_scores:
            return x, scores
        return x
