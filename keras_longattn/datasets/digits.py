"""scikit-learn's 8x8 digits as pixel sequences, at a chosen resolution."""

import numpy as np

from keras_longattn.datasets import _validation as v

#: Largest pixel value in scikit-learn's digits (values are 0..16).
DIGITS_MAX_VALUE = 16


def _interpolation_matrix(in_size, out_size, interpolation):
    """Matrix `A` of shape `(out_size, in_size)` with `out = A @ in`.

    Half-pixel centres: output pixel `r` sits at input coordinate
    `(r + 0.5) * in_size / out_size - 0.5`.
    """
    scale = in_size / out_size
    matrix = np.zeros((out_size, in_size), dtype=np.float64)
    rows = np.arange(out_size)
    if interpolation == "nearest":
        src = np.floor((rows + 0.5) * scale).astype(int)
        matrix[rows, np.clip(src, 0, in_size - 1)] = 1.0
        return matrix
    src = np.clip((rows + 0.5) * scale - 0.5, 0.0, in_size - 1)
    low = np.floor(src).astype(int)
    high = np.minimum(low + 1, in_size - 1)
    weight = src - low
    np.add.at(matrix, (rows, low), 1.0 - weight)
    np.add.at(matrix, (rows, high), weight)
    return matrix


def resize_images(images, resolution, interpolation="bilinear"):
    """Resizes a batch of square images with numpy.

    Both interpolations use half-pixel centres (like
    `tf.image.resize` and PIL): output pixel `r` samples the input at
    coordinate `(r + 0.5) * in_size / resolution - 0.5`. `"bilinear"`
    interpolates linearly between the two nearest input pixels along each
    axis (clamped at the border; no anti-aliasing when shrinking);
    `"nearest"` takes the input pixel that contains the sample point.

    Args:
        images: array of shape `(N, H, W)` with `H == W`.
        resolution: output height and width.
        interpolation: `"bilinear"` or `"nearest"`. Defaults to
            `"bilinear"`.

    Returns:
        A `float64` array of shape `(N, resolution, resolution)`.

    Example:

    >>> image = np.array([[[0.0, 4.0], [8.0, 12.0]]])
    >>> resize_images(image, 4)[0]
    array([[ 0.,  1.,  3.,  4.],
           [ 2.,  3.,  5.,  6.],
           [ 6.,  7.,  9., 10.],
           [ 8.,  9., 11., 12.]])
    """
    images = np.asarray(images, dtype=np.float64)
    if images.ndim != 3 or images.shape[1] != images.shape[2]:
        raise ValueError(
            "`images` must have shape (N, H, W) with H == W. "
            f"Received: images.shape={images.shape}"
        )
    resolution = v.check_int("resolution", resolution, min_value=1)
    interpolation = v.check_choice(
        "interpolation", interpolation, ("bilinear", "nearest")
    )
    matrix = _interpolation_matrix(images.shape[1], resolution, interpolation)
    return np.einsum("ri,nij,sj->nrs", matrix, images, matrix)


def quantize(values, levels, max_value):
    """Quantises values in `[0, max_value]` to integers `0..levels-1`.

    `q = floor(values / max_value * (levels - 1) + 0.5)`, i.e. rounding to
    the nearest of `levels` evenly spaced intensities, `0` maps to `0` and
    `max_value` to `levels - 1`.

    Example:

    >>> quantize(np.array([0, 4, 8, 12, 16]), levels=3, max_value=16)
    array([0, 1, 1, 2, 2], dtype=int32)
    """
    levels = v.check_int("levels", levels, min_value=2)
    scaled = np.asarray(values, dtype=np.float64) / max_value * (levels - 1)
    return np.clip(np.floor(scaled + 0.5), 0, levels - 1).astype(np.int32)


def load_digits_sequences(
    resolution=8,
    levels=17,
    interpolation="bilinear",
    test_fraction=0.2,
    seed=0,
):
    """Loads scikit-learn's digits as sequences of quantised pixels.

    The 1797 8x8 grey-scale digit images of `sklearn.datasets.load_digits`
    (pixel values 0..16, bundled with scikit-learn, so nothing is
    downloaded) are resized to `resolution x resolution` with numpy (see
    `resize_images()` for the interpolation), quantised to `levels`
    intensities (see `quantize()`) and flattened in row-major order. Use the
    sequences for density modelling (predict each pixel from the previous
    ones) and the labels for classification. At `resolution=32` the
    sequences have 1024 pixels.

    The split is stratified: in each class, `round(count * test_fraction)`
    images go to the test set, chosen with `seed`; both sets are then
    shuffled. With the defaults there are 1438 training and 359 test images.

    Args:
        resolution: height and width of the resized images; the sequence
            length is `resolution ** 2`. Defaults to `8` (the original).
        levels: number of intensity levels; pixels are integers in
            `0..levels-1`. Defaults to `17`, which keeps the original values
            at resolution 8.
        interpolation: `"bilinear"` or `"nearest"`. Defaults to
            `"bilinear"`.
        test_fraction: fraction of each class held out for testing.
            Defaults to `0.2`.
        seed: seed of the split and shuffling. Defaults to `0`.

    Returns:
        Tuple of numpy arrays: `(x_train, y_train), (x_test, y_test)`, with
        `x` of shape `(N, resolution ** 2)` and `y` (labels 0..9) of shape
        `(N,)`, both `int32`.

    Raises:
        ValueError: if `resolution < 1`, `levels < 2`, `test_fraction` is
            not in `(0, 1)` or `interpolation` is unknown.
        ImportError: if scikit-learn is not installed.

    Example:

    >>> (x_train, y_train), (x_test, y_test) = load_digits_sequences(
    ...     resolution=32, levels=4)
    >>> x_train.shape, x_test.shape, int(x_train.max())
    ((1438, 1024), (359, 1024), 3)
    """
    resolution = v.check_int("resolution", resolution, min_value=1)
    levels = v.check_int("levels", levels, min_value=2)
    interpolation = v.check_choice(
        "interpolation", interpolation, ("bilinear", "nearest")
    )
    test_fraction = v.check_fraction(
        "test_fraction", test_fraction, allow_zero=False
    )
    seed = v.check_seed(seed)
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError(
            "load_digits_sequences() needs scikit-learn: "
            "`pip install scikit-learn` or "
            "`pip install 'keras-longattn[notebooks]'`."
        ) from e
    digits = load_digits()
    images = resize_images(digits.images, resolution, interpolation)
    x = quantize(images, levels, DIGITS_MAX_VALUE).reshape(len(images), -1)
    y = digits.target.astype(np.int32)

    rng = np.random.default_rng(seed)
    test_mask = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        test_mask[members[: int(round(len(members) * test_fraction))]] = True
    train_index = rng.permutation(np.flatnonzero(~test_mask))
    test_index = rng.permutation(np.flatnonzero(test_mask))
    return (x[train_index], y[train_index]), (x[test_index], y[test_index])
