"""Checks of values that are only known when a compiled function runs.

A Python value (or a concrete tensor) is checked when the call is made and
refused with a ``ValueError``. A traced value (inside ``jax.jit`` or a
``tf.function``) is checked when the program runs, through the backend
table's ``refuse_at_run_time``: JAX stops the program with the message
(``JaxRuntimeError``), a TensorFlow graph with ``InvalidArgumentError``.
XLA on TensorFlow (``jit_compile=True``) has no run-time errors: there
:func:`refuse_when` returns the traced condition, and the caller makes the
result unusable by construction (the decoding path returns NaN outputs and
leaves the cache unchanged)."""

import numbers

import keras
from keras import ops

from keras_longattn.kernels import backend_ops


def concrete_int(x):
    """``x`` as a Python int when its value is known while the call is made
    (a Python int, a NumPy or an eager tensor scalar), else None (traced)."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    try:
        return int(ops.convert_to_numpy(x))
    except Exception:  # traced
        return None


def refuse_when(bad, value, message):
    """Refuses a traced value at run time.

    Args:
        bad: traced boolean scalar, True when the value is invalid.
        value: the traced scalar shown in the message.
        message: the error message, with ``{value}`` where the value goes.

    Returns:
        ``(value, unrefused)``: ``value`` to compute with (ordered after the
        check), and None when the backend stops the program on a bad value,
        else ``bad`` (XLA on TensorFlow): the caller must then make its
        result unusable where ``bad`` holds.
    """
    value, refused = backend_ops().refuse_at_run_time(bad, value, message)
    return value, (None if refused else bad)


def is_integer_dtype(x):
    return "int" in keras.backend.standardize_dtype(x.dtype)
