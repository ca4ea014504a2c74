"""BERT with our attention in every block."""

import keras

from keras_longattn.hub._keras_hub import Backbone
from keras_longattn.hub._keras_hub import BertBackbone
from keras_longattn.hub._keras_hub import PositionEmbedding
from keras_longattn.hub._keras_hub import bert_kernel_initializer
from keras_longattn.hub._keras_hub import gelu_approximate
from keras_longattn.hub.attention import _AttentionSpecMixin
from keras_longattn.hub.transformer_encoder import LongTransformerEncoder


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongBertBackbone(_AttentionSpecMixin, BertBackbone):
    """keras-hub's ``BertBackbone`` with our attention in every block
    (:class:`LongTransformerEncoder`); :func:`longify` makes one from a
    trained ``BertBackbone``.

    The arguments are those of keras-hub's ``BertBackbone``, plus one.

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
        num_segments=2,
        dtype=None,
        **kwargs,
    ):
        # The graph of BertBackbone.__init__, with our blocks.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            input_dim=vocabulary_size, output_dim=hidden_dim,
            embeddings_initializer=bert_kernel_initializer(), dtype=dtype,
            name="token_embedding")
        self.position_embedding = PositionEmbedding(
            initializer=bert_kernel_initializer(), sequence_length=max_sequence_length,
            dtype=dtype, name="position_embedding")
        self.segment_embedding = keras.layers.Embedding(
            input_dim=num_segments, output_dim=hidden_dim,
            embeddings_initializer=bert_kernel_initializer(), dtype=dtype,
            name="segment_embedding")
        self.embeddings_add = keras.layers.Add(dtype=dtype, name="embeddings_add")
        self.embeddings_layer_norm = keras.layers.LayerNormalization(
            axis=-1, epsilon=1e-12, dtype=dtype, name="embeddings_layer_norm")
        self.embeddings_dropout = keras.layers.Dropout(
            dropout, dtype=dtype, name="embeddings_dropout")
        self.transformer_layers = [
            LongTransformerEncoder(
                num_heads=num_heads, intermediate_dim=intermediate_dim,
                attention=attention, activation=gelu_approximate, dropout=dropout,
                layer_norm_epsilon=1e-12, kernel_initializer=bert_kernel_initializer(),
                dtype=dtype, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.pooled_dense = keras.layers.Dense(
            hidden_dim, kernel_initializer=bert_kernel_initializer(), activation="tanh",
            dtype=dtype, name="pooled_dense")
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        segment_id_input = keras.Input(shape=(None,), dtype="int32", name="segment_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        tokens = self.token_embedding(token_id_input)
        positions = self.position_embedding(tokens)
        segments = self.segment_embedding(segment_id_input)
        x = self.embeddings_add((tokens, positions, segments))
        x = self.embeddings_layer_norm(x)
        x = self.embeddings_dropout(x)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, padding_mask=padding_mask_input)
        sequence_output = x
        cls_token_index = 0
        pooled_output = self.pooled_dense(x[:, cls_token_index, :])
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "segment_ids": segment_id_input,
                    "padding_mask": padding_mask_input},
            outputs={"sequence_output": sequence_output, "pooled_output": pooled_output},
            dtype=dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self.num_segments = num_segments
        self.cls_token_index = cls_token_index
        self._set_attention(attention)
