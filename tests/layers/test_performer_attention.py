"""PerformerAttention: the conformance suite, an independent NumPy form of
FAVOR+, orthogonal random features, the full-attention limit over seeds
(with a planted broken estimator that fails it), the causal stabiliser,
the redraw policy through training and .keras files, seeding, bad input."""

import os

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import FullAttention
from keras_longattn.layers import PerformerAttention
from keras_longattn.ops import kernelized
from keras_longattn.ops import performer as performer_ops
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error

BACKEND = keras.backend.backend()
KWARGS = {"num_heads": 2, "key_dim": 8, "num_features": 32, "chunk_size": 6, "seed": 3}


@pytest.fixture(autouse=True)
def _seeded():
    keras.utils.set_random_seed(0)


# ---------------------------------------------------------- conformance
#: Input scale of the full-attention limit: projected entries of about 0.3
#: (see PerformerAttention.full_attention_limit).
LIMIT_SCALE = 0.35


class TestPerformerFavor(AttentionLayerConformance):
    """32 features (4 orthogonal blocks of 8), chunks of 6."""

    layer_cls = PerformerAttention
    init_kwargs = KWARGS
    implementation = "favor"
    reference_lengths = (5, 16, 37, 2048)

    def make_limit_inputs(self, length):
        return LIMIT_SCALE * self.make_inputs(length)

    def test_equals_full_attention_in_its_limit(self):
        """As the suite's check, on inputs of the limit's regime (scaled by
        LIMIT_SCALE: the estimator's variance grows as exp(|q + k|^2 /
        sqrt(d)), see PerformerAttention.full_attention_limit)."""
        n = self.short_length
        layer = self.make_layer()
        overrides, tolerance = layer.full_attention_limit(n)
        config = dict(layer.get_config(), **overrides)
        limited = PerformerAttention.from_config(config)
        x = self.make_limit_inputs(n)
        full = FullAttention(num_heads=2, key_dim=8)
        full(x, x)
        limited(x, x)
        limited.set_weights(full.get_weights())
        for causal in (True, False):
            ours = to_np(limited(x, x, use_causal_mask=causal))
            theirs = to_np(full(x, x, use_causal_mask=causal))
            err = rel_error(ours, theirs)
            assert err <= tolerance, f"causal={causal}: {err:.3g} > {tolerance}"


class TestPerformerRedrawn(TestPerformerFavor):
    """Redrawn every training step, 20 features (a partial last block)."""

    layer_cls = PerformerAttention
    init_kwargs = dict(KWARGS, num_features=20, feature_redraw_interval=1)
    implementation = "favor"
    secondary = True
    reference_lengths = (37,)


# ------------------------------------------------------------- helpers
def _x(B=2, T=37, F=16, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal((B, T, F))).astype("float32")


def numpy_performer(layer, query, value, causal=False, value_mask=None):
    """FAVOR+ in NumPy (float64) from the layer's projection, without any
    stabiliser (the shifts cancel in exact arithmetic), one example, head
    and query at a time."""
    W = to_np(layer.random_features.features).astype("float64")
    q = to_np(layer._query_dense(query)).astype("float64")
    k = to_np(layer._key_dense(value)).astype("float64")
    v = to_np(layer._value_dense(value)).astype("float64")
    B, T, H, d = q.shape
    S = k.shape[1]
    keep = np.ones((B, S), bool) if value_mask is None else np.asarray(value_mask, bool)

    def phi(x):
        x = x * d ** -0.25
        return np.exp(x @ W.T - 0.5 * np.sum(x * x, -1, keepdims=True)) / np.sqrt(len(W))

    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            fq, fk = phi(q[b, :, h]), phi(k[b, :, h])
            for i in range(T):
                seen = keep[b].copy()
                if causal:
                    seen[i + 1:] = False
                w = fk[seen] @ fq[i]
                out[b, i, h] = w @ v[b, seen, h] / max(w.sum(), 1e-300)
    kernel, bias = (to_np(w).astype("float64") for w in layer._output_dense.weights)
    return np.einsum("bthd,hdo->bto", out, kernel) + bias


