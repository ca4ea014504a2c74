"""Masks: the check of a mask argument's shape and dtype, and Keras's mask
attribute on tensors (``_keras_mask``), set through Keras's private helper
where it exists."""

import keras

try:  # Keras keeps this helper private; fall back to the attribute.
    from keras.src.backend.common.masking import set_keras_mask
except ImportError:  # pragma: no cover

    def set_keras_mask(x, mask):
        try:
            x._keras_mask = mask
        except AttributeError:
            pass


def check_mask(name, mask, expected, legend):
    """A ValueError naming ``name`` unless ``mask`` has the ``expected``
    shape (None: any size; ``legend`` names the axes in the message) and a
    boolean or integer dtype (True / 1 = attend)."""
    shape = tuple(mask.shape)
    if len(shape) != len(expected) or any(
        e is not None and s is not None and e != s for s, e in zip(shape, expected)
    ):
        raise ValueError(
            f"`{name}` must have shape {_format_shape(expected, legend)}. "
            f"Received: {name}.shape={shape}"
        )
    dtype = keras.backend.standardize_dtype(mask.dtype)
    if dtype != "bool" and "int" not in dtype:
        raise ValueError(
            f"`{name}` must be boolean (True = attend) or integer 0/1. "
            f"Received: {name}.dtype={dtype}"
        )


def _format_shape(shape, legend):
    parts = [str(d) if d is not None else l for d, l in zip(shape, legend)]
    return "(" + ", ".join(parts) + ")"
