"""α-entmax normalisers (ops/entmax.py) against float64 NumPy references:
sparsemax by its sort-based threshold, general α by bisection to float64
precision, gradients by central finite differences of those references."""

import keras
import numpy as np
import pytest
from keras import ops
from keras.ops import convert_to_numpy as to_np

from keras_longattn.ops import entmax as em
from keras_longattn.ops.reference import masked_softmax
from keras_longattn.testing import input_gradient


def _rand(*shape, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal(shape)).astype("float32")


# ------------------------------------------------------- NumPy references
def np_sparsemax(z):
    """Sparsemax of one float64 row (Martins & Astudillo 2016)."""
    zs = np.sort(z)[::-1]
    k = np.arange(1, len(z) + 1)
    cs = np.cumsum(zs)
    size = k[1 + k * zs > cs].max()
    tau = (cs[size - 1] - 1) / size
    return np.maximum(z - tau, 0.0)


def np_entmax(z, alpha):
    """α-entmax of one float64 row by bisection on τ to float64 precision."""
    if alpha == 1.0:
        e = np.exp(z - z.max())
        return e / e.sum()
    a = alpha - 1.0
    x = a * (z - z.max())
    lo, hi = -1.0, 0.0

    def mass(tau):
        return np.sum(np.maximum(x - tau, 0.0) ** (1.0 / a))

    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mass(mid) >= 1.0:
            lo = mid
        else:
            hi = mid
    p = np.maximum(x - lo, 0.0) ** (1.0 / a)
    return p / p.sum()


def np_rows(fn, z, mask=None, alpha=None):
    """Applies a row function over the last axis of ``z`` (float64), with a
    mask (masked entries 0, rows with nothing visible all zeros) and an α
    per row (broadcast to ``z.shape[:-1]``)."""
    z = np.asarray(z, "float64")
    mask = np.ones(z.shape, bool) if mask is None else np.broadcast_to(mask, z.shape)
    alphas = None if alpha is None else np.broadcast_to(alpha, z.shape[:-1])
    out = np.zeros(z.shape)
    for idx in np.ndindex(*z.shape[:-1]):
        keep = mask[idx]
        if not keep.any():
            continue
        args = () if alphas is None else (float(alphas[idx]),)
        out[idx + (keep,)] = fn(z[idx][keep], *args)
    return out


# ---------------------------------------------------------------- values
def _masked_case(seed=0):
    z = _rand(2, 3, 9, seed=seed, scale=2.0)
    mask = np.random.default_rng(seed + 1).random((2, 3, 9)) < 0.7
    mask[..., 0] = True
    mask[1, 2] = False  # a row with no visible entry
    return z, mask


@pytest.mark.parametrize(
    "name, fn, alpha",
    [
        ("sparsemax", lambda z, m: em.sparsemax(z, m), 2.0),
        ("entmax15", lambda z, m: em.entmax15(z, m), 1.5),
        ("bisect_1.25", lambda z, m: em.entmax_bisect(z, 1.25, m), 1.25),
        ("bisect_1.75", lambda z, m: em.entmax_bisect(z, 1.75, m), 1.75),
        ("entmax_1.5", lambda z, m: em.entmax(z, 1.5, m), 1.5),
    ],
)
def test_masked_weights_sum_to_one_with_exact_zeros(name, fn, alpha):
    z, mask = _masked_case()
    # Masked scores may hold anything: NaN, infinities, huge values.
    junk = np.array([np.nan, -np.inf, np.inf, -1e30], "float32")
    z_bad = np.where(mask, z, junk[np.arange(z.size).reshape(z.shape) % 4])
    p = to_np(fn(z_bad, mask))
    assert p.dtype == np.float32
    assert np.all(np.isfinite(p))
    assert np.all(p[~mask] == 0)
    assert np.all(p[1, 2] == 0)
    sums = p.sum(-1)
    sums[1, 2] = 1.0
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)
    # Sparse: some visible entries are exactly zero at this score scale.
    assert np.any((p == 0) & mask)
    ref = np_rows(np_entmax, z, mask, alpha)
    np.testing.assert_allclose(p, ref, atol=2e-5)


