"""Llama's decoder block with our attention."""

import keras

from keras_longattn.hub._keras_hub import LlamaTransformerDecoder
from keras_longattn.hub.gated_decoder import _GatedDecoderMixin


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongLlamaTransformerDecoder(_GatedDecoderMixin, LlamaTransformerDecoder):
    """keras-hub's ``LlamaTransformerDecoder`` whose grouped-query attention
    is one of our layers: ``num_query_heads`` heads of
    ``hidden_dim // num_query_heads``, ``num_key_value_heads`` key/value
    heads, no biases, rotary positions of ``rope_max_wavelength``
    (``rotary_max_wavelength``). Causal; padding goes to the layer as
    ``value_mask``; decodes through the layer's cache. ``dropout`` drops
    attention weights in our layer where keras-hub's ``LlamaAttention``
    drops its attention output (the same at inference).

    Args:
        intermediate_dim: the gated feed-forward network's hidden size.
        num_query_heads: the number of query heads.
        num_key_value_heads: the number of key/value heads.
        attention: the attention layer's config (see :func:`attention_spec`).
        **kwargs: the other arguments of keras-hub's
            ``LlamaTransformerDecoder``.
    """

    def get_config(self):
        # keras-hub 0.32's LlamaTransformerDecoder.get_config reads an
        # attribute it never sets (rope_scaling_factor): the config is
        # written here in full.
        config = keras.layers.Layer.get_config(self)
        config.update({
            "intermediate_dim": self.intermediate_dim,
            "num_query_heads": self.num_query_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "rope_max_wavelength": self.rope_max_wavelength,
            "rope_position_scaling_factor": self.rope_position_scaling_factor,
            "rope_frequency_adjustment_factor": self.rope_frequency_adjustment_factor,
            "rope_low_freq_factor": self.rope_low_freq_factor,
            "rope_high_freq_factor": self.rope_high_freq_factor,
            "rope_pretraining_sequence_length": self.rope_pretraining_sequence_length,
            "activation": keras.activations.serialize(self.activation),
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "dropout": self.dropout,
            "attention": self.attention,
        })
        return config
