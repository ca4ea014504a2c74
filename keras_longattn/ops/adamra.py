"""What is specific to AdaMRA (Zhang et al. 2021): per-head compression
rates turned into landmark counts and segment lengths, and the router that
sends each query to one head.

The shared machinery lives elsewhere: segment means in
:mod:`keras_longattn.ops.segments`, kernelized attention in
:mod:`keras_longattn.ops.kernelized`.

Shape legend: B batch, T query length, S key length, H heads.
"""

import fractions
import numbers

import numpy as np
from keras import ops

from keras_longattn.ops.segments import dims
from keras_longattn.ops.shapes import is_static

#: Routing modes: the learned router, uniformly random heads (the paper's
#: "Rand" ablation), or every head for every query (no routing).
ROUTINGS = ("learned", "random", "all")
#: Attention over the landmarks: kernelized (the paper) or a softmax (the
#: paper's "Softmax" ablation).
ATTENTIONS = ("kernel", "softmax")

#: Largest denominator of a compression rate read as a fraction.
MAX_RATE_DENOMINATOR = 10_000

# The pseudo-random routes of routing="random": integer arithmetic modulo a
# prime below 2**15, so that every product fits in int32 on every backend.
_PRIME = 32749


def check_compression_rates(rates, num_heads):
    """The rates as a tuple of floats in ``[1 / MAX_RATE_DENOMINATOR, 1]``,
    one per head, else a ValueError naming ``compression_rates`` and the
    value received."""
    try:
        values = tuple(rates)
    except TypeError:
        values = None
    if (
        values is None
        or isinstance(rates, (str, bytes))
        or not values
        or any(
            isinstance(c, bool) or not isinstance(c, numbers.Real) or not 0.0 < c <= 1.0
            for c in values
        )
    ):
        raise ValueError(
            "`compression_rates` must be a sequence of numbers in (0, 1], "
            f"one per head. Received: compression_rates={rates!r}"
        )
    if len(values) != num_heads:
        raise ValueError(
            f"`compression_rates` must have one rate per head ({num_heads} "
            f"heads). Received: compression_rates={rates!r}"
        )
    if any(c < 1.0 / MAX_RATE_DENOMINATOR for c in values):
        raise ValueError(
            "`compression_rates` must be at least "
            f"1/{MAX_RATE_DENOMINATOR} (each rate is read as a fraction of "
            f"denominator at most {MAX_RATE_DENOMINATOR}: a smaller one could "
            f"read as 0). Received: compression_rates={rates!r}"
        )
    return tuple(float(c) for c in values)


def default_compression_rates(num_heads):
    """The paper's choice for H heads: ``(1/2, 1/4, ..., 1/2**H)`` (Table 2
    uses ``(1/2, 1/4, 1/8, 1/16)`` for four heads)."""
    return tuple(1.0 / 2 ** (h + 1) for h in range(num_heads))


def rate_fraction(rate):
    """``rate`` as a fraction ``(p, q)`` with ``q`` at most
    :data:`MAX_RATE_DENOMINATOR` (so that ``1/3`` is read exactly)."""
    f = fractions.Fraction(float(rate)).limit_denominator(MAX_RATE_DENOMINATOR)
    return f.numerator, f.denominator