def test_sparsemax_equals_numpy_definition():
    z = _rand(2, 3, 9, seed=3, scale=1.5)
    p = to_np(em.sparsemax(z))
    np.testing.assert_allclose(p, np_rows(np_sparsemax, z), atol=1e-6)
    np.testing.assert_allclose(to_np(em.entmax(z, 2.0)), p, atol=0)
    np.testing.assert_allclose(to_np(em.entmax_bisect(z, 2.0)), p, atol=1e-6)
    # A support of two entries: [0.25, 0.75, 0].
    two = to_np(em.sparsemax(np.array([0.5, 1.0, 0.0], "float32")))
    np.testing.assert_allclose(two, [0.25, 0.75, 0], atol=1e-7)


def test_sparsemax_equals_keras_where_keras_is_right():
    if not hasattr(ops, "sparsemax"):
        pytest.skip("keras.ops.sparsemax is not in this Keras version")
    probe = to_np(ops.sparsemax(np.array([[0.0, 0.5, 1.0]], "float32")))
    if abs(float(probe.sum()) - 1.0) > 1e-5:
        pytest.skip(
            f"keras.ops.sparsemax of Keras {keras.version()} sums the cumulative "
            "sums over the support (keras-team/keras#23425, fixed by #23469): "
            f"sparsemax([0, 0.5, 1]) = {probe[0].tolist()}"
        )
    z = _rand(2, 3, 9, seed=3, scale=1.5)
    np.testing.assert_allclose(to_np(ops.sparsemax(z)), to_np(em.sparsemax(z)), atol=1e-6)


def test_entmax15_closed_form_equals_bisection():
    z = _rand(2, 3, 9, seed=4, scale=2.0)
    exact = to_np(em.entmax15(z))
    np.testing.assert_allclose(to_np(em.entmax_bisect(z, 1.5)), exact, atol=1e-6)
    np.testing.assert_allclose(exact, np_rows(np_entmax, z, alpha=1.5), atol=1e-6)
    np.testing.assert_allclose(to_np(em.entmax(z, 1.5)), exact, atol=0)


@pytest.mark.parametrize("alpha", [1.05, 1.1, 1.33, 1.6, 1.9])
def test_bisection_equals_float64_reference(alpha):
    z = _rand(2, 4, 23, seed=int(alpha * 100), scale=2.0)
    p = to_np(em.entmax_bisect(z, alpha))
    np.testing.assert_allclose(p, np_rows(np_entmax, z, alpha=alpha), atol=2e-5)
    np.testing.assert_allclose(to_np(em.entmax(z, alpha)), p, atol=0)


def test_alpha_near_one_is_close_to_softmax_and_one_is_softmax():
    z, mask = _masked_case(seed=5)
    soft = to_np(masked_softmax(z, mask))
    np.testing.assert_array_equal(to_np(em.entmax(z, 1, mask)), soft)
    near = to_np(em.entmax_bisect(z, 1.001, mask))
    np.testing.assert_allclose(near, soft, atol=5e-3)
    # ... and not by accident: α = 1.5 is far from softmax on these scores.
    assert np.abs(to_np(em.entmax15(z, mask)) - soft).max() > 0.05


def test_tensor_alpha_per_head_equals_fixed_alpha():
    B, H, T, S = 2, 3, 4, 10
    z = _rand(B, H, T, S, seed=6, scale=2.0)
    mask = np.tril(np.ones((T, S), bool), k=6)
    alphas = np.array([1.2, 1.5, 1.9], "float32")
    p = to_np(em.entmax_bisect(z, alphas[:, None], mask))
    for h, alpha in enumerate(alphas):
        fixed = to_np(em.entmax_bisect(z[:, h], float(alpha), mask))
        np.testing.assert_allclose(p[:, h], fixed, atol=1e-6)
    assert np.all(p[..., ~mask] == 0)
    # `entmax` sends a tensor α to the bisection.
    np.testing.assert_allclose(to_np(em.entmax(z, alphas[:, None], mask)), p, atol=0)


