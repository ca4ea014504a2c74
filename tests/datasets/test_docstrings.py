"""The Examples in the docstrings run and give the documented output."""

import doctest

import pytest

from keras_longattn.datasets import digits
from keras_longattn.datasets import listops
from keras_longattn.datasets import matching
from keras_longattn.datasets import pathfinder
from keras_longattn.datasets import recall
from keras_longattn.datasets import text
from keras_longattn.testing.data import WIKI_PATH

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

NEEDS_WIKI = (text, matching)


@pytest.mark.parametrize(
    "module", [text, digits, listops, pathfinder, recall, matching],
    ids=lambda m: m.__name__.rsplit(".", 1)[-1],
)
def test_docstring_examples(module):
    if module in NEEDS_WIKI and WIKI_PATH is None:
        pytest.skip("gensim's test data (the Wikipedia sample) is not "
                    "installed; `pip install gensim` to run these examples")
    result = doctest.testmod(
        module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0
