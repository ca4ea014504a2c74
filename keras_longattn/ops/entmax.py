"""α-entmax normalisers: sparse alternatives to softmax (Peters, Niculae,
Martins 2019; Correia, Niculae, Martins 2019).

For scores ``z`` along one axis and ``1 < α <= 2``, α-entmax is

    p_i = [(α - 1) z_i - τ]_+ ^ (1 / (α - 1)),    with τ such that Σ p = 1.

α = 2 is sparsemax (the Euclidean projection onto the simplex), α → 1 is
softmax. For α > 1 entries far enough below the largest score get a weight of
exactly 0.

* :func:`sparsemax` (α = 2) and :func:`entmax15` (α = 1.5): exact, from one
  sort of each row (the thresholds of Martins & Astudillo 2016 and Peters et
  al. 2019);
* :func:`entmax_bisect`: any α in (1, 2], a Python number or a tensor (for
  example one α per head), τ found by bisection;
* :func:`entmax`: dispatches on α (1 → the masked softmax, 1.5 →
  :func:`entmax15`, 2 → :func:`sparsemax`, otherwise bisection).

α is a Python number (checked against its interval) or a floating-point
tensor; a boolean (``True`` is not α = 1), a string, None or a tensor of a
non-float dtype is refused with a ValueError naming ``alpha``. The scores
and masks may be any tensor-like, TensorFlow variables included (read into
a tensor at the entry).

Masking follows :func:`keras_longattn.ops.masked_softmax`: masked entries get
exactly 0 (whatever their score, NaN and infinities included), a row with no
visible entry gets all zeros, values and gradients stay finite.

Gradients are exact and never pass through the sort or the bisection
iterations. With ``s = p^(2 - α)`` on the support (0 elsewhere) the Jacobian
with respect to the scores is ``J = diag(s) - s s^T / Σ s`` (symmetric), and

    dp_i/dα = t (-p_i ln p_i + s_i z_i - s_i τ'),   t = 1 / (α - 1),
    τ' = (Σ s z - Σ p ln p) / Σ s,                  0 ln 0 = 0.

(Differentiate ``ln p_i = t ln((α - 1) z_i - τ)`` in α, use
``((α - 1) z_i - τ)^(t - 1) = s_i`` and ``Σ dp_i/dα = 0``.) Both are
expressed with ``keras.ops`` and ``stop_gradient`` only, so they work on
every backend without a custom-gradient hook: the result is

    stop_gradient(p) + (h - stop_gradient(h)) + (α - stop_gradient(α)) dp/dα

with ``h = s z - s (Σ s z) / Σ s`` (``s`` held constant), whose value is ``p``
and whose vector-Jacobian products are ``J g`` and ``g . dp/dα``.

Everything is computed in float32 and returned in the dtype of the scores.
"""

import numbers

import keras
from keras import ops

from keras_longattn._validation import positive_int
from keras_longattn.kernels import backend_ops
from keras_longattn.ops.reference import masked_softmax

#: Bisection steps of :func:`entmax_bisect`. The threshold lies in an
#: interval of width below 1; 50 halvings take it to float32 resolution even
#: where τ is small (long rows with α near 2).
DEFAULT_N_ITER = 50

#: Smallest α a *tensor* α is clipped to (a tensor cannot be checked while
#: tracing). At α = 1 the map divides by zero, and in float32 the scores are
#: resolved only to about ``6e-8 / (α - 1)``; use α = 1 (softmax) through
#: :func:`entmax` for the limit itself. The gradient with respect to α is 0
#: where the clip is active.
TENSOR_ALPHA_MIN = 1.001

# After shifting the largest visible score of a row to 0, every entry with
# (α - 1) (z_i - max z) <= -1 has weight 0 (the largest one alone would sum to
# more than 1 otherwise). Such entries, and masked ones, are set to this value
# before the threshold is searched: finite, below the support, and bounded,
# so that the squares and cumulative sums of the sort-based thresholds stay
# well conditioned in float32.
_FLOOR = -2.0


