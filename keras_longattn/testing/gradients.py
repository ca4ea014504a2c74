"""Input gradients on the active Keras backend, for the conformance tests.

``keras.ops`` has no gradient function, so this is the one place of the
testing package that talks to a backend directly (imported lazily).
"""

import keras
import numpy as np


def input_gradient(fn, x):
    """Gradient of ``sum(fn(x))`` with respect to ``x``, as a numpy array.

    Args:
        fn: a function of one tensor that returns a tensor.
        x: a numpy array (float32).
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        # One compiled program: an eager gradient compiles every primitive
        # of the forward and backward pass on its own, several times slower
        # on a CPU for the many small ops of blocked attention.
        grad = jax.jit(jax.grad(lambda v: jnp.sum(fn(v))))
        return np.asarray(grad(jnp.asarray(x)))
    if backend == "tensorflow":
        import tensorflow as tf

        v = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(v)
            out = tf.reduce_sum(fn(v))
        return tape.gradient(out, v).numpy()
    if backend == "torch":
        import torch

        from keras.src.backend.torch.core import get_device

        v = torch.tensor(x, requires_grad=True, device=get_device())
        out = torch.sum(fn(v))
        out.backward()
        return v.grad.detach().cpu().numpy()
    raise NotImplementedError(f"No gradient helper for backend {backend!r}")
