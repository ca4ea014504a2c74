"""Mistral with our attention in every block."""

import keras
from keras import ops

from keras_longattn.hub._keras_hub import MistralBackbone
from keras_longattn.hub._keras_hub import MistralLayerNormalization
from keras_longattn.hub._keras_hub import _mistral_kernel_initializer
from keras_longattn.hub.attention import _AttentionSpecMixin
from keras_longattn.hub.mistral_transformer_decoder import LongMistralTransformerDecoder


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongMistralBackbone(_AttentionSpecMixin, MistralBackbone):
    """keras-hub's ``MistralBackbone`` with our attention in every block
    (:class:`LongMistralTransformerDecoder`); :func:`longify` makes one from
    a trained ``MistralBackbone``. ``LocalAttention`` with
    ``window=sliding_window`` is Mistral's own pattern.

    The arguments are those of keras-hub's ``MistralBackbone``, plus one.

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
        rope_scaling_factor=1.0,
        layer_norm_epsilon=1e-6,
        sliding_window=512,
        head_dim=None,
        dropout=0,
        dtype=None,
        **kwargs,
    ):
        # The graph of MistralBackbone.__init__, with our blocks.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            input_dim=vocabulary_size, output_dim=hidden_dim, tie_weights=False,
            embeddings_initializer=_mistral_kernel_initializer(stddev=0.01),
            dtype=dtype, name="token_embedding")
        self.transformer_layers = [
            LongMistralTransformerDecoder(
                intermediate_dim=intermediate_dim, num_query_heads=num_query_heads,
                num_key_value_heads=num_key_value_heads, attention=attention,
                rope_max_wavelength=rope_max_wavelength,
                rope_scaling_factor=rope_scaling_factor,
                layer_norm_epsilon=layer_norm_epsilon, activation=ops.silu,
                kernel_initializer=_mistral_kernel_initializer(stddev=0.02),
                sliding_window=sliding_window, head_dim=head_dim, dropout=dropout,
                dtype=dtype, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.layer_norm = MistralLayerNormalization(
            epsilon=layer_norm_epsilon, dtype=dtype, name="sequence_output_layernorm")
        self._build_decoder_graph(dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_query_heads = num_query_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.rope_max_wavelength = rope_max_wavelength
        self.num_key_value_heads = num_key_value_heads
        self.rope_scaling_factor = rope_scaling_factor
        self.sliding_window = sliding_window
        self.head_dim = head_dim
        self.layer_norm_epsilon = layer_norm_epsilon
        self.dropout = dropout
        self._set_attention(attention)
