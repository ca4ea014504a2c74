"""Argument checks shared by the dataset loaders and generators.

Every check raises a `ValueError` that names the argument and repeats the
value that was received, so that a bad call is easy to fix.
"""

import numbers

import numpy as np

SPLITS = ("train", "valid", "test")


def check_int(name, value, min_value=None, max_value=None):
    """Checks that `value` is an integer in `[min_value, max_value]`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, numbers.Integral
    ):
        raise ValueError(
            f"`{name}` must be an integer. Received: {name}={value!r}"
        )
    value = int(value)
    if min_value is not None and value < min_value:
        raise ValueError(
            f"`{name}` must be >= {min_value}. Received: {name}={value}"
        )
    if max_value is not None and value > max_value:
        raise ValueError(
            f"`{name}` must be <= {max_value}. Received: {name}={value}"
        )
    return value


def check_fraction(name, value, allow_zero=True):
    """Checks that `value` is a real number in `[0, 1)` (or `(0, 1)`)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = (value >= 0.0 if allow_zero else value > 0.0) and value < 1.0
    if not ok:
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(
            f"`{name}` must be a number in {interval}. "
            f"Received: {name}={value!r}"
        )
    return value


def check_choice(name, value, allowed):
    """Checks that `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(
            f"`{name}` must be one of {list(allowed)}. "
            f"Received: {name}={value!r}"
        )
    return value


def check_split(split, allow_none=True):
    """Checks a `split` argument (`"train"`, `"valid"`, `"test"` or None)."""
    if split is None and allow_none:
        return None
    allowed = SPLITS + ((None,) if allow_none else ())
    return check_choice("split", split, allowed)


def check_seed(seed):
    """Checks that `seed` is None or a non-negative integer."""
    if seed is None:
        return None
    return check_int("seed", seed, min_value=0)


def as_byte_array(name, data):
    """Converts `data` (bytes or a 1D integer array) to a 1D numpy array."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(data), dtype=np.uint8)
    array = np.asarray(data)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"`{name}` must be bytes or a 1D integer array. "
            f"Received: {name} with dtype={array.dtype}, "
            f"shape={array.shape}"
        )
    return array
