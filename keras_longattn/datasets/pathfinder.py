"""Pathfinder-style images: are two marked endpoints joined by one path?

A small, seeded, numpy/Python re-creation of the idea of the Pathfinder task
of the Long Range Arena (not its exact images). Every image holds
`2 + num_distractors` curvy dashed paths that never come close to each
other. Two endpoints are marked: in a positive image they are the two ends
of the same path, in a negative image they are one end each of two
different paths. Both classes draw the same number of paths, so only the
placement of the markers differs.

The label can be recomputed from the image alone: call two drawn pixels
linked when their Chebyshev distance (max of the row and column
differences) is at most `gap_length + 1`. The generator guarantees that the
linked components of the drawn pixels are exactly the paths (the gaps of a
dash pattern are at most `gap_length` pixels long, and pixels of different
paths are at least `gap_length + 2` apart), so the label is 1 exactly when
both markers are in the same component. With `gap_length=0` the paths are
solid and this is ordinary 8-connectivity.
"""

import math
import random

import numpy as np

from keras_longattn.datasets import _validation as v

#: Pixel value of the background.
PATHFINDER_BACKGROUND = 0
#: Pixel value of a drawn path pixel.
PATHFINDER_PATH = 1
#: Pixel value of a marked endpoint (also part of its path).
PATHFINDER_ENDPOINT = 2

_STEP = 0.5  # length of one step of the random curve, in pixels
_ATTEMPTS_PER_PATH = 100
_ATTEMPTS_PER_IMAGE = 50


def _draw_chain(rng, blocked, resolution, length, curvature):
    """A random curve as a list of distinct 8-connected pixels, or None."""
    row, col = rng.randrange(resolution), rng.randrange(resolution)
    if blocked[row][col]:
        return None
    chain = [(row, col)]
    seen = {(row, col)}
    angle = rng.uniform(0.0, 2.0 * math.pi)
    y, x = float(row), float(col)
    for _ in range(8 * length):
        angle += rng.gauss(0.0, curvature)
        y += _STEP * math.sin(angle)
        x += _STEP * math.cos(angle)
        pixel = (int(math.floor(y + 0.5)), int(math.floor(x + 0.5)))
        if pixel == chain[-1]:
            continue
        r, c = pixel
        if not (0 <= r < resolution and 0 <= c < resolution):
            return None
        if blocked[r][c] or pixel in seen:
            return None
        chain.append(pixel)
        seen.add(pixel)
        if len(chain) == length:
            return chain
    return None


def _block(blocked, chain, radius, resolution):
    for r, c in chain:
        for rr in range(max(0, r - radius), min(resolution, r + radius + 1)):
            row = blocked[rr]
            for cc in range(
                max(0, c - radius), min(resolution, c + radius + 1)
            ):
                row[cc] = True


def _make_image(rng, label, resolution, num_paths, length, dash, gap, curve):
    radius = gap + 1  # pixels of different paths must be > radius apart
    for _ in range(_ATTEMPTS_PER_IMAGE):
        blocked = [[False] * resolution for _ in range(resolution)]
        chains = []
        for _ in range(num_paths):
            for _ in range(_ATTEMPTS_PER_PATH):
                chain = _draw_chain(rng, blocked, resolution, length, curve)
                if chain is not None:
                    break
            else:
                break
            chains.append(chain)
            _block(blocked, chain, radius, resolution)
        if len(chains) < num_paths:
            continue
        image = np.zeros((resolution, resolution), dtype=np.int32)
        for chain in chains:
            for j, (r, c) in enumerate(chain):
                if j % (dash + gap) < dash or j == len(chain) - 1:
                    image[r, c] = PATHFINDER_PATH
        first, second = chains[0], chains[1]
        if label:
            markers = [first[0], first[-1]]
        else:
            markers = [rng.choice((first[0], first[-1])),
                       rng.choice((second[0], second[-1]))]
        for r, c in markers:
            image[r, c] = PATHFINDER_ENDPOINT
        return image
    return None


