"""Llama with our attention in every block."""

import keras
from keras import ops

from keras_longattn.hub._keras_hub import LlamaBackbone
from keras_longattn.hub._keras_hub import LlamaLayerNorm
from keras_longattn.hub._keras_hub import _llama_kernel_initializer
from keras_longattn.hub.attention import _AttentionSpecMixin
from keras_longattn.hub.llama_decoder import LongLlamaTransformerDecoder


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongLlamaBackbone(_AttentionSpecMixin, LlamaBackbone):
    """keras-hub's ``LlamaBackbone`` with our attention in every block
    (:class:`LongLlamaTransformerDecoder`: grouped-query heads, rotary
    positions of ``rope_max_wavelength``); :func:`longify` makes one from a
    trained ``LlamaBackbone``.

    The arguments are those of keras-hub's ``LlamaBackbone``, plus one.

    Args:
        attention: the attention layer's config (see :func:`attention_spec`).
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_query_heads,
        hidden_dim,
        intermediate_dim,
        num_key_value_heads,
        attention,
        rope_max_wavelength=10000,
        rope_position_scaling_factor=1.0,
        rope_frequency_adjustment_factor=None,
        rope_low_freq_factor=None,
        rope_high_freq_factor=None,
        rope_pretraining_sequence_length=None,
        layer_norm_epsilon=1e-6,
        dropout=0,
        dtype=None,
        tie_word_embeddings=False,
        **kwargs,
    ):
        # The graph of LlamaBackbone.__init__, with our blocks.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            input_dim=vocabulary_size, output_dim=hidden_dim,
            tie_weights=tie_word_embeddings,
            embeddings_initializer=_llama_kernel_initializer(0.01),
            dtype=dtype, name="token_embedding")
        self.transformer_layers = [
            LongLlamaTransformerDecoder(
                intermediate_dim=intermediate_dim, num_query_heads=num_query_heads,
                num_key_value_heads=num_key_value_heads, attention=attention,
                rope_max_wavelength=rope_max_wavelength,
                rope_position_scaling_factor=rope_position_scaling_factor,
                rope_frequency_adjustment_factor=rope_frequency_adjustment_factor,
                rope_low_freq_factor=rope_low_freq_factor,
                rope_high_freq_factor=rope_high_freq_factor,
                rope_pretraining_sequence_length=rope_pretraining_sequence_length,
                layer_norm_epsilon=layer_norm_epsilon, activation=ops.silu,
                kernel_initializer=_llama_kernel_initializer(0.02), dropout=dropout, dtype=dtype,
                name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.layer_norm = LlamaLayerNorm(
            epsilon=layer_norm_epsilon, dtype=dtype, name="sequence_output_layernorm")
        self._build_decoder_graph(dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_query_heads = num_query_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.num_key_value_heads = num_key_value_heads
        self.rope_max_wavelength = rope_max_wavelength
        self.rope_position_scaling_factor = rope_position_scaling_factor
        self.rope_frequency_adjustment_factor = rope_frequency_adjustment_factor
        self.rope_low_freq_factor = rope_low_freq_factor
        self.rope_high_freq_factor = rope_high_freq_factor
        self.rope_pretraining_sequence_length = rope_pretraining_sequence_length
        self.layer_norm_epsilon = layer_norm_epsilon
        self.dropout = dropout
        self.tie_word_embeddings = tie_word_embeddings
        self._set_attention(attention)

    def get_config(self):
        config = super().get_config()
        config["tie_word_embeddings"] = self.tie_word_embeddings
        config["attention"] = self.attention
        return config
