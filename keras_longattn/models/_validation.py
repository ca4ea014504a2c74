"""Argument checks shared by the blocks and builders of ``keras_longattn.models``.

Every check raises a ``ValueError`` that names the argument and repeats the
value that was received.
"""

import numbers


def check_int(name, value, min_value=1, allow_none=False):
    """Checks that ``value`` is an integer ``>= min_value`` (or None)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"`{name}` must be an integer"
            + (" or None" if allow_none else "")
            + f". Received: {name}={value!r}"
        )
    value = int(value)
    if value < min_value:
        raise ValueError(
            f"`{name}` must be >= {min_value}. Received: {name}={value}"
        )
    return value


def check_rate(name, value):
    """Checks that ``value`` is a number in ``[0, 1)``."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = 0.0 <= value < 1.0
    if not ok:
        raise ValueError(
            f"`{name}` must be a number in [0, 1). Received: {name}={value!r}"
        )
    return value


def check_choice(name, value, allowed):
    """Checks that ``value`` is one of ``allowed``."""
    if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
        raise ValueError(
            f"`{name}` must be one of {list(allowed)}. Received: {name}={value!r}"
        )
    return value