def make_pathfinder(
    num_samples,
    resolution=32,
    path_length=None,
    num_distractors=2,
    dash_length=3,
    gap_length=1,
    curvature=0.25,
    seed=None,
):
    """Generates Pathfinder-style images as pixel sequences with labels.

    Each image is `resolution x resolution` pixels with values
    `PATHFINDER_BACKGROUND` (0), `PATHFINDER_PATH` (1) and
    `PATHFINDER_ENDPOINT` (2), flattened in row-major order. It holds
    `2 + num_distractors` paths, each a random curve (its heading changes
    by a Gaussian angle of standard deviation `curvature` radians every half
    pixel) rasterised to `path_length` distinct 8-connected pixels, drawn
    dashed: `dash_length` pixels on, `gap_length` pixels off, and the last
    pixel always on. Different paths stay at least `gap_length + 2` pixels
    apart (Chebyshev distance). Two endpoints are marked with value 2; the
    label is 1 when they are the two ends of one path and 0 when they are
    ends of two different paths. `ceil(num_samples / 2)` samples are
    positive and the rest negative, in random order.

    The label is a function of the image: it is 1 exactly when the two
    markers are in the same component of the drawn pixels, two pixels being
    neighbours when their Chebyshev distance is at most `gap_length + 1`
    (see the module docstring).

    Args:
        num_samples: number of images.
        resolution: height and width of the images; the sequence length is
            `resolution ** 2`. Defaults to `32`.
        path_length: number of pixels of each path. Defaults to `None`,
            which means `max(3, round(0.6 * resolution))` (19 at 32).
        num_distractors: number of paths besides the two that carry the
            markers. Defaults to `2`.
        dash_length: length of the drawn dashes, in pixels. Defaults to
            `3`.
        gap_length: length of the gaps between dashes, in pixels; `0`
            draws solid paths. Defaults to `1`.
        curvature: standard deviation, in radians, of the change of heading
            per half pixel. Defaults to `0.25`.
        seed: seed of the generator. Defaults to `None` (not
            reproducible).

    Returns:
        Tuple of numpy arrays `(x, y)`: `x` of shape
        `(num_samples, resolution ** 2)`, `int32` pixel values in
        `{0, 1, 2}`; `y` of shape `(num_samples,)`, `int32` labels in
        `{0, 1}`.

    Raises:
        ValueError: if an argument is out of range, e.g. paths that cannot
            fit in the image.
        RuntimeError: if the paths could not be placed after many attempts
            (too many or too long paths for the resolution).

    Example:

    >>> x, y = make_pathfinder(4, resolution=16, path_length=8, seed=0)
    >>> x.shape, y.tolist()
    ((4, 256), [1, 1, 0, 0])
    >>> sorted(set(x.ravel().tolist())), int((x == 2).sum())
    ([0, 1, 2], 8)
    """
    num_samples = v.check_int("num_samples", num_samples, min_value=1)
    resolution = v.check_int("resolution", resolution, min_value=4)
    if path_length is None:
        path_length = max(3, round(0.6 * resolution))
    path_length = v.check_int("path_length", path_length, min_value=3)
    num_distractors = v.check_int(
        "num_distractors", num_distractors, min_value=0
    )
    dash_length = v.check_int("dash_length", dash_length, min_value=1)
    gap_length = v.check_int("gap_length", gap_length, min_value=0)
    if not (isinstance(curvature, (int, float)) and 0 <= curvature):
        raise ValueError(
            f"`curvature` must be a number >= 0. Received: "
            f"curvature={curvature!r}"
        )
    seed = v.check_seed(seed)
    num_paths = 2 + num_distractors
    if num_paths * path_length > resolution * resolution:
        raise ValueError(
            f"{num_paths} paths (2 + num_distractors) of path_length pixels "
            f"cannot fit in a {resolution}x{resolution} image. Received: "
            f"path_length={path_length}, num_distractors={num_distractors}, "
            f"resolution={resolution}"
        )
    rng = random.Random(seed)
    labels = [i % 2 == 0 for i in range(num_samples)]
    rng.shuffle(labels)
    x = np.zeros((num_samples, resolution * resolution), dtype=np.int32)
    for i, label in enumerate(labels):
        image = _make_image(
            rng,
            label,
            resolution,
            num_paths,
            path_length,
            dash_length,
            gap_length,
            float(curvature),
        )
        if image is None:
            raise RuntimeError(
                f"Could not place {num_paths} paths of {path_length} pixels "
                f"{gap_length + 2} pixels apart in a {resolution}x"
                f"{resolution} image. Use a smaller `path_length` or "
                "`num_distractors`, a smaller `gap_length`, or a larger "
                f"`resolution`. Received: path_length={path_length}, "
                f"num_distractors={num_distractors}, gap_length={gap_length}, "
                f"resolution={resolution}"
            )
        x[i] = image.ravel()
    y = np.array(labels, dtype=np.int32)
    return x, y
