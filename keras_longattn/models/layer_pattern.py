"""Sublayer orderings of a Transformer stack (``layer_pattern`` strings).

A pattern is a string over ``{"s", "f"}``, read from the input upwards:
``"s"`` is an attention sublayer (norm + attention + dropout + residual) and
``"f"`` a feed-forward sublayer (norm + MLP + dropout + residual). The
usual Transformer of ``n`` layers is ``"sf" * n``; every ordering with the
same number of ``s`` and ``f`` has the same parameter count.
"""

from keras_longattn.models._validation import check_int

#: The characters a layer pattern may contain.
SUBLAYER_KINDS = ("s", "f")


def interleaved_pattern(num_layers):
    """The usual Transformer ordering, ``"sf" * num_layers``.

    Args:
        num_layers: number of (attention, feed-forward) pairs, >= 1.

    Returns:
        A pattern string of length ``2 * num_layers``.

    Example:

    >>> from keras_longattn.models import interleaved_pattern
    >>> interleaved_pattern(3)
    'sfsfsf'
    """
    num_layers = check_int("num_layers", num_layers, min_value=1)
    return "sf" * num_layers


def sandwich_pattern(num_layers, k):
    """The Sandwich Transformer ordering of sandwich coefficient ``k``.

    ``"s" * k + "sf" * (num_layers - k) + "f" * k``: ``k`` attention
    sublayers at the bottom, ``k`` feed-forward sublayers at the top and the
    usual interleaving in between. Same number of ``s`` and ``f`` (so the
    same parameter count) as :func:`interleaved_pattern` of ``num_layers``;
    ``k=0`` is the interleaved ordering.

    Args:
        num_layers: number of attention (and of feed-forward) sublayers, >= 1.
        k: the sandwich coefficient, ``0 <= k <= num_layers``.

    Returns:
        A pattern string of length ``2 * num_layers``.

    Example:

    >>> from keras_longattn.models import sandwich_pattern
    >>> sandwich_pattern(4, 2)
    'sssfsfff'

    Reference:
        Press et al., "Improving Transformer Models by Reordering their
        Sublayers", ACL 2020.
    """
    num_layers = check_int("num_layers", num_layers, min_value=1)
    k = check_int("k", k, min_value=0)
    if k > num_layers:
        raise ValueError(
            f"`k` must be <= num_layers={num_layers}. Received: k={k}"
        )
    return "s" * k + "sf" * (num_layers - k) + "f" * k


def validate_layer_pattern(layer_pattern):
    """Checks a ``layer_pattern`` and returns it.

    Args:
        layer_pattern: a non-empty string over ``{"s", "f"}`` with at least
            one ``"s"``.

    Returns:
        ``layer_pattern``.

    Raises:
        ValueError: naming ``layer_pattern`` and the value received.

    Example:

    >>> from keras_longattn.models import validate_layer_pattern
    >>> validate_layer_pattern("ssff")
    'ssff'
    """
    if not isinstance(layer_pattern, str) or not layer_pattern:
        raise ValueError(
            "`layer_pattern` must be a non-empty string over {'s', 'f'} "
            "('s' = attention sublayer, 'f' = feed-forward sublayer). "
            f"Received: layer_pattern={layer_pattern!r}"
        )
    bad = sorted(set(layer_pattern) - set(SUBLAYER_KINDS))
    if bad:
        raise ValueError(
            "`layer_pattern` may only contain 's' (attention sublayer) and "
            f"'f' (feed-forward sublayer); found {bad}. "
            f"Received: layer_pattern={layer_pattern!r}"
        )
    if "s" not in layer_pattern:
        raise ValueError(
            "`layer_pattern` must contain at least one 's' (attention "
            f"sublayer). Received: layer_pattern={layer_pattern!r}"
        )
    return layer_pattern