def test_tensor_alpha_is_clipped_to_its_range():
    z = _rand(2, 9, seed=7)
    low = to_np(em.entmax_bisect(z, np.array([0.5, 1.0], "float32")))
    ref = to_np(em.entmax_bisect(z, np.full((2,), em.TENSOR_ALPHA_MIN, "float32")))
    np.testing.assert_allclose(low, ref, atol=1e-7)
    # Same weights as the Python α up to float32's rounding of 1.001.
    np.testing.assert_allclose(low, to_np(em.entmax_bisect(z, em.TENSOR_ALPHA_MIN)), atol=2e-5)
    high = to_np(em.entmax_bisect(z, np.array([3.0, 2.5], "float32")))
    np.testing.assert_allclose(high, to_np(em.sparsemax(z)), atol=1e-6)


def _bisect13(z, axis=-1):
    return em.entmax_bisect(z, 1.3, axis=axis)


def _softmax_via_entmax(z, axis=-1):
    return em.entmax(z, 1, axis=axis)


@pytest.mark.parametrize("fn", [em.sparsemax, em.entmax15, _bisect13])
def test_other_axis_equals_last_axis(fn):
    z = _rand(3, 8, 5, seed=8, scale=2.0)
    out = to_np(fn(z, axis=1))
    ref = np.moveaxis(to_np(fn(np.moveaxis(z, 1, -1), axis=-1)), -1, 1)
    np.testing.assert_allclose(out, ref, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_result_has_the_scores_dtype(dtype):
    z = ops.cast(_rand(2, 9, seed=9, scale=2.0), dtype)
    for out in (em.sparsemax(z), em.entmax15(z), em.entmax_bisect(z, 1.3)):
        assert keras.backend.standardize_dtype(out.dtype) == dtype
        np.testing.assert_allclose(to_np(ops.cast(out, "float32")).sum(-1), 1.0, atol=2e-2)


def test_huge_scores_stay_finite():
    z = np.array([[1e30, 1e30 - 1e24, -1e30, 0.0], [-1e30, -1e30, -1e30, -1e30]], "float32")
    w = ops.convert_to_tensor(_rand(2, 4, seed=21))
    for fn in (em.sparsemax, em.entmax15, lambda x: em.entmax_bisect(x, 1.4)):
        p = to_np(fn(z))
        assert np.all(np.isfinite(p))
        np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
        assert np.all(np.isfinite(input_gradient(lambda x, fn=fn: w * fn(x), z)))


# ------------------------------------------------------------- gradients
def _fd(f, x, step):
    """Central finite differences of the scalar float64 function ``f``."""
    x = np.asarray(x, "float64")
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        e = np.zeros_like(x)
        e[i] = step
        g[i] = (f(x + e) - f(x - e)) / (2 * step)
    return g


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.25, 1.7, 1.0])
def test_score_gradient_matches_finite_differences(alpha):
    z, mask = _masked_case(seed=10)
    w = _rand(*z.shape, seed=11)
    z_bad = np.where(mask, z, np.float32(np.nan))

    def op(x):
        return ops.convert_to_tensor(w) * em.entmax(x, alpha, mask)

    grad = input_gradient(op, z_bad)
    assert np.all(np.isfinite(grad))
    assert np.all(grad[~mask] == 0)
    assert np.all(grad[1, 2] == 0)  # the row with nothing visible
    ref = _fd(lambda x: np.sum(w * np_rows(np_entmax, x, mask, alpha)), z, 1e-5)
    np.testing.assert_allclose(grad, ref, atol=2e-4, rtol=1e-3)
    # Entries outside the support get no gradient (the Jacobian is zero
    # there), and the gradient is not identically zero.
    p = to_np(em.entmax(z, alpha, mask))
    assert np.all(grad[p == 0] == 0)
    assert np.abs(grad).max() > 1e-2