# ------------------------------------------------------------- arguments
def _check_axis(axis, rank):
    """``axis`` as a non-negative int for a tensor of ``rank``."""
    if (
        isinstance(axis, bool)
        or not isinstance(axis, numbers.Integral)
        or not -rank <= axis < rank
    ):
        raise ValueError(
            f"`axis` must be an integer in [-{rank}, {rank}) for scores of "
            f"rank {rank}. Received: axis={axis!r}"
        )
    return int(axis) % rank


def _is_number(value):
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _check_fixed_alpha(alpha, low_inclusive=False):
    """A Python number α as a float in (1, 2] (or [1, 2] when
    ``low_inclusive``), else a ValueError naming ``alpha``."""
    try:
        value = float(alpha)
    except OverflowError:
        value = float("nan")
    low_ok = value >= 1.0 if low_inclusive else value > 1.0
    if not (low_ok and value <= 2.0):  # NaN fails both
        raise ValueError(
            f"`alpha` must be in {_interval(low_inclusive)}. "
            f"Received: alpha={alpha!r}"
        )
    return value


def _interval(low_inclusive):
    return "[1, 2]" if low_inclusive else "(1, 2]"


def _check_alpha(alpha, low_inclusive=False):
    """``alpha`` checked: a Python number as a float in (1, 2] (or [1, 2]
    when ``low_inclusive``), anything else as a floating-point tensor (a
    tensor cannot be range-checked while tracing: it is clipped later).

    Booleans (Python or NumPy: ``True`` is not α = 1), strings, None and
    tensors of a non-float dtype are refused with a ValueError naming
    ``alpha`` and what was received.
    """
    if _is_number(alpha):
        return _check_fixed_alpha(alpha, low_inclusive)
    expected = (
        f"`alpha` must be a number in {_interval(low_inclusive)} or a "
        "floating-point tensor (e.g. one α per head)."
    )
    if alpha is None or isinstance(alpha, (bool, str, bytes)):
        raise ValueError(f"{expected} Received: alpha={alpha!r}")
    try:
        tensor = _as_tensor(alpha)
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise ValueError(f"{expected} Received: alpha={alpha!r}") from error
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    if "float" not in dtype:
        received = (
            f"alpha.dtype={dtype}" if hasattr(alpha, "dtype")
            else f"alpha={alpha!r} (dtype {dtype})"
        )
        raise ValueError(f"{expected} Received: {received}")
    return tensor


# ------------------------------------------------------------- plumbing
def _as_tensor(x):
    """``x`` as a tensor of the backend, read at the entry of every
    function of this module (the backend table's ``as_tensor``: a
    TensorFlow variable lacks parts of the tensor API that ``keras.ops``
    relies on)."""
    return backend_ops().as_tensor(x)


def _float_dtype(scores):
    dtype = keras.backend.standardize_dtype(scores.dtype)
    return dtype if "float" in dtype else "float32"


def _prepare(scores, mask, axis):
    """The scores in float32 with ``axis`` moved last, the visibility mask
    (bool, same shape), the result dtype and ``axis`` normalised."""
    scores = _as_tensor(scores)
    axis = _check_axis(axis, len(scores.shape))
    dtype = _float_dtype(scores)
    z = ops.cast(scores, "float32")
    if mask is None:
        visible = ops.ones_like(z, dtype="bool")
    else:
        # Broadcast the mask to the scores' shape.
        visible = ops.logical_and(
            ops.cast(_as_tensor(mask), "bool"), ops.ones_like(z, dtype="bool")
        )
    z = ops.moveaxis(z, axis, -1)
    visible = ops.moveaxis(visible, axis, -1)
    return z, visible, dtype, axis


def _row_top(z, visible):
    """The largest visible score of each row (0 for a row with none),
    keepdims, without gradient."""
    z = ops.stop_gradient(z)
    top = ops.max(ops.where(visible, z, float("-inf")), axis=-1, keepdims=True)
    return ops.where(ops.any(visible, axis=-1, keepdims=True), top, 0.0)


