"""GPT-2 with our attention in every block."""

import keras

from keras_longattn.hub._keras_hub import Backbone
from keras_longattn.hub._keras_hub import GPT2Backbone
from keras_longattn.hub._keras_hub import PositionEmbedding
from keras_longattn.hub._keras_hub import _gpt_2_kernel_initializer
from keras_longattn.hub._keras_hub import gelu_approximate
from keras_longattn.hub.attention import _AttentionSpecMixin
from keras_longattn.hub.transformer_decoder import LongTransformerDecoder


# ---------------------------------------------------------------- backbones
@keras.saving.register_keras_serializable(package="keras_longattn")
class LongGPT2Backbone(_AttentionSpecMixin, GPT2Backbone):
    """keras-hub's ``GPT2Backbone`` with our attention in every block
    (:class:`LongTransformerDecoder`); :func:`longify` makes one from a
    trained ``GPT2Backbone``.

    The arguments are those of keras-hub's ``GPT2Backbone``, plus one.

    Args:
        attention: the attention layer's config (see :func:`attention_spec`).
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        attention,
        dropout=0.1,
        max_sequence_length=1024,
        dtype=None,
        **kwargs,
    ):
        # The graph of GPT2Backbone.__init__, with our blocks.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            input_dim=vocabulary_size, output_dim=hidden_dim,
            embeddings_initializer=_gpt_2_kernel_initializer(0.01), dtype=dtype,
            name="token_embedding")
        self.position_embedding = PositionEmbedding(
            initializer=_gpt_2_kernel_initializer(0.02),
            sequence_length=max_sequence_length,
            dtype=dtype, name="position_embedding")
        self.embeddings_add = keras.layers.Add(dtype=dtype, name="embeddings_add")
        self.embeddings_dropout = keras.layers.Dropout(
            dropout, dtype=dtype, name="embeddings_dropout")
        self.transformer_layers = [
            LongTransformerDecoder(
                intermediate_dim=intermediate_dim, num_heads=num_heads,
                attention=attention, dropout=dropout, layer_norm_epsilon=1e-05,
                activation=gelu_approximate,
                kernel_initializer=_gpt_2_kernel_initializer(0.02),
                normalize_first=True, dtype=dtype, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.layer_norm = keras.layers.LayerNormalization(
            axis=-1, epsilon=1e-05, dtype=dtype, name="layer_norm")
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        tokens = self.token_embedding(token_id_input)
        positions = self.position_embedding(tokens)
        x = self.embeddings_add((tokens, positions))
        x = self.embeddings_dropout(x)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, decoder_padding_mask=padding_mask_input)
        sequence_output = self.layer_norm(x)
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "padding_mask": padding_mask_input},
            outputs=sequence_output, dtype=dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self._set_attention(attention)
