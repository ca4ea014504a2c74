"""Error measures shared by the test helpers."""

import numpy as np


def rel_error(actual, expected):
    """max |actual - expected| / max |expected| (0 when both are 0)."""
    actual = np.asarray(actual, dtype="float64")
    expected = np.asarray(expected, dtype="float64")
    scale = max(np.max(np.abs(expected)), 1e-30)
    return float(np.max(np.abs(actual - expected)) / scale)
