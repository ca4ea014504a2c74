"""FAVOR+ (Choromanski et al. 2021): positive orthogonal random features
of the softmax kernel, for :class:`keras_longattn.layers.PerformerAttention`.

With ``x' = x / d**(1/4)`` (so that ``q' . k' = q . k / sqrt(d)``) and ``m``
random vectors ``w_r`` (the rows of the ``(m, d)`` projection),

    phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(m),

is positive and ``E[phi(q) . phi(k)] = exp(q . k / sqrt(d))`` when each
``w_r ~ N(0, I_d)``. The rows are drawn in blocks of ``d`` that are exactly
orthogonal (the QR factor of a Gaussian matrix, signs fixed so that it is
Haar-distributed), each row then scaled to the norm of an independent
Gaussian vector: every row keeps the ``N(0, I_d)`` marginal, and orthogonal
rows lower the estimator's variance (the paper's Theorem 2).

Numerical stability. A constant factor common to all keys, or to all the
features of one query, cancels between the numerator and the normaliser,
so the features are computed as ``exp(z - shift)``:

* queries: ``shift`` = the query's largest exponent (its largest feature
  is 1), as the authors do;
* keys, bidirectional: the largest exponent over every real key and
  feature of the example and head (the authors' global max; padded keys
  are left out of it);
* keys, causal: a global max would let later keys set the scale of
  earlier outputs (rounding and underflow of a past query would depend on
  the future). The exponent is bounded by the projection alone:
  ``w . x' - |x'|^2 / 2 = |w|^2 / 2 - |x' - w|^2 / 2 <= |w|^2 / 2``. With
  ``c = max_r |w_r|^2 / 2``, keys take ``shift = c / 2`` and queries
  ``shift = max - c / 2``: every feature is at most ``exp(c / 2)``, and
  the products keep the scale of the bidirectional form.

The shifts are constants for the gradient (``stop_gradient``): they cancel
in exact arithmetic.

Shape legend: B batch, n length, H heads, d head size, m features.
"""

import numpy as np
from keras import ops
from keras import random

from keras_longattn._validation import positive_int


def orthogonal_gaussian_numpy(num_features, dim, seed):
    """The ``(num_features, dim)`` float32 projection of draw 0, in NumPy
    (the same numbers on every backend for one ``seed``)."""
    num_features = positive_int("num_features", num_features)
    dim = positive_int("dim", dim)
    rng = np.random.default_rng(seed)
    blocks = -(-num_features // dim)
    rows = []
    for _ in range(blocks):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        sign = np.where(np.diag(r) < 0.0, -1.0, 1.0)
        rows.append((q * sign[None, :]).T)
    w = np.concatenate(rows, axis=0)[:num_features]
    norms = np.linalg.norm(rng.standard_normal((num_features, dim)), axis=1)
    return (w * norms[:, None]).astype("float32")


def orthogonal_gaussian(num_features, dim, seed):
    """The same distribution as :func:`orthogonal_gaussian_numpy`, drawn
    with ``keras.random`` (inside a traced training step).

    Args:
        num_features: m.
        dim: d.
        seed: an int or a ``keras.random.SeedGenerator``.

    Returns:
        float32 ``(num_features, dim)``.
    """
    blocks = -(-num_features // dim)
    g = random.normal((blocks, dim, dim), dtype="float32", seed=seed)
    q, r = ops.qr(g)
    diag = ops.diagonal(r, axis1=-2, axis2=-1)  # (blocks, dim)
    sign = ops.where(diag < 0.0, -1.0, 1.0)
    q = q * sign[:, None, :]
    w = ops.reshape(ops.transpose(q, (0, 2, 1)), (blocks * dim, dim))[:num_features]
    gauss = random.normal((num_features, dim), dtype="float32", seed=seed)
    norms = ops.sqrt(ops.sum(gauss * gauss, axis=-1))
    return w * norms[:, None]


def softmax_kernel_features(x, projection, is_query, causal=False, mask=None):
    """Positive random features of the softmax kernel, stabilised (see the
    module docstring).

    Args:
        x: projected queries or keys ``(B, n, H, d)``.
        projection: ``(m, d)`` random rows.
        is_query: queries (a shift per query) or keys.
        causal: keys of a causal call (a shift set by the projection alone).
        mask: optional boolean ``(B, n)`` of real keys: padded keys get
            features of exactly 0 and take no part in the global max.

    Returns:
        float32 ``(B, n, H, m)``, positive where real.
    """
    x = ops.cast(x, "float32")
    w = ops.cast(projection, "float32")
    d = x.shape[-1]
    m = w.shape[0]
    x = x * (float(d) ** -0.25)
    z = ops.einsum("bnhd,md->bnhm", x, w) - 0.5 * ops.sum(x * x, axis=-1, keepdims=True)
    half_bound = 0.25 * ops.max(ops.sum(w * w, axis=-1))  # c / 2
    keep = None
    if mask is not None:
        keep = ops.cast(mask, "bool")[:, :, None, None]  # (B, n, 1, 1)
    if is_query:
        shift = ops.max(z, axis=-1, keepdims=True)
        if causal:
            shift = shift - half_bound
    elif causal:
        shift = half_bound
    else:
        lowest = ops.cast(-3.0e38, "float32")
        real = z if keep is None else ops.where(keep, z, lowest)
        shift = ops.max(real, axis=(1, 3), keepdims=True)  # (B, 1, H, 1)
        shift = ops.where(shift > lowest, shift, ops.zeros_like(shift))
    z = z - ops.stop_gradient(shift)
    if keep is not None:
        z = ops.where(keep, z, ops.full_like(z, -1.0e30))
    return ops.exp(z) * (float(m) ** -0.5)
