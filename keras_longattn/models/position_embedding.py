"""Learned absolute position embeddings."""

import numbers

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
        inputs: ``(B, n, dim)`` with ``start_index + n <= sequence_length``.
        start_index: the position of the first input (an int, or a scalar
            integer tensor when decoding with a cache inside a compiled
            step). Defaults to 0.

    Returns:
        ``inputs + table[start_index:start_index + n]``, shape ``(B, n, dim)``.

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

    def call(self, inputs, start_index=0):
        n = inputs.shape[1]
        start = _concrete_start(start_index)
        if n is None:
            n = ops.shape(inputs)[1]
        elif start is not None and start + n > self.sequence_length:
            at = f" from position {start}" if start else ""
            raise ValueError(
                f"PositionEmbedding holds {self.sequence_length} positions but "
                f"the input has {n}{at}. Received: inputs.shape="
                f"{tuple(inputs.shape)}, start_index={start}"
            )
        table = ops.convert_to_tensor(self.embeddings)
        if start is None:  # a traced position: a dynamic slice
            begin = ops.stack(
                [ops.cast(start_index, "int32"), ops.zeros((), "int32")]
            )
            table = ops.slice(table, begin, (n, table.shape[-1]))
        elif start != 0 or n != self.sequence_length:
            table = ops.slice(table, (start, 0), (n, table.shape[-1]))
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


def _concrete_start(start_index):
    """``start_index`` as a Python int, or None when it is a traced tensor;
    a negative or non-integer value is a ValueError naming it."""
    if isinstance(start_index, bool) or isinstance(start_index, (float, str)):
        raise ValueError(
            "`start_index` must be an int or a scalar integer tensor. "
            f"Received: start_index={start_index!r}"
        )
    if isinstance(start_index, numbers.Integral):
        value = int(start_index)
    else:
        tensor = ops.convert_to_tensor(start_index)
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if len(tensor.shape) != 0 or "int" not in dtype:
            raise ValueError(
                "`start_index` must be an int or a scalar integer tensor. "
                f"Received: start_index with shape {tuple(tensor.shape)} and "
                f"dtype {dtype}"
            )
        try:
            value = int(ops.convert_to_numpy(tensor))
        except Exception:  # traced inside a compiled function
            return None
    if value < 0:
        raise ValueError(
            f"`start_index` must be >= 0. Received: start_index={value}"
        )
    return value
