"""Input and weight gradients on the active Keras backend, for the
conformance and property tests.

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


def weight_gradients(layer, fn):
    """Gradients of the scalar ``fn()`` with respect to the layer's trainable
    weights, as a list of numpy arrays (backend-specific; ``fn`` calls the
    layer)."""
    variables = list(layer.trainable_variables)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = fn()
        grads = tape.gradient(loss, variables)
        return [np.asarray(g) if g is not None else None for g in grads]
    if backend == "torch":
        for v in variables:
            v.value.grad = None
        loss = fn()
        loss.backward()
        return [
            None if v.value.grad is None else v.value.grad.detach().cpu().numpy()
            for v in variables
        ]
    if backend == "jax":
        import jax

        non_trainable = [v.value for v in layer.non_trainable_variables]
        originals = [v.value for v in variables]

        def loss_of(values):
            # The traced values stand in for the variables (StatelessScope).
            from keras.src.backend.common.stateless_scope import StatelessScope

            mapping = list(zip(variables, values)) + list(
                zip(layer.non_trainable_variables, non_trainable)
            )
            with StatelessScope(state_mapping=mapping):
                return fn()

        grads = jax.jit(jax.grad(loss_of))(originals)
        return [np.asarray(g) for g in grads]
    raise NotImplementedError(f"No gradient helper for backend {backend!r}")
