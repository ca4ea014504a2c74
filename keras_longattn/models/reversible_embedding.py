"""A token embedding whose transpose also serves as the output projection."""

import keras
from keras import ops

try:
    from keras.src.backend.common.masking import set_keras_mask as _set_keras_mask
except ImportError:  # pragma: no cover

    def _set_keras_mask(x, mask):
        try:
            x._keras_mask = mask
        except AttributeError:
            pass


@keras.saving.register_keras_serializable(package="keras_longattn")
class ReversibleEmbedding(keras.layers.Embedding):
    """``keras.layers.Embedding`` that can also map vectors back to logits.

    ``layer(tokens)`` embeds ``(B, n)`` integer tokens into ``(B, n, dim)``;
    ``layer(x, reverse=True)`` computes ``x @ embeddings.T``, ``(B, n,
    input_dim)`` logits, so that input and output embeddings are tied
    (Press & Wolf 2017). The forward call attaches the ``mask_zero`` mask to
    its output; the reverse call keeps its input's mask.

    Args:
        input_dim: vocabulary size.
        output_dim: embedding size.
        **kwargs: the other arguments of ``keras.layers.Embedding``
            (``embeddings_initializer``, ``mask_zero``, ...).

    Call arguments:
        inputs: integer tokens, or ``(..., output_dim)`` vectors with
            ``reverse=True``.
        reverse: whether to project vectors to logits. Defaults to False.

    Returns:
        ``(..., output_dim)`` embeddings, or ``(..., input_dim)`` logits.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import ReversibleEmbedding
    >>> layer = ReversibleEmbedding(10, 4)
    >>> x = layer(np.array([[1, 2, 3]]))
    >>> tuple(layer(x, reverse=True).shape)
    (1, 3, 10)
    """

    def call(self, inputs, reverse=False):
        if not reverse:
            outputs = super().call(inputs)
            mask = super().compute_mask(inputs)
            if mask is not None:
                _set_keras_mask(outputs, mask)
            return outputs
        kernel = ops.cast(self.embeddings, inputs.dtype)
        return ops.matmul(inputs, ops.transpose(kernel))

    def compute_mask(self, inputs, mask=None):
        dtype = keras.backend.standardize_dtype(inputs.dtype)
        if "int" in dtype:  # forward call on tokens
            return super().compute_mask(inputs)
        return mask  # reverse call: keep the input's mask

    def compute_output_shape(self, input_shape, reverse=False):
        if reverse:
            return tuple(input_shape[:-1]) + (self.input_dim,)
        return tuple(input_shape) + (self.output_dim,)

    def compute_output_spec(self, inputs, reverse=False):
        return keras.KerasTensor(
            self.compute_output_shape(inputs.shape, reverse=reverse),
            dtype=self.compute_dtype,
        )