def _shifted(z, visible, top, a):
    """``(α - 1) (z - top)`` floored at :data:`_FLOOR`, and :data:`_FLOOR`
    on masked entries (so a masked NaN or infinity never enters)."""
    x = (ops.stop_gradient(z) - top) * a
    return ops.where(visible, ops.maximum(x, _FLOOR), _FLOOR)


def _normalise(p, visible):
    """Zeros on masked entries, rows rescaled to sum to 1 (rows with no
    visible entry stay all zeros)."""
    p = ops.where(visible, p, 0.0)
    total = ops.sum(p, axis=-1, keepdims=True)
    return p / ops.where(total > 0, total, 1.0)


def _sorted_descending(x):
    xs = -ops.sort(-x, axis=-1)
    ranks = ops.cumsum(ops.ones_like(xs), axis=-1)  # 1, 2, ..., n
    return xs, ranks


def _at_support_size(values, support):
    """``values[..., k - 1]`` with ``k`` the number of True in ``support``
    (keepdims)."""
    size = ops.sum(ops.cast(support, "int32"), axis=-1, keepdims=True)
    return ops.take_along_axis(values, size - 1, axis=-1), size


# ------------------------------------------------------ forward solvers
def _sparsemax_probs(x):
    """Sparsemax of rows ``x`` (last axis) by the sort-based threshold."""
    xs, ranks = _sorted_descending(x)
    cumsum = ops.cumsum(xs, axis=-1) - 1.0
    csum_k, size = _at_support_size(cumsum, ranks * xs > cumsum)
    tau = csum_k / ops.cast(size, "float32")
    return ops.maximum(x - tau, 0.0)


def _entmax15_probs(x):
    """1.5-entmax of rows ``x = (z - max z) / 2`` (last axis) by the
    sort-based threshold of Peters et al. (2019): for the k largest entries,
    τ_k = mean - sqrt((1 - k var) / k), and the support is the largest k
    with τ_k <= x_(k)."""
    xs, ranks = _sorted_descending(x)
    mean = ops.cumsum(xs, axis=-1) / ranks
    mean_sq = ops.cumsum(xs * xs, axis=-1) / ranks
    ss = ranks * (mean_sq - mean * mean)
    delta = (1.0 - ss) / ranks
    taus = mean - ops.sqrt(ops.maximum(delta, 0.0))
    tau, _ = _at_support_size(taus, taus <= xs)
    return ops.square(ops.maximum(x - tau, 0.0))


def _bisect_probs(x, visible, a, n_iter):
    """α-entmax of rows ``x = (α - 1)(z - max z)`` by bisection on τ.

    τ lies in [-1, -(1 / n)^(α - 1)] (n visible entries): at -1 the largest
    entry alone has weight 1, at the upper end even n equal entries sum to at
    most 1. ``f(τ) = Σ [x - τ]_+^t - 1`` decreases in τ; the lower end keeps
    ``f >= 0``, so the final weights include the whole support and are
    rescaled to sum to 1.
    """
    t = 1.0 / a
    count = ops.sum(ops.cast(visible, "float32"), axis=-1, keepdims=True)
    tau_hi = -ops.power(1.0 / ops.maximum(count, 1.0), a)
    tau_lo = ops.zeros_like(tau_hi) - 1.0
    width = tau_hi - tau_lo

    def step(_, state):
        tau_lo, width = state
        width = width * 0.5
        tau_mid = tau_lo + width
        mass = ops.sum(
            ops.power(ops.maximum(x - tau_mid, 0.0), t), axis=-1, keepdims=True
        )
        tau_lo = ops.where(mass >= 1.0, tau_mid, tau_lo)
        return tau_lo, width

    tau_lo, _ = ops.fori_loop(0, n_iter, step, (tau_lo, width))
    return ops.power(ops.maximum(x - tau_lo, 0.0), t)