def num_landmarks(length, rate):
    """``ceil(length * rate)``, at least 1: the landmarks of a head with
    compression rate ``rate`` over ``length`` keys. ``length`` is an int or
    an int tensor (per example); exact integer arithmetic (no overflow:
    ``length = a * q + r`` with ``r < q``)."""
    p, q = rate_fraction(rate)
    if is_static(length):
        n = int(length)
        return max(1, -(-n * p // q))
    n = ops.cast(length, "int32")
    a, r = n // q, n % q
    m = a * p + (r * p + (q - 1)) // q
    return ops.maximum(m, 1)


def max_landmarks(length, rates):
    """Landmark slots per head for ``length`` keys: the largest count of
    any head (the layout holds every head in ``(B, M, H, d)``)."""
    return num_landmarks(length, max(rates))


def segment_lengths(real_lengths, rates):
    """Tokens per segment of each head: ``ceil(n_b / m_h(n_b))`` for
    ``n_b`` real tokens, so that the real tokens of an example fill at most
    ``m_h(n_b)`` consecutive segments (the paper pads ``n`` to a multiple of
    ``m_h``; the last segment may be shorter, and when ``m_h`` does not
    divide ``n_b`` some trailing segments stay empty).

    Args:
        real_lengths: int ``(*lead,)`` (rows of zero real tokens give 1).
        rates: the H compression rates.

    Returns:
        int32 ``(*lead, H)``.
    """
    n = ops.maximum(ops.cast(real_lengths, "int32"), 1)
    columns = []
    for rate in rates:
        m = num_landmarks(n, rate)
        columns.append((n + m - 1) // m)
    return ops.stack(columns, axis=-1)


def router_probabilities(query, kernel):
    """``softmax(Q W)`` in float32: each query's distribution over heads.

    Args:
        query: projected queries ``(B, T, H, d)``; the router reads all
            heads of a query at once (``(B, T, H * d)``).
        kernel: ``(H * d, H)``.

    Returns:
        float32 ``(B, T, H)``.
    """
    H, d = query.shape[2], query.shape[3]
    flat = ops.reshape(ops.cast(query, "float32"), tuple(dims(query)[:2]) + (H * d,))
    logits = ops.matmul(flat, ops.cast(kernel, "float32"))
    return ops.softmax(logits, axis=-1)


def query_ranks(batch, length, query_mask=None):
    """Position of each query among the real queries of its example
    (padding anywhere does not move the others): int32 ``(B, T)``."""
    if query_mask is None:
        return ops.broadcast_to(ops.arange(length, dtype="int32"), (batch, length))
    flags = ops.cast(ops.cast(query_mask, "bool"), "int32")
    return ops.maximum(ops.cumsum(flags, axis=1) - 1, 0)


def _seed_constants(seed):
    rng = np.random.default_rng(0 if seed is None else int(seed))
    return [int(c) for c in rng.integers(1, _PRIME, size=5)]


def random_heads(ranks, num_heads, seed=None):
    """A fixed pseudo-random head per query position (``routing="random"``).

    A hash of ``(seed, rank)`` in int32 arithmetic modulo a prime (two
    squarings for mixing), so the routes are the same on every backend, in
    every call and on every path, and do not depend on the batch's padding.
    About uniform over the heads.

    Args:
        ranks: int ``(B, T)`` positions (see :func:`query_ranks`).
        num_heads: H.
        seed: int or None (0).

    Returns:
        int32 ``(B, T)`` in ``[0, H)``.
    """
    c = _seed_constants(seed)
    P = _PRIME
    r = ops.cast(ranks, "int32")
    low, high = r % P, (r // P) % P
    x = (low * c[0] + (high * c[1] + c[2]) % P) % P
    x = (x * x + c[3]) % P
    x = (x * c[4] + 12345) % P
    x = (x * x + c[0]) % P
    return x % num_heads


def routing_weights(mode, num_heads, probabilities=None, ranks=None, seed=None,
                    scale_by_probability=True):
    """The weight of each head's output for each query.

    * ``"learned"``: one-hot of ``argmax P`` (ties: the lower head) times the
      chosen head's probability (as in a switch mixture of experts: without
      this factor the argmax would give the router no gradient at all);
    * ``"random"``: one-hot of :func:`random_heads` (no router);
    * ``"all"``: 1 for every head (no routing).

    Args:
        mode: one of :data:`ROUTINGS`.
        num_heads: H.
        probabilities: float32 ``(B, T, H)`` (``"learned"``).
        ranks: int ``(B, T)`` (``"random"`` and ``"all"``: for the shape).
        seed: seed of ``"random"``.
        scale_by_probability: ``"learned"`` only; False gives the plain
            one-hot (no gradient to the router).

    Returns:
        float32 ``(B, T, H)``.
    """
    if mode == "learned":
        choice = ops.argmax(probabilities, axis=-1)
        onehot = ops.one_hot(choice, num_heads, dtype="float32")
        if not scale_by_probability:
            return onehot
        return onehot * probabilities
    if mode == "random":
        return ops.one_hot(random_heads(ranks, num_heads, seed), num_heads, dtype="float32")
    if mode == "all":
        return ops.ones_like(ops.cast(ranks, "float32"))[..., None] * ops.ones(
            (num_heads,), dtype="float32"
        )
    raise ValueError(f"`routing` must be one of {ROUTINGS}. Received: routing={mode!r}")
