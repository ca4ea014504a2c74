"""Keras's mask attribute on tensors (``_keras_mask``), set through Keras's
private helper where it exists."""

try:  # Keras keeps this helper private; fall back to the attribute.
    from keras.src.backend.common.masking import set_keras_mask
except ImportError:  # pragma: no cover

    def set_keras_mask(x, mask):
        try:
            x._keras_mask = mask
        except AttributeError:
            pass
