"""Benchmarks of the attention layers: time and peak memory per configuration.

Every (backend, layer, length, mode) configuration runs in a fresh subprocess
(:mod:`keras_longattn.benchmarks.worker`) under a timeout and a memory guard;
the runner reports medians of several timed calls, the peak memory, and
ratios against :class:`~keras_longattn.layers.FullAttention` on the same
backend in the same run, as a table and as JSON and CSV files.

Command line::

    keras-longattn bench --layers full,local --lengths 4096,16384 --backends jax,torch
    python -m keras_longattn.benchmarks --layers full,local --lengths 4096

From Python::

    from keras_longattn.benchmarks import run_benchmark
    rows = run_benchmark(layers=["full", "local"], lengths=[1024, 4096],
                         backends=["jax"], modes=["fwdbwd"])

Any Keras attention layer with the constructor and call of
``keras.layers.MultiHeadAttention`` can be measured from its layer config,
with no benchmark code::

    keras-longattn bench --lengths 4096 --layers \\
        '{"class_name": "LocalAttention", "config": {"window": 128}}'
    run_benchmark(layers=[{"class_name": "my_package.layers:MyAttention",
                           "config": {"rank": 64}}], lengths=[4096])

Short names (``"full"``, ``"local"``, ...) stand for layer configs
(:mod:`~keras_longattn.specs.registry`; :func:`register` adds one);
configs, class references and ``"${...}"`` values that depend on the
sequence length are described in :mod:`~keras_longattn.specs.layer_spec`,
shared with the LRA-style suite (:mod:`keras_longattn.lra`) and the model
builders (:mod:`keras_longattn.models`).

This package imports no backend; only the worker subprocess does.
"""

from keras_longattn.specs.layer_spec import LayerConfigError, LayerSpec, LayerUnavailableError
from keras_longattn.specs.registry import available_layers, register, unregister

from .config import BACKENDS, MODES, BenchmarkArgumentError, BenchmarkConfig
from .report import compute_ratios, format_table, print_table, write_reports
from .runner import BenchmarkResults, run_benchmark

__all__ = [
    "BACKENDS",
    "MODES",
    "BenchmarkArgumentError",
    "BenchmarkConfig",
    "BenchmarkResults",
    "LayerConfigError",
    "LayerSpec",
    "LayerUnavailableError",
    "available_layers",
    "compute_ratios",
    "format_table",
    "print_table",
    "register",
    "run_benchmark",
    "unregister",
    "write_reports",
]
