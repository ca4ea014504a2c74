"""ListOps: every label is recomputed by an independent parser."""

import statistics

import numpy as np
import pytest

from keras_longattn.datasets import LISTOPS_VOCABULARY
from keras_longattn.datasets import decode_listops
from keras_longattn.datasets import listops_token_id
from keras_longattn.datasets import make_listops

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _parse(tokens, pos=0):
    """Recursive descent over text tokens.

    Returns (value, depth, max_args_seen, min_args_seen, next_pos).
    """
    token = tokens[pos]
    if token.isdigit():
        return int(token), 0, 0, 10**9, pos + 1
    assert token in ("[MAX", "[MIN", "[MED", "[SM"), token
    pos += 1
    args, depth, most, fewest = [], 0, 0, 10**9
    while tokens[pos] != "]":
        value, d, m, f, pos = _parse(tokens, pos)
        args.append(value)
        depth, most, fewest = max(depth, d), max(most, m), min(fewest, f)
    if token == "[MAX":
        value = max(args)
    elif token == "[MIN":
        value = min(args)
    elif token == "[SM":
        value = sum(args) % 10
    else:
        value = int(statistics.median(args))  # LRA: int(np.median(...))
    most, fewest = max(most, len(args)), min(fewest, len(args))
    return value, depth + 1, most, fewest, pos + 1


def _evaluate(text):
    tokens = text.split()
    value, depth, most, fewest, end = _parse(tokens)
    assert end == len(tokens), "trailing tokens"
    return value, depth, most, fewest


def test_parser_on_the_example_from_the_issue():
    text = "[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]"
    assert _evaluate(text) == (5, 2, 6, 2)
    assert _evaluate("[MED 1 2 ]")[0] == 1
    assert _evaluate("[SM 9 9 5 ]")[0] == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_length=10, max_length=60, max_depth=3, max_args=4),
        dict(min_length=4, max_length=12, max_depth=1, max_args=10),
        dict(min_length=100, max_length=400, max_depth=10, max_args=10),
        dict(min_length=30, max_length=40, max_depth=4, max_args=2),
    ],
)
def test_labels_lengths_depth_and_args_are_right(kwargs):
    x, y = make_listops(150, seed=3, **kwargs)
    assert x.shape == (150, kwargs["max_length"]) and x.dtype == np.int32
    assert y.shape == (150,) and y.dtype == np.int32
    assert x.min() >= 0 and x.max() < len(LISTOPS_VOCABULARY)
    for row, label in zip(x, y):
        length = int((row != 0).sum())
        assert kwargs["min_length"] <= length <= kwargs["max_length"]
        assert (row[length:] == 0).all(), "padding must come last"
        value, depth, most, fewest = _evaluate(decode_listops(row))
        assert value == label
        assert 1 <= depth <= kwargs["max_depth"]
        assert 2 <= fewest and most <= kwargs["max_args"]


def test_lengths_cover_the_range_and_labels_vary():
    x, y = make_listops(300, min_length=20, max_length=80, max_depth=5,
                        max_args=6, seed=0)
    lengths = (x != 0).sum(axis=1)
    assert lengths.min() < 30 and lengths.max() > 70
    assert len(np.unique(y)) == 10


def test_vocabulary():
    assert LISTOPS_VOCABULARY[0] == "<pad>"
    assert listops_token_id("7") == 8
    assert [listops_token_id(t) for t in ("[MAX", "[MIN", "[MED", "[SM", "]")
            ] == [11, 12, 13, 14, 15]
    assert decode_listops([11, 5, 4, 15, 0]) == "[MAX 4 3 ]"
    with pytest.raises(ValueError, match="token"):
        listops_token_id("[AVG")


def test_seeds():
    kwargs = dict(min_length=10, max_length=50, max_depth=4, max_args=5)
    a = make_listops(20, seed=1, **kwargs)
    b = make_listops(20, seed=1, **kwargs)
    c = make_listops(20, seed=2, **kwargs)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(min_length=1, max_length=3), "max_length"),
        (dict(min_length=50, max_length=40), "max_length"),
        (dict(min_length=5, max_length=5, max_depth=1, max_args=2),
         "min_length"),
        (dict(min_length=20, max_length=30, max_depth=1, max_args=5),
         "max_depth"),
        (dict(max_args=1), "max_args"),
        (dict(max_depth=0), "max_depth"),
        (dict(num_samples=0), "num_samples"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_arguments(kwargs, name):
    kwargs = dict(dict(num_samples=2), **kwargs)
    num_samples = kwargs.pop("num_samples")
    with pytest.raises(ValueError, match=name) as info:
        make_listops(num_samples, **kwargs)
    assert "Received" in str(info.value)
