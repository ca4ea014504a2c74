"""A learned class (CLS) token prepended to a sequence."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_longattn")
class ClassToken(keras.layers.Layer):
    """Prepends one learned vector to a sequence of embeddings.

    The new position 0 is a global token that attends to (and is attended
    by) the whole sequence; its output serves as the sequence summary
    (``SequencePooling("first")``). The mask grows by one True at the front.

    Args:
        initializer: initializer of the token. Defaults to
            ``RandomNormal(stddev=0.02)``.
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Call arguments:
        inputs: ``(B, n, dim)``.
        mask: optional boolean ``(B, n)``.

    Returns:
        ``(B, n + 1, dim)``, with mask ``(B, n + 1)`` when the input had one.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import ClassToken
    >>> tuple(ClassToken()(np.zeros((2, 23, 16), "float32")).shape)
    (2, 24, 16)
    """

    def __init__(self, initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True
        if initializer is None:
            initializer = keras.initializers.RandomNormal(stddev=0.02)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        self.token = self.add_weight(
            shape=(input_shape[-1],), initializer=self.initializer, name="token"
        )
        self.built = True

    def call(self, inputs, mask=None):
        batch = ops.shape(inputs)[0]
        token = ops.cast(self.token, inputs.dtype)[None, None, :]
        token = ops.broadcast_to(token, (batch, 1, inputs.shape[-1]))
        return ops.concatenate([token, inputs], axis=1)

    def compute_mask(self, inputs, mask=None):
        if mask is None:
            return None
        if keras.backend.standardize_dtype(mask.dtype) != "bool":
            mask = ops.cast(mask, "bool")
        head = ops.ones_like(mask[:, :1])
        return ops.concatenate([head, mask], axis=1)

    def compute_output_shape(self, input_shape):
        n = input_shape[1]
        return (input_shape[0], None if n is None else n + 1, input_shape[-1])

    def get_config(self):
        config = super().get_config()
        config["initializer"] = keras.initializers.serialize(self.initializer)
        return config
