"""The residual feed-forward sublayer (``"f"`` of a layer pattern)."""

import keras

from keras_longattn.models._validation import check_int
from keras_longattn.models._validation import check_rate


@keras.saving.register_keras_serializable(package="keras_longattn")
class FeedForwardSublayer(keras.layers.Layer):
    """Norm + two-layer MLP + dropout + residual.

    Pre-norm (default): ``x + dropout(mlp(norm(x)))``; post-norm:
    ``norm(x + dropout(mlp(x)))``, with
    ``mlp(x) = Dense(dim)(activation(Dense(feedforward_dim)(x)))``.
    The mask of the input is kept on the output.

    Args:
        feedforward_dim: hidden width of the MLP. Defaults to 4 times the
            input width.
        activation: activation of the hidden layer. Defaults to ``"gelu"``.
        dropout: dropout rate on the MLP output. Defaults to 0.
        normalize_first: pre-norm (True, default) or post-norm (False).
        layer_norm_epsilon: epsilon of the LayerNormalization. Defaults to
            1e-5.
        kernel_initializer: initializer of the two Dense kernels. Defaults
            to ``"glorot_uniform"``.
        **kwargs: base ``keras.layers.Layer`` arguments (``name``, ``dtype``).

    Call arguments:
        inputs: ``(B, n, dim)``.
        training: whether dropout is active.

    Returns:
        ``(B, n, dim)``.

    Example:

    >>> import numpy as np
    >>> from keras_longattn.models import FeedForwardSublayer
    >>> sublayer = FeedForwardSublayer()  # hidden width 4 * 16
    >>> tuple(sublayer(np.zeros((2, 24, 16), "float32")).shape)
    (2, 24, 16)
    >>> sublayer.count_params()  # norm 2*16, 16*64+64, 64*16+16
    2160
    """

    def __init__(
        self,
        feedforward_dim=None,
        activation="gelu",
        dropout=0.0,
        normalize_first=True,
        layer_norm_epsilon=1e-5,
        kernel_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.supports_masking = True
        self.feedforward_dim = check_int(
            "feedforward_dim", feedforward_dim, allow_none=True
        )
        self.activation = keras.activations.get(activation)
        self.dropout = check_rate("dropout", dropout)
        self.normalize_first = bool(normalize_first)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.norm = keras.layers.LayerNormalization(
            epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name="norm"
        )
        self.dropout_layer = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        dim = input_shape[-1]
        if dim is None:
            raise ValueError(
                "The feature size (last axis) of the input of "
                f"FeedForwardSublayer must be known. Received: shape={input_shape}"
            )
        hidden = self.feedforward_dim or 4 * dim

        def initializer():
            init = self.kernel_initializer
            return init.__class__.from_config(init.get_config())

        self.hidden_dense = keras.layers.Dense(
            hidden,
            activation=self.activation,
            kernel_initializer=initializer(),
            dtype=self.dtype_policy,
            name="hidden",
        )
        self.output_dense = keras.layers.Dense(
            dim,
            kernel_initializer=initializer(),
            dtype=self.dtype_policy,
            name="output",
        )
        self.norm.build(input_shape)
        self.hidden_dense.build(input_shape)
        self.output_dense.build(input_shape[:-1] + (hidden,))
        self.built = True

    def call(self, inputs, training=None):
        h = self.norm(inputs) if self.normalize_first else inputs
        h = self.output_dense(self.hidden_dense(h))
        h = self.dropout_layer(h, training=training)
        out = inputs + h
        if not self.normalize_first:
            out = self.norm(out)
        return out

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "feedforward_dim": self.feedforward_dim,
                "activation": keras.activations.serialize(self.activation),
                "dropout": self.dropout,
                "normalize_first": self.normalize_first,
                "layer_norm_epsilon": self.layer_norm_epsilon,
                "kernel_initializer": keras.initializers.serialize(
                    self.kernel_initializer
                ),
            }
        )
        return config
