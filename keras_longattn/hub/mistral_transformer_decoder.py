"""Mistral's decoder block with our attention."""

import keras

from keras_longattn.hub._keras_hub import MistralTransformerDecoder
from keras_longattn.hub.gated_decoder import _GatedDecoderMixin


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongMistralTransformerDecoder(_GatedDecoderMixin, MistralTransformerDecoder):
    """keras-hub's ``MistralTransformerDecoder`` whose attention is one of
    our layers: ``num_query_heads`` heads of ``head_dim`` (default
    ``hidden_dim // num_query_heads``), ``num_key_value_heads`` key/value
    heads, no biases, rotary positions of ``rope_max_wavelength``. The
    pattern is the ``attention`` config's: Mistral's own band, query ``i``
    seeing keys ``i - sliding_window < j <= i``, is
    ``LocalAttention(window=sliding_window)``. ``dropout`` drops attention
    weights, as in :class:`LongLlamaTransformerDecoder`.

    Args:
        intermediate_dim: the gated feed-forward network's hidden size.
        num_query_heads: the number of query heads.
        num_key_value_heads: the number of key/value heads.
        attention: the attention layer's config (see :func:`attention_spec`).
        **kwargs: the other arguments of keras-hub's
            ``MistralTransformerDecoder``.
    """

    def _head_size(self, hidden_dim):
        return self.head_dim or hidden_dim // self.num_query_heads