def test_alpha_gradient_matches_finite_differences():
    """The gradient of ``sum(w * entmax(z, alpha))`` with respect to the
    scores and a per-head α, together, against finite differences of the
    float64 reference."""
    B, H, T, S = 2, 3, 2, 8
    z = _rand(B, H, T, S, seed=12, scale=1.5)
    mask = np.ones((T, S), bool)
    mask[1, 5:] = False
    w = _rand(B, H, T, S, seed=13)
    alphas = np.array([1.15, 1.5, 1.85], "float32")
    n = z.size

    def op(packed):
        scores = ops.reshape(packed[:n], z.shape)
        alpha = ops.reshape(packed[n:], (H, 1))
        return ops.convert_to_tensor(w) * em.entmax_bisect(scores, alpha, mask)

    def ref(packed):
        scores = packed[:n].reshape(z.shape)
        return np.sum(w * np_rows(np_entmax, scores, mask, packed[n:][:, None]))

    packed = np.concatenate([z.ravel(), alphas])
    grad = input_gradient(op, packed)
    fd_alpha = _fd(lambda a: ref(np.concatenate([z.ravel(), a])), alphas, 1e-5)
    np.testing.assert_allclose(grad[n:], fd_alpha, rtol=2e-3, atol=2e-4)
    assert np.abs(fd_alpha).min() > 1e-3  # a gradient that can be wrong
    fd_z = _fd(lambda x: ref(np.concatenate([x.ravel(), alphas])), z, 1e-5)
    np.testing.assert_allclose(grad[:n].reshape(z.shape), fd_z, atol=2e-4, rtol=1e-3)


def test_alpha_gradient_near_one_and_two():
    """dp/dα at the ends of the range (α = 1.01 and 1.99), where the formula
    divides by α - 1 and where the support is small."""
    z = _rand(2, 9, seed=14, scale=1.5)
    w = _rand(2, 9, seed=15)
    for alpha in (1.01, 1.99):
        a0 = np.array([alpha, alpha], "float32")

        def op(a):
            return ops.convert_to_tensor(w) * em.entmax_bisect(z, a)

        grad = input_gradient(op, a0)
        fd = _fd(lambda a: np.sum(w * np_rows(np_entmax, z, alpha=a)), a0, 1e-5)
        np.testing.assert_allclose(grad, fd, rtol=5e-3, atol=5e-4)


def test_clipped_alpha_gets_no_gradient():
    z = _rand(2, 9, seed=16)
    w = ops.convert_to_tensor(_rand(2, 9, seed=17))
    grad = input_gradient(
        lambda a: w * em.entmax_bisect(z, a), np.array([0.5, 2.5], "float32")
    )
    np.testing.assert_array_equal(grad, 0.0)


# ------------------------------------------------------------ compilation
def test_compiled_function_gives_the_same_values():
    z, mask = _masked_case(seed=18)
    alpha = np.array([1.2, 1.5, 1.8], "float32")  # one α per row of axis 1

    def fn(x, a):
        return (
            em.sparsemax(x, mask),
            em.entmax15(x, mask),
            em.entmax_bisect(x, 1.3, mask),
            em.entmax_bisect(x, a, mask),
        )

    eager = [to_np(o) for o in fn(z, alpha)]
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        compiled = jax.jit(fn)
    elif backend == "tensorflow":
        import tensorflow as tf

        compiled = tf.function(fn, jit_compile=False)
    else:
        pytest.skip(f"no compiled-function check on the {backend} backend")
    for out, ref in zip(compiled(z, alpha), eager):
        np.testing.assert_allclose(to_np(out), ref, atol=1e-6)