# ----------------------------------------------------------- definition
@pytest.mark.parametrize("causal", [True, False])
def test_paths_equal_numpy_favor(causal):
    """Both paths equal FAVOR+ written out in NumPy, with padding and
    cross-attention (T < S and T > S)."""
    x = _x()
    mask = np.ones((2, 37), bool)
    mask[0, 30:] = False
    mask[1, :5] = False
    for T in (37, 23, 45):
        q = _x(T=T, seed=T)
        for impl in ("favor", "reference"):
            layer = PerformerAttention(**dict(KWARGS, implementation=impl))
            out = to_np(layer(q, x, value_mask=mask, use_causal_mask=causal))
            assert layer.last_implementation == impl
            expected = numpy_performer(layer, q, x, causal=causal, value_mask=mask)
            real = np.ones(out.shape[:2], bool)
            if causal:
                # Example 1's first real key is at 5: earlier queries see none.
                real[1, :5] = False
            assert rel_error(out[real], expected[real]) < 1e-4, (impl, T)


def test_orthogonal_random_features():
    """Rows of a block of d are exactly orthogonal; norms follow the chi
    distribution of a Gaussian vector (mean about sqrt(d)); the NumPy draw
    of build and the keras.random redraws have the same structure."""
    m, d = 40, 8
    draws = [performer_ops.orthogonal_gaussian_numpy(m, d, seed=1),
             to_np(performer_ops.orthogonal_gaussian(m, d, seed=1))]
    for W in draws:
        assert W.shape == (m, d)
        norms = np.linalg.norm(W, axis=1)
        for start in range(0, m, d):
            block = W[start:start + d] / norms[start:start + d, None]
            gram = block @ block.T
            np.testing.assert_allclose(gram, np.eye(len(block)), atol=1e-5)
    big = performer_ops.orthogonal_gaussian_numpy(4096, 8, seed=2)
    norms = np.linalg.norm(big, axis=1)
    assert abs(norms.mean() - 2.7383) < 0.05  # E[chi_8] = 2.7383
    # Directions uniform on the sphere: mean direction near 0.
    assert np.abs((big / norms[:, None]).mean(0)).max() < 0.05


# ----------------------------------------------------------------- limit
def _limit_errors(num_features, seeds, planted=False):
    x = LIMIT_SCALE * _x(T=37)
    errors = []
    for seed in seeds:
        keras.utils.set_random_seed(seed)
        full = FullAttention(num_heads=2, key_dim=8)
        full(x, x)
        layer = PerformerAttention(num_heads=2, key_dim=8, num_features=num_features,
                                   seed=seed)
        layer(x, x)
        layer.set_weights(full.get_weights())
        if planted:  # a broken estimator: rows not rescaled to Gaussian norms
            W = to_np(layer.random_features.features)
            layer.random_features.features.assign(
                W / np.linalg.norm(W, axis=1, keepdims=True))
        for causal in (True, False):
            ours = to_np(layer(x, x, use_causal_mask=causal))
            theirs = to_np(full(x, x, use_causal_mask=causal))
            errors.append(rel_error(ours, theirs))
    return np.array(errors)


def test_many_features_approach_softmax_attention():
    """Over 4 seeds (weights and features) and both modes, 16384 features
    are within the declared tolerance of FullAttention on the same weights
    (inputs of the limit's regime); the error falls about as 1 / sqrt(m)
    (64 -> 4096 features: more than 3x smaller, 8x predicted); a planted
    estimator with unit-length rows (biased) and LinearAttention (another
    kernel) on the same weights fail the tolerance."""
    overrides, tol = PerformerAttention(**KWARGS).full_attention_limit(37)
    seeds = (0, 1, 2, 3)
    many = _limit_errors(overrides["num_features"], seeds)
    assert many.max() <= tol, many
    few = _limit_errors(64, seeds)
    mid = _limit_errors(4096, seeds)
    assert mid.mean() * 3 < few.mean(), (few.mean(), mid.mean())
    planted = _limit_errors(overrides["num_features"], seeds, planted=True)
    assert planted.min() > tol, planted
    from keras_longattn.layers import LinearAttention

    x = LIMIT_SCALE * _x(T=37)
    full = FullAttention(num_heads=2, key_dim=8)
    full(x, x)
    linear = LinearAttention(num_heads=2, key_dim=8)
    linear(x, x)
    linear.set_weights(full.get_weights())
    for causal in (True, False):
        err = rel_error(to_np(linear(x, x, use_causal_mask=causal)),
                        to_np(full(x, x, use_causal_mask=causal)))
        assert err > tol, (causal, err)


