"""Associative recall: targets recomputed by scanning each sequence."""

import numpy as np
import pytest

from keras_longattn.datasets import make_associative_recall

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _scan(row, num_keys):
    """Returns (value token, distance) found by scanning `row`."""
    n = len(row)
    query = row[-1]
    assert 1 <= query <= num_keys
    hits = []
    position = 0
    while position < n - 1:
        token = row[position]
        if token == 0:  # leading padding
            position += 1
            continue
        assert 1 <= token <= num_keys, "a key must start each pair"
        assert row[position + 1] > num_keys, "a value must follow a key"
        if token == query:
            hits.append(position)
        position += 2
    assert len(hits) == 1, "the query key must occur exactly once"
    return row[hits[0] + 1], (n - 1) - hits[0]


@pytest.mark.parametrize("n", [3, 4, 65, 256])
def test_classification_targets(n):
    num_keys, num_values = 8, 5
    x, y = make_associative_recall(200, n, num_keys=num_keys,
                                   num_values=num_values, seed=0)
    assert x.shape == (200, n) and x.dtype == np.int32
    assert y.shape == (200,) and y.dtype == np.int32
    assert x.max() <= num_keys + num_values
    assert (x[:, 0] == 0).all() == ((n - 1) % 2 == 1)
    for row, label in zip(x, y):
        value, distance = _scan(row, num_keys)
        assert value - num_keys - 1 == label
        assert distance >= n // 2
    assert set(np.unique(y)) == set(range(num_values))


def test_min_distance_is_respected_and_used():
    n, min_distance = 129, 100
    x, y = make_associative_recall(300, n, num_keys=16, num_values=16,
                                   min_distance=min_distance, seed=1)
    distances = [_scan(row, 16)[1] for row in x]
    assert min(distances) >= min_distance
    assert max(distances) == n - 1  # the first pair is a possible slot
    x, _ = make_associative_recall(50, n, num_keys=16, num_values=16,
                                   min_distance=n - 1, seed=1)
    assert all(_scan(row, 16)[1] == n - 1 for row in x)


def test_lm_task():
    x, targets, weights = make_associative_recall(
        50, 33, num_keys=10, num_values=7, task="lm", seed=2)
    assert x.shape == targets.shape == weights.shape == (50, 33)
    assert weights.dtype == np.float32
    np.testing.assert_array_equal(weights.sum(axis=1), 1.0)
    assert (weights[:, -1] == 1).all()
    for row, target in zip(x, targets):
        value, _ = _scan(row, 10)
        assert target[-1] == value
        assert (target[:-1] == 0).all()
    x2, y2 = make_associative_recall(50, 33, num_keys=10, num_values=7,
                                     seed=2)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(targets[:, -1] - 11, y2)


def test_seeds():
    a = make_associative_recall(20, 50, seed=3)
    b = make_associative_recall(20, 50, seed=3)
    c = make_associative_recall(20, 50, seed=4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(sequence_length=2), "sequence_length"),
        (dict(num_keys=1), "num_keys"),
        (dict(num_values=1), "num_values"),
        (dict(sequence_length=10, min_distance=9), "min_distance"),
        (dict(min_distance=0), "min_distance"),
        (dict(task="regression"), "task"),
        (dict(num_samples=0), "num_samples"),
    ],
)
def test_bad_arguments(kwargs, name):
    kwargs = dict(dict(num_samples=4, sequence_length=16), **kwargs)
    with pytest.raises(ValueError, match=name) as info:
        make_associative_recall(**kwargs)
    assert "Received" in str(info.value)
