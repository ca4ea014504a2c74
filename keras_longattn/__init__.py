"""keras_longattn: long-sequence attention layers for Keras 3.

Every layer runs unchanged on the JAX, TensorFlow and PyTorch backends and
is a drop-in replacement for ``keras.layers.MultiHeadAttention``.
"""

__version__ = "0.1.0"

from keras_longattn import layers  # noqa: E402
from keras_longattn import ops  # noqa: E402
