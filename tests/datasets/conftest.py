import pytest

from keras_longattn.datasets import DatasetNotFoundError
from keras_longattn.datasets import wiki_sample_path


def _wiki_path():
    try:
        return wiki_sample_path()
    except DatasetNotFoundError:
        return None


WIKI_PATH = _wiki_path()

requires_wiki = pytest.mark.skipif(
    WIKI_PATH is None,
    reason="gensim's test data (the Wikipedia sample) is not installed; "
    "`pip install gensim` to run this test",
)
