"""Test helpers for the offline datasets."""

import pytest

from keras_longattn.datasets import DatasetNotFoundError
from keras_longattn.datasets import wiki_sample_path


def _wiki_path():
    try:
        return wiki_sample_path()
    except DatasetNotFoundError:
        return None


#: Path of gensim's Wikipedia sample, or None where gensim is missing.
WIKI_PATH = _wiki_path()

#: Marks a test that needs the Wikipedia sample.
requires_wiki = pytest.mark.skipif(
    WIKI_PATH is None,
    reason="gensim's test data (the Wikipedia sample) is not installed; "
    "`pip install gensim` to run this test",
)