# ------------------------------------------------------------ gradients
def _attach_gradients(p, z, top, alpha, alpha_var=None):
    """``p`` (constant) with the exact gradients of α-entmax attached.

    Args:
        p: the weights, float32, no gradient; 0 off the support.
        z: the float32 scores (last axis normalised), carrying gradient.
        top: the row maxima used for the shift, no gradient.
        alpha: α as a Python float or a float32 tensor without gradient
            (broadcastable to ``p``).
        alpha_var: the α tensor carrying gradient (same value as
            ``alpha``), or None for a fixed α.
    """
    support = p > 0
    safe_p = ops.where(support, p, 1.0)
    s = ops.where(support, ops.power(safe_p, 2.0 - alpha), 0.0)
    sum_s = ops.sum(s, axis=-1, keepdims=True)
    sum_s = ops.where(sum_s > 0, sum_s, 1.0)
    # Shifted by the row maximum (the map is shift invariant) and 0 off the
    # support, so masked NaN or infinite scores never meet a multiplication.
    zc = ops.where(support, z - top, 0.0)
    h = s * zc - s * ops.sum(s * zc, axis=-1, keepdims=True) / sum_s
    out = p + (h - ops.stop_gradient(h))
    if alpha_var is not None:
        zc = ops.stop_gradient(zc)
        p_log_p = ops.where(support, p * ops.log(safe_p), 0.0)
        sum_sz = ops.sum(s * zc, axis=-1, keepdims=True)
        tau_prime = (sum_sz - ops.sum(p_log_p, axis=-1, keepdims=True)) / sum_s
        dp_dalpha = (s * zc - p_log_p - s * tau_prime) / (alpha - 1.0)
        out = out + (alpha_var - ops.stop_gradient(alpha_var)) * dp_dalpha
    return out


def _finish(out, axis, dtype):
    return ops.cast(ops.moveaxis(out, -1, axis), dtype)


def _align_alpha(alpha, z, axis):
    """A floating-point tensor α (from :func:`_check_alpha`) as float32
    with a trailing axis of size 1, aligned with the scores ``z`` (whose
    ``axis`` has been moved last). α must broadcast to the scores without
    ``axis``; dimensions unknown while tracing are not checked."""
    alpha = ops.cast(alpha, "float32")
    reduced = tuple(z.shape[:-1])
    shape = tuple(alpha.shape)
    fits = len(shape) <= len(reduced) and all(
        a is None or r is None or a in (1, r)
        for a, r in zip(reversed(shape), reversed(reduced))
    )
    if not fits:
        raise ValueError(
            "`alpha` must be a number or a tensor broadcastable to the "
            f"scores without axis {axis}, of shape {reduced}. "
            f"Received: alpha.shape={shape}"
        )
    for _ in range(len(reduced) - len(shape)):
        alpha = ops.expand_dims(alpha, 0)
    return ops.expand_dims(alpha, -1)


# ----------------------------------------------------------------- API
def sparsemax(scores, mask=None, axis=-1):
    """Sparsemax (α = 2 entmax) over ``axis`` with a boolean ``mask``:
    ``p = [z - τ]_+``, the Euclidean projection of the scores onto the
    simplex, exact (one sort per row).

    Args:
        scores: scores of any float dtype.
        mask: optional boolean tensor broadcastable to ``scores``, True where
            an entry is visible. Masked entries get exactly 0, rows with no
            visible entry all zeros.
        axis: the axis to normalise.

    Returns:
        The weights, shaped and typed like ``scores``.
    """
    z, visible, dtype, axis = _prepare(scores, mask, axis)
    top = _row_top(z, visible)
    p = _normalise(_sparsemax_probs(_shifted(z, visible, top, 1.0)), visible)
    return _finish(_attach_gradients(p, z, top, 2.0), axis, dtype)


