"""The Examples in the docstrings of keras_longattn.models run."""

import doctest
import importlib

import pytest

MODULES = [
    "attention_sublayer",
    "causal_language_model",
    "class_token",
    "feedforward_sublayer",
    "image_density_model",
    "layer_pattern",
    "matching_model",
    "position_embedding",
    "reversible_embedding",
    "sequence_classifier",
    "sequence_pooling",
    "shift_right",
    "sublayer_stack",
    "transformer_block",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"keras_longattn.models.{name}")
    result = doctest.testmod(
        module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.attempted > 0
    assert result.failed == 0
