"""Learned absolute position embeddings."""

import keras
from keras import ops

from keras_longattn.models._validation import check_int


@keras.saving.register_keras_serializable(package="keras_longattn")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to a sequence of embeddings.

    Position ``i`` of the input gets row ``i`` of a
    ``(sequence_length, dim)`` table; shorter inputs use the first rows.
    The input's Keras mask is kept.

    Args:
        sequence_length: the longest sequence the table covers.
        initializer: initializer of the table. Defaults to
            ``RandomNormal(stddev=0.02)``.
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Call arguments:
        inputs: ``(B, n, dim)`` with ``n <= sequence_length``.

    Returns:
        ``inputs + table[:n]``, shape ``(B, n, dim)``.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import PositionEmbedding
    >>> layer = PositionEmbedding(sequence_length=32)
    >>> tuple(layer(np.zeros((2, 24, 16), "float32")).shape)
    (2, 24, 16)
    """

    def __init__(self, sequence_length, initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.sequence_length = check_int("sequence_length", sequence_length)
        if initializer is None:
            initializer = keras.initializers.RandomNormal(stddev=0.02)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        dim = input_shape[-1]
        if dim is None:
            raise ValueError(
                "The feature size (last axis) of the input of PositionEmbedding "
                f"must be known. Received: shape={tuple(input_shape)}"
            )
        self.embeddings = self.add_weight(
            shape=(self.sequence_length, dim),
            initializer=self.initializer,
            name="embeddings",
        )
        self.built = True

    def call(self, inputs):
        n = inputs.shape[1]
        if n is None:
            n = ops.shape(inputs)[1]
        elif n > self.sequence_length:
            raise ValueError(
                f"PositionEmbedding holds {self.sequence_length} positions but "
                f"the input has {n}. Received: inputs.shape={tuple(inputs.shape)}"
            )
        table = ops.convert_to_tensor(self.embeddings)
        if n != self.sequence_length:
            table = ops.slice(table, (0, 0), (n, table.shape[-1]))
        return inputs + ops.cast(table, inputs.dtype)[None]

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "sequence_length": self.sequence_length,
                "initializer": keras.initializers.serialize(self.initializer),
            }
        )
        return config