# ------------------------------------------------------------ stabiliser
def test_causal_features_do_not_depend_on_later_keys():
    """In a causal call a key's features depend on that key alone: a last
    key aligned with the longest random row (the largest possible
    exponent, |w|^2 / 2) leaves every earlier output bit for bit
    unchanged. The authors' stabiliser (the maximum over all keys) does
    not: the late key rescales every earlier key by about exp(-40), their
    normalisers fall below epsilon and the earlier outputs change."""
    d, m, n = 64, 256, 40
    W = performer_ops.orthogonal_gaussian_numpy(m, d, seed=0)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, n, 1, d)).astype("float32")
    k = rng.standard_normal((1, n, 1, d)).astype("float32")
    v = rng.standard_normal((1, n, 1, 4)).astype("float32")
    big = int(np.argmax(np.linalg.norm(W, axis=1)))
    k2 = k.copy()
    k2[0, -1, 0] = W[big] * d ** 0.25  # x' = w: the exponent's bound

    def run(keys, causal):
        qf = performer_ops.softmax_kernel_features(q, W, is_query=True, causal=causal)
        kf = performer_ops.softmax_kernel_features(keys, W, is_query=False,
                                                   causal=causal)
        return to_np(kernelized.causal_kernel_attention(qf, kf, v, chunk_size=8))

    ours, ours2 = run(k, True), run(k2, True)
    np.testing.assert_array_equal(ours2[:, :-1], ours[:, :-1])
    assert np.all(np.isfinite(ours2))
    leaky = rel_error(run(k2, False)[:, :-1], run(k, False)[:, :-1])
    assert leaky > 1e-3, leaky


# ---------------------------------------------------------------- redraw
def _train_calls(layer, x, count):
    for _ in range(count):
        layer(x, x, training=True)


def test_redraw_policy():
    """interval 3: training calls 0-2 use draw 0 (build's), 3-5 draw 1,
    6-8 draw 2; the step counts training calls; inference changes
    nothing; a fixed layer never redraws."""
    x = _x(T=12)
    layer = PerformerAttention(**dict(KWARGS, feature_redraw_interval=3))
    layer(x, x)
    state = layer.random_features
    draw0 = to_np(state.features).copy()
    np.testing.assert_array_equal(draw0, to_np(state.draw(0)))
    layer(x, x, training=False)
    layer(x, x)
    assert int(to_np(state.step)) == 0
    _train_calls(layer, x, 3)
    np.testing.assert_array_equal(to_np(state.features), draw0)
    _train_calls(layer, x, 1)  # call 3: draw 1
    draw1 = to_np(state.features).copy()
    assert not np.allclose(draw1, draw0)
    np.testing.assert_allclose(draw1, to_np(state.draw(1)), rtol=1e-6)
    _train_calls(layer, x, 2)
    np.testing.assert_array_equal(to_np(state.features), draw1)
    _train_calls(layer, x, 1)  # call 6: draw 2
    assert int(to_np(state.step)) == 7
    np.testing.assert_allclose(to_np(state.features), to_np(state.draw(2)), rtol=1e-6)
    assert not np.allclose(to_np(state.features), draw1)
    fixed = PerformerAttention(**KWARGS)
    fixed(x, x)
    before = to_np(fixed.random_features.features).copy()
    _train_calls(fixed, x, 4)
    np.testing.assert_array_equal(to_np(fixed.random_features.features), before)


