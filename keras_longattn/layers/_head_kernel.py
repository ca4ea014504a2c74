"""A sub-layer holding one ``(rows, num_heads)`` kernel."""

import keras


class HeadKernel(keras.layers.Layer):
    """Holds one ``(rows, num_heads)`` kernel (AdaMRA's router ``W``,
    Nyströmformer's depthwise convolution on the values).

    A sub-layer, created after the projections, so that a layer's weights
    start with exactly MultiHeadAttention's, in its order.
    """

    def __init__(self, rows, num_heads, initializer, regularizer=None,
                 constraint=None, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows
        self.num_heads = num_heads
        self.initializer = initializer
        self.regularizer = regularizer
        self.constraint = constraint

    def build(self, input_shape=None):
        self.kernel = self.add_weight(
            name="kernel",
            shape=(self.rows, self.num_heads),
            initializer=self.initializer,
            regularizer=self.regularizer,
            constraint=self.constraint,
        )
        self.built = True