# ------------------------------------------------------------- other code
def test_entmax_package_agrees_where_installed():
    entmax_pkg = pytest.importorskip(
        "entmax",
        reason="the `entmax` package (PyTorch) is not installed: its torch pin "
        "conflicts with this project's, so it is not a dependency",
    )
    import torch

    z = _rand(3, 11, seed=19, scale=2.0)
    zt = torch.tensor(z, dtype=torch.float64)
    theirs = entmax_pkg.sparsemax(zt, dim=-1).numpy()
    np.testing.assert_allclose(to_np(em.sparsemax(z)), theirs, atol=1e-6)
    theirs = entmax_pkg.entmax15(zt, dim=-1).numpy()
    np.testing.assert_allclose(to_np(em.entmax15(z)), theirs, atol=1e-6)
    alpha = torch.tensor([[1.3], [1.6], [1.9]], dtype=torch.float64, requires_grad=True)
    w = _rand(3, 11, seed=20)
    p = entmax_pkg.entmax_bisect(zt, alpha, dim=-1)
    (p * torch.tensor(w, dtype=torch.float64)).sum().backward()
    ours = to_np(em.entmax_bisect(z, np.array([1.3, 1.6, 1.9], "float32")))
    np.testing.assert_allclose(ours, p.detach().numpy(), atol=2e-5)
    wt = ops.convert_to_tensor(w)
    grad = input_gradient(
        lambda a: wt * em.entmax_bisect(z, a), np.array([1.3, 1.6, 1.9], "float32")
    )
    np.testing.assert_allclose(grad, alpha.grad.numpy().ravel(), rtol=2e-3, atol=2e-4)


# --------------------------------------------------------------- refusals
@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.5, float("nan"), float("inf"), -1, 10**400])
def test_bisect_refuses_alpha_outside_range(alpha):
    with pytest.raises(ValueError, match=r"`alpha` must be in \(1, 2\]") as info:
        em.entmax_bisect(_rand(2, 4), alpha)
    assert f"alpha={alpha!r}" in str(info.value)


@pytest.mark.parametrize("alpha", [0.99, 2.01, float("nan")])
def test_entmax_refuses_alpha_outside_range(alpha):
    with pytest.raises(ValueError, match=r"`alpha` must be in \[1, 2\]") as info:
        em.entmax(_rand(2, 4), alpha)
    assert f"alpha={alpha!r}" in str(info.value)


@pytest.mark.parametrize("shape", [(2, 4), (3,), (4, 1)])
def test_refuses_tensor_alpha_that_does_not_broadcast(shape):
    """Scores (2, 4) reduced over the last axis leave (2,): α may be (),
    (1,) or (2,), nothing else."""
    expected = "`alpha` must be a number or a tensor broadcastable"
    with pytest.raises(ValueError, match=expected) as info:
        em.entmax_bisect(_rand(2, 4), np.full(shape, 1.5, "float32"))
    assert f"alpha.shape={shape}" in str(info.value)


@pytest.mark.parametrize("axis", [2, -3, 1.0, True, "last"])
@pytest.mark.parametrize("fn", [em.sparsemax, em.entmax15, _bisect13, _softmax_via_entmax])
def test_refuses_bad_axis(fn, axis):
    with pytest.raises(ValueError, match="`axis` must be an integer") as info:
        fn(_rand(2, 4), axis=axis)
    assert f"axis={axis!r}" in str(info.value)


@pytest.mark.parametrize("n_iter", [0, -3, 2.5, None])
def test_refuses_bad_n_iter(n_iter):
    for fn in (em.entmax_bisect, em.entmax):
        with pytest.raises(ValueError, match="`n_iter` must be a positive integer") as info:
            fn(_rand(2, 4), 1.3, n_iter=n_iter)
        assert f"n_iter={n_iter!r}" in str(info.value)


def test_exported_from_ops():
    """The normalisers are exported from ``keras_longattn.ops``; the module
    keeps its name there (``ops.entmax.entmax`` dispatches on α)."""
    from keras_longattn import ops as la_ops

    assert la_ops.sparsemax is em.sparsemax
    assert la_ops.entmax15 is em.entmax15
    assert la_ops.entmax_bisect is em.entmax_bisect
    assert la_ops.entmax is em
