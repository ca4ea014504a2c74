"""NystromAttention: the conformance suite (with and without the
convolution on the values), a NumPy loop of the paper's formula, the
pseudo-inverse iteration against NumPy's, segment-mean landmarks with
padding, the full-attention limit against the iteration count, mixed
precision training steps and bad input."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import FullAttention
from keras_longattn.layers import NystromAttention
from keras_longattn.layers.nystrom_attention import FULL_LIMIT_ITERATIONS
from keras_longattn.layers.nystrom_attention import FULL_LIMIT_TOLERANCE
from keras_longattn.ops import nystrom as nystrom_ops
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error

KWARGS = {"num_heads": 2, "key_dim": 8, "num_landmarks": 8}


# ---------------------------------------------------------- conformance
class TestNystromLandmarks(AttentionLayerConformance):
    """Eight landmarks: 37 tokens make segments of 5 (the last of 2)."""

    layer_cls = NystromAttention
    init_kwargs = KWARGS
    implementation = "landmarks"
    reference_lengths = (16, 37, 2048)


class TestNystromConv(AttentionLayerConformance):
    """With the depthwise convolution on the values (5 taps per head)."""

    layer_cls = NystromAttention
    init_kwargs = dict(KWARGS, conv_kernel_size=5)
    implementation = "landmarks"
    secondary = True
    reference_lengths = (37,)


# ------------------------------------------------------------- helpers
def _x(B=2, T=37, F=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, F)).astype("float32")


def _built(x=None, **kwargs):
    layer = NystromAttention(**dict(KWARGS, **kwargs))
    x = _x() if x is None else x
    layer(x, x)
    return layer


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def numpy_pinv_iteration(a, iterations):
    """The paper's Eq. 13 in float64, one matrix."""
    z = a.T / (np.abs(a).sum(0).max() * np.abs(a).sum(1).max())
    eye = np.eye(a.shape[0])
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def numpy_nystrom(layer, x, mask=None):
    """The layer in NumPy (float64), one example and head at a time, real
    tokens only: segments of ceil(n / m) consecutive tokens, their means as
    landmarks, F A^+ B V, the output projection."""
    q = to_np(layer._query_dense(x)).astype("float64")
    k = to_np(layer._key_dense(x)).astype("float64")
    v = to_np(layer._value_dense(x)).astype("float64")
    B, T, H, d = q.shape
    m = layer.num_landmarks
    keep = np.ones((B, T), bool) if mask is None else np.asarray(mask, bool)
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        idx = np.flatnonzero(keep[b])
        n = len(idx)
        seg = -(-n // m)
        groups = [idx[i : i + seg] for i in range(0, n, seg)]
        for h in range(H):
            qh, kh, vh = q[b, :, h], k[b, idx, h], v[b, idx, h]
            ql = np.stack([q[b, g, h].mean(0) for g in groups])
            kl = np.stack([k[b, g, h].mean(0) for g in groups])
            f = _softmax(qh @ kl.T / np.sqrt(d))
            a = _softmax(ql @ kl.T / np.sqrt(d))
            bb = _softmax(ql @ kh.T / np.sqrt(d))
            z = numpy_pinv_iteration(a, layer.pinv_iterations)
            out[b, :, h] = f @ (z @ (bb @ vh))
    kernel, bias = (to_np(w).astype("float64") for w in layer._output_dense.weights)
    return np.einsum("bthd,hdo->bto", out, kernel) + bias


# ------------------------------------------------------ the formula itself
@pytest.mark.parametrize("implementation", ["landmarks", "reference"])
def test_matches_numpy_formula(implementation):
    x = _x(T=37)
    mask = np.ones((2, 37), bool)
    mask[1, 25:] = False
    layer = _built(x, implementation=implementation)
    expected = numpy_nystrom(layer, x, mask)
    ours = to_np(layer(x, x, query_mask=mask, value_mask=mask))
    assert rel_error(ours[mask], expected[mask]) < 1e-4


def test_numpy_formula_fails_on_a_broken_landmark():
    """The NumPy check can fail: landmarks that include padding differ."""
    x = _x(T=37)
    mask = np.ones((2, 37), bool)
    mask[1, 25:] = False
    layer = _built(x)
    ours = to_np(layer(x, x, query_mask=mask, value_mask=mask))
    unmasked = numpy_nystrom(layer, x, None)
    assert rel_error(ours[1][mask[1]], unmasked[1][mask[1]]) > 1e-2


def test_pinv_iteration_matches_numpy():
    rng = np.random.default_rng(0)
    a = _softmax(rng.standard_normal((3, 6, 6)) * 2.0)
    for iterations in (1, 6, 20):
        ours = to_np(nystrom_ops.iterative_pinv(a.astype("float32"), iterations))
        expected = np.stack([numpy_pinv_iteration(m, iterations) for m in a])
        assert rel_error(ours, expected) < 1e-4
    # Enough iterations converge to the Moore-Penrose pseudo-inverse.
    ours = to_np(nystrom_ops.iterative_pinv(a.astype("float32"), 40))
    assert rel_error(ours, np.linalg.pinv(a)) < 1e-3


def test_pinv_initialisation_is_per_matrix():
    """One matrix's result does not depend on the others of its batch (the
    authors' code normalises by the largest norm of the whole batch)."""
    rng = np.random.default_rng(1)
    a = _softmax(rng.standard_normal((2, 5, 5))).astype("float32")
    b = a.copy()
    b[1] *= 50.0
    alone = to_np(nystrom_ops.iterative_pinv(a[:1], 6))
    together = to_np(nystrom_ops.iterative_pinv(b, 6))
    np.testing.assert_allclose(together[0], alone[0], rtol=1e-6, atol=1e-7)


def test_pinv_keeps_empty_landmarks_zero():
    rng = np.random.default_rng(2)
    a = np.zeros((6, 6), "float32")
    a[:4, :4] = _softmax(rng.standard_normal((4, 4)))
    z = to_np(nystrom_ops.iterative_pinv(a, 6))
    assert np.all(z[4:] == 0.0) and np.all(z[:, 4:] == 0.0)
    np.testing.assert_allclose(
        z[:4, :4], to_np(nystrom_ops.iterative_pinv(a[:4, :4], 6)), rtol=1e-5, atol=1e-6
    )
    assert np.all(to_np(nystrom_ops.iterative_pinv(np.zeros((3, 3), "float32"), 6)) == 0)


def test_landmarks_are_segment_means_of_real_tokens():
    x = np.random.default_rng(3).standard_normal((2, 11, 1, 3)).astype("float32")
    mask = np.ones((2, 11), bool)
    mask[1, [0, 4, 5]] = False  # 8 real tokens, padding inside
    means, valid = nystrom_ops.landmarks(x, 4, mask)
    means, valid = to_np(means), to_np(valid)
    # Example 0: 11 tokens, segments of 3: [0:3], [3:6], [6:9], [9:11].
    for j, (lo, hi) in enumerate([(0, 3), (3, 6), (6, 9), (9, 11)]):
        np.testing.assert_allclose(means[0, j, 0], x[0, lo:hi, 0].mean(0), rtol=1e-6)
    real = x[1, mask[1], 0]  # 8 tokens, segments of 2
    for j in range(4):
        np.testing.assert_allclose(means[1, j, 0], real[2 * j : 2 * j + 2].mean(0), rtol=1e-6)
    assert valid.all()
    _, valid = nystrom_ops.landmarks(x[:, :3], 4, None)  # 3 tokens: 3 landmarks
    assert to_np(valid).tolist() == [[True, True, True, False]] * 2


def test_conv_matrix_equals_the_convolution():
    rng = np.random.default_rng(4)
    v = rng.standard_normal((2, 9, 3, 4)).astype("float32")
    kernel = rng.standard_normal((5, 3)).astype("float32")
    conv = to_np(nystrom_ops.depthwise_sequence_conv(v, kernel))
    band = to_np(nystrom_ops.conv_matrix(kernel, 9))  # (H, n, n)
    np.testing.assert_allclose(conv, np.einsum("hts,bshd->bthd", band, v), rtol=1e-5, atol=1e-5)
    # Position 0, head 0: taps 2..4 on positions 0..2 (zero padding before).
    np.testing.assert_allclose(conv[0, 0, 0], kernel[2:, 0] @ v[0, :3, 0], rtol=1e-5)


# ----------------------------------------------------------- limit case
def _limit_error(n, iterations, mask=None, seed=0):
    keras.utils.set_random_seed(seed)
    x = _x(T=n, seed=seed)
    full = FullAttention(num_heads=2, key_dim=8)
    full(x, x)
    layer = NystromAttention(
        num_heads=2, key_dim=8, num_landmarks=n, pinv_iterations=iterations
    )
    layer(x, x)
    layer.set_weights(full.get_weights())
    kwargs = {} if mask is None else {"query_mask": mask, "value_mask": mask}
    ours = to_np(layer(x, x, **kwargs))
    theirs = to_np(full(x, x, **kwargs))
    keep = np.ones(x.shape[:2], bool) if mask is None else mask
    return rel_error(ours[keep], theirs[keep])


def test_full_attention_limit_needs_the_iterations():
    """num_landmarks = n: exact attention once the pseudo-inverse has
    converged. The paper's 6 iterations do not reach it on a softmax
    matrix this close to uniform; FULL_LIMIT_ITERATIONS do, with padding
    too (fewer real tokens than landmarks: one landmark per real token).
    Seeded weights: the floor of float32 rounding depends on the smallest
    singular values of the softmax matrix."""
    n = 64
    mask = np.ones((2, n), bool)
    mask[0, 40:] = False
    for seed in (0, 1):
        few = _limit_error(n, 6, seed=seed)
        enough = _limit_error(n, FULL_LIMIT_ITERATIONS, seed=seed)
        assert enough <= FULL_LIMIT_TOLERANCE, enough
        assert few > 10 * enough, (few, enough)
        padded = _limit_error(n, FULL_LIMIT_ITERATIONS, mask, seed=seed)
        assert padded <= FULL_LIMIT_TOLERANCE, padded


def test_fewer_landmarks_approximate():
    """With m < n the output is an approximation, not full attention (the
    test of the limit is not vacuous). No closeness is asserted: on random
    weights the softmax matrix is close to uniform and A's small singular
    values make F A^+ B far from it (relative error 0.3 to 0.8 at n = 64,
    m = 32 to 4, see the guide)."""
    keras.utils.set_random_seed(0)
    x = _x(T=64)
    full = FullAttention(num_heads=2, key_dim=8)
    full(x, x)
    layer = NystromAttention(num_heads=2, key_dim=8, num_landmarks=8)
    layer(x, x)
    layer.set_weights(full.get_weights())
    out = to_np(layer(x, x))
    assert np.all(np.isfinite(out))
    assert rel_error(out, to_np(full(x, x))) > 1e-2


# --------------------------------------------------- training, precision
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_training_step(policy):
    x = _x(B=4, T=40)
    mask = np.ones((4, 40), bool)
    mask[1, 30:] = False
    x_in = keras.Input((None, 16))
    m_in = keras.Input((None,), dtype="bool")
    layer = NystromAttention(**KWARGS, conv_kernel_size=3, dtype=policy)
    h = layer(x_in, x_in, query_mask=m_in, value_mask=m_in)
    model = keras.Model([x_in, m_in], keras.layers.Dense(16, dtype=policy)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit([x, mask], np.roll(x, 1, axis=1), epochs=2, batch_size=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


# ------------------------------------------------------------ bad input
def test_causal_is_refused_with_the_reason():
    layer = _built()
    x = _x()
    with pytest.raises(ValueError, match="mean of a whole segment.*use_causal_mask=True"):
        layer(x, x, use_causal_mask=True)


@pytest.mark.parametrize(
    "name, value",
    [("num_landmarks", 0), ("num_landmarks", 2.5), ("pinv_iterations", 0),
     ("pinv_iterations", -1), ("conv_kernel_size", 4), ("conv_kernel_size", 0)],
)
def test_bad_arguments_name_the_argument(name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        NystromAttention(**dict(KWARGS, **{name: value}))


def test_dropout_is_refused():
    with pytest.raises(ValueError, match="dropout=0.1"):
        NystromAttention(**KWARGS, dropout=0.1)


def test_conv_needs_self_attention_lengths():
    layer = _built(conv_kernel_size=3)
    with pytest.raises(ValueError, match="query length 37, key length 20"):
        layer(_x(T=37), _x(T=20))


def test_mha_weights_load_and_conv_is_kept():
    x = _x()
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    mha(x, x)
    layer = NystromAttention.from_multi_head_attention(mha, num_landmarks=8, conv_kernel_size=3)
    assert len(layer.weights) == len(mha.weights) + 1
    assert tuple(layer.weights[-1].shape) == (3, 2)
