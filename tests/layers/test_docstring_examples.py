"""Docstring examples of the layers and ops run as written."""

import doctest
import importlib

import pytest

MODULES = [
    "keras_longattn.layers.full_attention",
    "keras_longattn.layers.local_attention",
    "keras_longattn.layers.sparse_attention",
    "keras_longattn.layers.routing_attention",
    "keras_longattn.layers.longformer_attention",
    "keras_longattn.layers.bigbird_attention",
    "keras_longattn.layers.base_attention",
    "keras_longattn.layers.linformer_attention",
    "keras_longattn.layers.synthesizer_attention",
    "keras_longattn.layers.nystrom_attention",
    "keras_longattn.layers.lsh_attention",
    "keras_longattn.layers.linear_attention",
    "keras_longattn.layers.performer_attention",
    "keras_longattn.layers.entmax_attention",
    "keras_longattn.layers.adaptive_span_attention",
    "keras_longattn.models.two_stream",
    "keras_longattn.models.mpnet",
    "keras_longattn.ops.patterns",
    "keras_longattn.ops.blocked",
    "keras_longattn.ops.reference",
    "keras_longattn.ops.fused",
    "keras_longattn.ops.subset",
    "keras_longattn.ops.segments",
    "keras_longattn.ops.kmeans",
    "keras_longattn.ops.chunked",
    "keras_longattn.ops.routing",
    "keras_longattn.ops.sparse",
    "keras_longattn.ops.longformer",
    "keras_longattn.ops.bigbird",
    "keras_longattn.layers.dispatch",
    "keras_longattn.kernels",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
