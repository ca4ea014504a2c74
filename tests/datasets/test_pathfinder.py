"""Pathfinder: labels recomputed from the pixels alone."""

from collections import deque

import numpy as np
import pytest

from keras_longattn.datasets import PATHFINDER_ENDPOINT
from keras_longattn.datasets import make_pathfinder

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _components(image, radius):
    """Labels drawn pixels; neighbours within Chebyshev distance `radius`."""
    size = image.shape[0]
    labels = np.full(image.shape, -1, dtype=int)
    count = 0
    for start in zip(*np.nonzero(image)):
        if labels[start] >= 0:
            continue
        labels[start] = count
        queue = deque([start])
        while queue:
            r, c = queue.popleft()
            for rr in range(max(0, r - radius), min(size, r + radius + 1)):
                for cc in range(max(0, c - radius), min(size, c + radius + 1)):
                    if image[rr, cc] and labels[rr, cc] < 0:
                        labels[rr, cc] = count
                        queue.append((rr, cc))
        count += 1
    return labels, count


def _check(x, y, resolution, gap_length, num_paths):
    for flat, label in zip(x, y):
        image = flat.reshape(resolution, resolution)
        labels, count = _components(image, radius=gap_length + 1)
        assert count == num_paths, "paths must be separate components"
        markers = list(zip(*np.nonzero(image == PATHFINDER_ENDPOINT)))
        assert len(markers) == 2
        connected = labels[markers[0]] == labels[markers[1]]
        assert int(connected) == label


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(resolution=16, path_length=8, num_distractors=1),
        dict(gap_length=0, dash_length=1, num_distractors=3),
        dict(gap_length=2, dash_length=2, num_distractors=1, curvature=0.5),
    ],
)
def test_labels_match_connectivity(kwargs):
    x, y = make_pathfinder(60, seed=5, **kwargs)
    resolution = kwargs.get("resolution", 32)
    assert x.shape == (60, resolution**2) and x.dtype == np.int32
    assert y.shape == (60,) and y.dtype == np.int32
    assert set(np.unique(x)) == {0, 1, 2}
    assert y.sum() == 30, "classes must be balanced"
    _check(x, y, resolution, kwargs.get("gap_length", 1),
           2 + kwargs.get("num_distractors", 2))


def test_solid_paths_agree_with_scipy_8_connectivity():
    ndimage = pytest.importorskip("scipy.ndimage")
    x, y = make_pathfinder(40, gap_length=0, seed=1)
    for flat, label in zip(x, y):
        image = flat.reshape(32, 32)
        labels, _ = ndimage.label(image > 0, structure=np.ones((3, 3)))
        first, second = zip(*np.nonzero(image == PATHFINDER_ENDPOINT))
        assert int(labels[first] == labels[second]) == label


def test_paths_are_dashed():
    x, _ = make_pathfinder(20, dash_length=3, gap_length=1, seed=0)
    for flat in x:
        image = flat.reshape(32, 32)
        _, solid = _components(image, radius=1)
        assert solid > 4, "gaps should split paths under 8-connectivity"


def test_odd_count_and_seeds():
    _, y = make_pathfinder(7, resolution=16, path_length=8, seed=0)
    assert y.sum() == 4
    a = make_pathfinder(10, seed=3)
    b = make_pathfinder(10, seed=3)
    c = make_pathfinder(10, seed=4)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(resolution=3), "resolution"),
        (dict(path_length=2), "path_length"),
        (dict(resolution=8, path_length=40), "path_length"),
        (dict(num_distractors=-1), "num_distractors"),
        (dict(dash_length=0), "dash_length"),
        (dict(gap_length=-1), "gap_length"),
        (dict(curvature=-0.1), "curvature"),
        (dict(num_samples=0), "num_samples"),
    ],
)
def test_bad_arguments(kwargs, name):
    num_samples = kwargs.pop("num_samples", 2)
    with pytest.raises(ValueError, match=name) as info:
        make_pathfinder(num_samples, **kwargs)
    assert "Received" in str(info.value)


def test_crowded_images_raise_runtime_error():
    with pytest.raises(RuntimeError, match="path_length"):
        make_pathfinder(1, resolution=8, path_length=12, num_distractors=2,
                        seed=0)
