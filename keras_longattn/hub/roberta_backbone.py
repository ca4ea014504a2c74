"""RoBERTa with our attention in every block."""

import keras

from keras_longattn.hub._keras_hub import Backbone
from keras_longattn.hub._keras_hub import RobertaBackbone
from keras_longattn.hub._keras_hub import TokenAndPositionEmbedding
from keras_longattn.hub._keras_hub import roberta_kernel_initializer
from keras_longattn.hub.attention import _AttentionSpecMixin
from keras_longattn.hub.transformer_encoder import LongTransformerEncoder


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongRobertaBackbone(_AttentionSpecMixin, RobertaBackbone):
    """keras-hub's ``RobertaBackbone`` with our attention in every block
    (:class:`LongTransformerEncoder`); :func:`longify` makes one from a
    trained ``RobertaBackbone`` (the Longformer paper's starting point).

    The arguments are those of keras-hub's ``RobertaBackbone``, plus one.

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
        max_sequence_length=512,
        dtype=None,
        **kwargs,
    ):
        # The graph of RobertaBackbone.__init__, with our blocks.
        self.embeddings = TokenAndPositionEmbedding(
            vocabulary_size=vocabulary_size, sequence_length=max_sequence_length,
            embedding_dim=hidden_dim, embeddings_initializer=roberta_kernel_initializer(),
            dtype=dtype, name="embeddings")
        self.token_embedding = self.embeddings.token_embedding
        self.embeddings_layer_norm = keras.layers.LayerNormalization(
            axis=-1, epsilon=1e-5, dtype=dtype, name="embeddings_layer_norm")
        self.embeddings_dropout = keras.layers.Dropout(
            dropout, dtype=dtype, name="embeddings_dropout")
        self.transformer_layers = [
            LongTransformerEncoder(
                num_heads=num_heads, intermediate_dim=intermediate_dim,
                attention=attention, activation="gelu", dropout=dropout,
                layer_norm_epsilon=1e-5, kernel_initializer=roberta_kernel_initializer(),
                dtype=dtype, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        x = self.embeddings(token_id_input)
        x = self.embeddings_layer_norm(x)
        x = self.embeddings_dropout(x)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, padding_mask=padding_mask_input)
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "padding_mask": padding_mask_input},
            outputs=x, dtype=dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self.start_token_index = 0
        self._set_attention(attention)
