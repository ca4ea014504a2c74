"""Pools a sequence of vectors into one vector."""

import keras
from keras import ops

from keras_longattn.models._validation import check_choice

POOLING_MODES = ("mean", "first")


@keras.saving.register_keras_serializable(package="keras_longattn")
class SequencePooling(keras.layers.Layer):
    """Mask-aware mean pooling, or the vector at position 0 (a CLS token).

    ``"mean"`` averages over the unpadded positions only (the Keras mask of
    the input, or ``mask``); a sequence with no unpadded position gives
    zeros. ``"first"`` returns position 0.

    Args:
        mode: ``"mean"`` or ``"first"``. Defaults to ``"mean"``.
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Call arguments:
        inputs: ``(B, n, dim)``.
        mask: optional boolean ``(B, n)``, False at padded positions.

    Returns:
        ``(B, dim)`` (no mask).

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import SequencePooling
    >>> x = np.arange(6, dtype="float32").reshape(1, 3, 2)
    >>> np.asarray(SequencePooling("mean")(
    ...     x, mask=np.array([[True, True, False]]))).tolist()
    [[1.0, 2.0]]
    """

    def __init__(self, mode="mean", **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.mode = check_choice("mode", mode, POOLING_MODES)

    def call(self, inputs, mask=None):
        if self.mode == "first":
            return inputs[:, 0, :]
        if mask is None:
            return ops.mean(inputs, axis=1)
        weights = ops.cast(mask, inputs.dtype)[:, :, None]
        total = ops.sum(inputs * weights, axis=1)
        count = ops.maximum(ops.sum(weights, axis=1), 1.0)
        return total / count

    def compute_mask(self, inputs, mask=None):
        return None

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[-1])

    def get_config(self):
        config = super().get_config()
        config["mode"] = self.mode
        return config
