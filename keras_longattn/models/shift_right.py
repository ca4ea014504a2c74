"""Shifts a token sequence one step to the right behind a start token."""

import keras
from keras import ops

from keras_longattn.models._validation import check_int


@keras.saving.register_keras_serializable(package="keras_longattn")
class ShiftRight(keras.layers.Layer):
    """``[start_token, x_0, ..., x_{n-2}]`` from ``[x_0, ..., x_{n-1}]``.

    Placed before a causal stack, output ``i`` then depends on ``x_{<i}``
    only, so the model's output ``i`` can predict ``x_i`` itself (the
    convention of :func:`build_image_density_model`).

    Args:
        start_token: the token put at position 0 (an id outside the data's
            range, e.g. the number of levels).
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Call arguments:
        inputs: integer ``(B, n)``.

    Returns:
        Integer ``(B, n)``.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import ShiftRight
    >>> np.asarray(ShiftRight(start_token=9)(np.array([[1, 2, 3]]))).tolist()
    [[9, 1, 2]]
    """

    def __init__(self, start_token, **kwargs):
        super().__init__(**kwargs)
        self.start_token = check_int("start_token", start_token, min_value=0)

    def call(self, inputs):
        start = ops.full_like(inputs[:, :1], self.start_token)
        return ops.concatenate([start, inputs[:, :-1]], axis=1)

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config["start_token"] = self.start_token
        return config
