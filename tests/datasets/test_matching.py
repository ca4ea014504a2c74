"""Document matching: labels checked by searching the chunks in articles."""

import numpy as np
import pytest

from keras_longattn.datasets import load_wiki_articles
from keras_longattn.datasets import make_document_matching
from keras_longattn.datasets import wiki_article_splits
from keras_longattn.testing.data import requires_wiki

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = [requires_wiki, pytest.mark.backend_free]


def _sources(chunk, texts):
    return {i for i, text in texts.items() if text.find(chunk) >= 0}


def test_article_splits_are_a_fixed_partition():
    articles = load_wiki_articles()
    splits = wiki_article_splits()
    sets = {name: set(index) for name, index in splits.items()}
    assert not sets["train"] & sets["test"]
    assert not sets["train"] & sets["valid"]
    assert not sets["valid"] & sets["test"]
    assert set().union(*sets.values()) == set(range(len(articles)))
    assert len(sets["test"]) == len(sets["valid"]) == round(
        0.1 * len(articles))
    assert wiki_article_splits() == splits


@pytest.mark.parametrize("split", ["train", "test"])
def test_labels_and_split_membership(split):
    articles = load_wiki_articles()
    texts = {i: articles[i][1] for i in range(len(articles))}
    allowed = set(wiki_article_splits()[split])
    x1, x2, y = make_document_matching(40, chunk_length=200, split=split,
                                       seed=0)
    assert x1.shape == x2.shape == (40, 200) and x1.dtype == np.uint8
    assert y.shape == (40,) and y.dtype == np.int32 and y.sum() == 20
    for a, b, label in zip(x1, x2, y):
        first = _sources(a.tobytes(), texts)
        second = _sources(b.tobytes(), texts)
        assert first and second
        assert first <= allowed and second <= allowed
        assert int(bool(first & second)) == label
        if label:
            (index,) = first & second
            text = texts[index]
            p, q = text.find(a.tobytes()), text.find(b.tobytes())
            assert abs(p - q) >= 200, "positive chunks must not overlap"


def test_seeds_and_odd_count():
    a = make_document_matching(9, chunk_length=64, seed=1)
    b = make_document_matching(9, chunk_length=64, seed=1)
    c = make_document_matching(9, chunk_length=64, seed=2)
    for u, w in zip(a, b):
        np.testing.assert_array_equal(u, w)
    assert not np.array_equal(a[0], c[0])
    assert a[2].sum() == 5


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(split="tarin"), "split"),
        (dict(split=None), "split"),
        (dict(chunk_length=10**6), "chunk_length"),
        (dict(chunk_length=0), "chunk_length"),
        (dict(num_pairs=0), "num_pairs"),
    ],
)
def test_bad_arguments(kwargs, name):
    kwargs = dict(dict(num_pairs=2), **kwargs)
    with pytest.raises(ValueError, match=name) as info:
        make_document_matching(**kwargs)
    assert "Received" in str(info.value)
