"""The short layer names (``--layers full,local``):
:mod:`keras_longattn.specs.registry` (shared with the LRA-style suite) under
the benchmark's module path. Entries can be added at run time::

    from keras_longattn.benchmarks import register
    register("local128", {"class_name": "LocalAttention", "config": {"window": 128}})
"""

from __future__ import annotations

from keras_longattn.specs.registry import (
    RegistryEntry,
    available_layers,
    get_entry,
    get_spec,
    is_valid_name,
    register,
    unregister,
)

__all__ = [
    "RegistryEntry",
    "register",
    "is_valid_name",
    "unregister",
    "get_entry",
    "get_spec",
    "available_layers",
]
