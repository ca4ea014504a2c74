"""keras_longattn: long-sequence attention layers for Keras 3.

Every layer runs unchanged on the JAX, TensorFlow and PyTorch backends and
is a drop-in replacement for ``keras.layers.MultiHeadAttention``.

Sub-packages are imported on first use (``keras_longattn.layers``,
``keras_longattn.ops``, ``keras_longattn.models``, ``keras_longattn.datasets``,
``keras_longattn.benchmarks``, ``keras_longattn.testing``), so that the
command line does not import Keras and a backend before it needs them.
"""

import importlib

# The one place the version is written: pyproject.toml reads it from here.
__version__ = "0.1.0"

_SUBPACKAGES = ("layers", "ops", "models", "datasets", "benchmarks", "lra", "specs", "testing")


def __getattr__(name):
    if name in _SUBPACKAGES:
        module = importlib.import_module(f"keras_longattn.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'keras_longattn' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_SUBPACKAGES))
