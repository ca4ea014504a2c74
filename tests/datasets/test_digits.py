"""Digits as pixel sequences."""

import numpy as np
import pytest

from keras_longattn.datasets import load_digits_sequences
from keras_longattn.datasets import quantize
from keras_longattn.datasets import resize_images

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

sklearn_datasets = pytest.importorskip("sklearn.datasets")


def _bilinear_reference(image, size):
    """Per-pixel bilinear resize, half-pixel centres, clamped borders."""
    n = image.shape[0]
    out = np.zeros((size, size))
    for i in range(size):
        for j in range(size):
            y = min(max((i + 0.5) * n / size - 0.5, 0), n - 1)
            x = min(max((j + 0.5) * n / size - 0.5, 0), n - 1)
            y0, x0 = int(y), int(x)
            y1, x1 = min(y0 + 1, n - 1), min(x0 + 1, n - 1)
            dy, dx = y - y0, x - x0
            out[i, j] = (
                image[y0, x0] * (1 - dy) * (1 - dx)
                + image[y0, x1] * (1 - dy) * dx
                + image[y1, x0] * dy * (1 - dx)
                + image[y1, x1] * dy * dx
            )
    return out


@pytest.mark.parametrize("size", [3, 8, 16, 32])
def test_bilinear_matches_reference(size):
    image = np.random.default_rng(0).uniform(0, 16, size=(8, 8))
    np.testing.assert_allclose(
        resize_images(image[None], size)[0], _bilinear_reference(image, size),
        atol=1e-9)


def test_nearest_repeats_pixels():
    image = np.arange(64.0).reshape(1, 8, 8)
    out = resize_images(image, 32, interpolation="nearest")[0]
    np.testing.assert_array_equal(out, np.kron(image[0], np.ones((4, 4))))


def _sorted_rows(a):
    return a[np.lexsort(a.T[::-1])]


def test_native_resolution_is_lossless_and_split_is_a_partition():
    (x_train, y_train), (x_test, y_test) = load_digits_sequences(seed=0)
    digits = sklearn_datasets.load_digits()
    assert x_train.shape == (1438, 64) and x_test.shape == (359, 64)
    assert x_train.dtype == y_train.dtype == np.int32
    both = np.concatenate([np.c_[x_train, y_train], np.c_[x_test, y_test]])
    original = np.c_[digits.data.astype(np.int32), digits.target]
    np.testing.assert_array_equal(_sorted_rows(both), _sorted_rows(original))
    # Stratified: each class loses round(20%) of its images to the test set.
    for label in range(10):
        count = int((digits.target == label).sum())
        assert (y_test == label).sum() == round(count * 0.2)


@pytest.mark.parametrize("resolution, levels", [(16, 2), (32, 8), (4, 16)])
def test_resolution_and_levels(resolution, levels):
    (x_train, y_train), (x_test, _) = load_digits_sequences(
        resolution=resolution, levels=levels, seed=1)
    assert x_train.shape == (1438, resolution**2)
    assert x_test.shape == (359, resolution**2)
    assert x_train.min() == 0 and x_train.max() == levels - 1
    assert set(np.unique(y_train)) == set(range(10))


def test_32x32_nearest_agrees_with_8x8():
    (x8, y8), _ = load_digits_sequences(resolution=8, levels=17, seed=2)
    (x32, y32), _ = load_digits_sequences(
        resolution=32, levels=17, interpolation="nearest", seed=2)
    np.testing.assert_array_equal(y8, y32)
    images = x32.reshape(-1, 32, 32)
    np.testing.assert_array_equal(images[:, ::4, ::4].reshape(-1, 64), x8)


def test_quantize():
    np.testing.assert_array_equal(
        quantize(np.arange(17), 17, 16), np.arange(17))
    np.testing.assert_array_equal(
        quantize(np.array([0, 7.9, 8, 16]), 2, 16), [0, 0, 1, 1])


def test_seeds():
    (a, _), _ = load_digits_sequences(seed=3)
    (b, _), _ = load_digits_sequences(seed=3)
    (c, _), _ = load_digits_sequences(seed=4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(resolution=0), "resolution"),
        (dict(levels=1), "levels"),
        (dict(interpolation="cubic"), "interpolation"),
        (dict(test_fraction=1.0), "test_fraction"),
        (dict(test_fraction=0), "test_fraction"),
        (dict(seed=-3), "seed"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name) as info:
        load_digits_sequences(**kwargs)
    assert "Received" in str(info.value)