def entmax15(scores, mask=None, axis=-1):
    """1.5-entmax over ``axis`` with a boolean ``mask``:
    ``p = [z / 2 - τ]_+^2``, exact (one sort per row).

    Args:
        scores: scores of any float dtype.
        mask: optional boolean tensor broadcastable to ``scores``, True where
            an entry is visible. Masked entries get exactly 0, rows with no
            visible entry all zeros.
        axis: the axis to normalise.

    Returns:
        The weights, shaped and typed like ``scores``.
    """
    z, visible, dtype, axis = _prepare(scores, mask, axis)
    top = _row_top(z, visible)
    p = _normalise(_entmax15_probs(_shifted(z, visible, top, 0.5)), visible)
    return _finish(_attach_gradients(p, z, top, 1.5), axis, dtype)


def entmax_bisect(scores, alpha, mask=None, axis=-1, n_iter=DEFAULT_N_ITER):
    """α-entmax over ``axis`` for any α in (1, 2], by bisection on the
    threshold.

    Args:
        scores: scores of any float dtype.
        alpha: a Python number in (1, 2], or a floating-point tensor
            broadcastable to the scores without ``axis`` (e.g. shape
            ``(H, 1, 1)`` for one α per head of ``(B, H, T, S)`` scores).
            A tensor is clipped to ``[TENSOR_ALPHA_MIN, 2]`` and receives
            the exact gradient. Booleans, strings, None and tensors of a
            non-float dtype are refused (ValueError).
        mask: optional boolean tensor broadcastable to ``scores``, True where
            an entry is visible. Masked entries get exactly 0, rows with no
            visible entry all zeros.
        axis: the axis to normalise.
        n_iter: bisection steps (int >= 1).

    Returns:
        The weights, shaped and typed like ``scores``, rescaled to sum to 1.
    """
    n_iter = positive_int("n_iter", n_iter)
    alpha = _check_alpha(alpha)
    if isinstance(alpha, float):
        alpha_var = None
        z, visible, dtype, axis = _prepare(scores, mask, axis)
        alpha_value = alpha
    else:
        z, visible, dtype, axis = _prepare(scores, mask, axis)
        alpha_var = ops.clip(
            _align_alpha(alpha, z, axis), TENSOR_ALPHA_MIN, 2.0
        )
        alpha_value = ops.stop_gradient(alpha_var)
    top = _row_top(z, visible)
    a = alpha_value - 1.0
    x = _shifted(z, visible, top, a)
    p = _normalise(_bisect_probs(x, visible, a, n_iter), visible)
    out = _attach_gradients(p, z, top, alpha_value, alpha_var)
    return _finish(out, axis, dtype)


def entmax(scores, alpha, mask=None, axis=-1, n_iter=DEFAULT_N_ITER):
    """α-entmax over ``axis``, the exact algorithm where one exists.

    A Python α of 1 gives the masked softmax
    (:func:`keras_longattn.ops.masked_softmax`), 1.5 :func:`entmax15`,
    2 :func:`sparsemax`, any other value in (1, 2] and any tensor α
    :func:`entmax_bisect`.

    Args:
        scores: scores of any float dtype.
        alpha: a Python number in [1, 2] or a floating-point tensor (see
            :func:`entmax_bisect`). Booleans, strings, None and tensors of
            a non-float dtype are refused (ValueError).
        mask: optional boolean tensor broadcastable to ``scores``, True where
            an entry is visible.
        axis: the axis to normalise.
        n_iter: bisection steps, where bisection is used.

    Returns:
        The weights, shaped and typed like ``scores``.
    """
    value = _check_alpha(alpha, low_inclusive=True)
    if not isinstance(value, float):
        return entmax_bisect(scores, value, mask=mask, axis=axis, n_iter=n_iter)
    positive_int("n_iter", n_iter)
    if value == 1.0:
        scores = _as_tensor(scores)
        _check_axis(axis, len(scores.shape))
        if mask is not None:
            mask = _as_tensor(mask)
        return masked_softmax(scores, mask, axis=axis)
    if value == 1.5:
        return entmax15(scores, mask=mask, axis=axis)
    if value == 2.0:
        return sparsemax(scores, mask=mask, axis=axis)
    return entmax_bisect(scores, value, mask=mask, axis=axis, n_iter=n_iter)