def test_redraw_state_survives_a_keras_file(tmp_path):
    """The projection and the step count are saved: a model saved after 4
    training calls (interval 3) and loaded gives the same outputs, and its
    next redraws are those of the model that was not saved."""
    x = _x(T=12)
    inp = keras.Input((12, 16))
    layer = PerformerAttention(**dict(KWARGS, feature_redraw_interval=3))
    model = keras.Model(inp, layer(inp, inp))
    for _ in range(4):
        model(x, training=True)
    path = os.path.join(str(tmp_path), "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    other = [l for l in loaded.layers if isinstance(l, PerformerAttention)][0]
    assert int(to_np(other.random_features.step)) == 4
    np.testing.assert_array_equal(to_np(other.random_features.features),
                                  to_np(layer.random_features.features))
    np.testing.assert_allclose(to_np(loaded(x)), to_np(model(x)), rtol=1e-6, atol=1e-6)
    for _ in range(3):
        model(x, training=True)
        loaded(x, training=True)
    assert int(to_np(other.random_features.step)) == 7
    np.testing.assert_allclose(to_np(other.random_features.features),
                               to_np(layer.random_features.features), rtol=1e-6)
    assert not np.allclose(to_np(other.random_features.features),
                           to_np(layer.random_features.draw(1)))


def _draw_compiled(state, index):
    """Draw ``index`` as a compiled training step makes it: TensorFlow's
    stateless random ops give other numbers under XLA than eagerly (both
    valid draws, each reproducible), so there it is drawn under XLA too."""
    if BACKEND != "tensorflow":
        return to_np(state.draw(index))
    import tensorflow as tf

    return tf.function(lambda: state.draw(index), jit_compile=True)().numpy()


def test_redraw_inside_compiled_fit():
    """In model.fit (compiled on JAX and TensorFlow) every step is a
    training call: 5 steps with interval 2 count 5 and leave draw 2 (of
    step 4) in place, and the loss stays finite."""
    x = _x(B=10, T=12)
    inp = keras.Input((12, 16))
    layer = PerformerAttention(**dict(KWARGS, feature_redraw_interval=2))
    model = keras.Model(inp, layer(inp, inp, use_causal_mask=True))
    model.compile(optimizer="adam", loss="mse", jit_compile=BACKEND != "torch")
    history = model.fit(x, np.roll(x, 1, axis=1), batch_size=2, epochs=1, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    state = layer.random_features
    assert int(to_np(state.step)) == 5
    np.testing.assert_allclose(to_np(state.features), _draw_compiled(state, 2),
                               rtol=1e-5, atol=1e-6)


def test_seeded():
    """One seed: the same projection (on every backend: draw 0 is NumPy's)
    and the same output for the same weights; another seed: another."""
    x = _x()
    a = PerformerAttention(**KWARGS)
    a(x, x)
    b = PerformerAttention(**KWARGS)
    b(x, x)
    np.testing.assert_array_equal(to_np(a.random_features.features),
                                  to_np(b.random_features.features))
    np.testing.assert_array_equal(to_np(a.random_features.features),
                                  performer_ops.orthogonal_gaussian_numpy(32, 8, 3))
    c = PerformerAttention(**dict(KWARGS, seed=4))
    c(x, x)
    assert not np.allclose(to_np(c.random_features.features),
                           to_np(a.random_features.features))
    unseeded = PerformerAttention(num_heads=2, key_dim=8)
    assert isinstance(unseeded.get_config()["seed"], int)


# ------------------------------------------------------------- precision
@pytest.mark.parametrize("causal", [True, False])
def test_long_input_in_float16(causal):
    """n = 4096 under mixed_float16 (features and sums in float32): close to
    float32 on the same weights for activations of unit size, finite for
    activations of about 100 (there the exponents are in the hundreds and
    float16 rounding of the projections moves them by units, as it would
    move softmax logits: no closeness to float32 is claimed)."""
    n = 4096
    full = PerformerAttention(num_heads=2, key_dim=8, num_features=32, seed=1)
    low = PerformerAttention(num_heads=2, key_dim=8, num_features=32, seed=1,
                             dtype="mixed_float16")
    for scale in (1.0, 30.0):
        x = _x(B=1, T=n, scale=scale)
        expected = to_np(full(x, x, use_causal_mask=causal))
        if not low.built:
            low.build(x.shape, x.shape)
            low.set_weights(full.get_weights())
        y = to_np(keras.ops.cast(low(x, x, use_causal_mask=causal), "float32"))
        assert np.all(np.isfinite(y)), scale
        if scale == 1.0:
            assert rel_error(y, expected) < 2e-2


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_features": 0}, r"Received: num_features=0"),
        ({"num_features": -3}, r"Received: num_features=-3"),
        ({"num_features": 2.5}, r"Received: num_features=2.5"),
        ({"chunk_size": 0}, r"Received: chunk_size=0"),
        ({"feature_redraw_interval": 0}, r"Received: feature_redraw_interval=0"),
        ({"epsilon": -1.0}, r"Received: epsilon=-1.0"),
        ({"dropout": 0.2}, r"Received: dropout=0.2"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PerformerAttention(**dict(KWARGS, **kwargs))


def test_multi_head_attention_weights_and_config():
    x = _x()
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    mha(x, x)
    ours = PerformerAttention.from_multi_head_attention(mha, num_features=16, seed=0)
    for a, b in zip(ours.get_weights(), mha.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert len(ours.get_weights()) == len(mha.get_weights()) + 2
    config = PerformerAttention(num_heads=2, key_dim=8, seed=1).get_config()
    assert (config["num_features"], config["feature_redraw_interval"],
            config["chunk_size"]) == (256, None, 64)
    assert PerformerAttention.from_config(config).get_config() == config
