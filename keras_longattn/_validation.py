"""Argument checks shared by the layers and ops: each error names the
argument and the value received."""

import math
import numbers


def positive_int(name, value, allow_none=False):
    """``value`` as an int >= 1 (or None when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        kind = "a positive integer or None" if allow_none else "a positive integer"
        raise ValueError(f"`{name}` must be {kind}. Received: {name}={value!r}")
    return int(value)


def non_negative_int(name, value):
    """``value`` as an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(
            f"`{name}` must be a non-negative integer. Received: {name}={value!r}"
        )
    return int(value)


def length_within(what, length, max_length, holder):
    """Refuses a sequence longer than the ``max_length`` of a layer whose
    weights are sized by it (``holder`` says which: e.g. "the projections of
    LinformerAttention"). Lengths unknown while tracing pass."""
    if isinstance(length, int) and length > max_length:
        raise ValueError(
            f"The {what} sequence has {length} positions, more than {holder} "
            f"take (max_length={max_length}). Received: {what} length {length} > "
            f"max_length={max_length}"
        )


def positive_finite_float(name, value):
    """``value`` as a float that is finite and > 0 (bools, strings, NaN,
    infinities, zero, negatives and numbers beyond the float range are
    refused)."""
    number = None
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:
            number = None
    if number is None or not math.isfinite(number) or not number > 0.0:
        raise ValueError(
            f"`{name}` must be a finite number > 0. Received: {name}={value!r}"
        )
    return number


def optional_seed(name, value, upper=None):
    """``value`` as an int >= 0 (below ``upper`` when given), or None.
    Bools, floats (even integral ones) and strings are refused."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < 0
        or (upper is not None and value >= upper)
    ):
        bound = "" if upper is None else f" below {upper}"
        raise ValueError(
            f"`{name}` must be None or a non-negative integer{bound}. "
            f"Received: {name}={value!r}"
        )
    return int(value)
