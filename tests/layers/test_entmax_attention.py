"""EntmaxAttention: the conformance suite for a fixed and a learned α, and
what is specific to entmax: α = 1 is FullAttention, α = 2 gives the
sparsemax of the scores, weights sum to 1 with exact zeros, a learned α per
head gets its gradient, decoding, grouped heads, bad arguments."""

import keras
import numpy as np
import pytest

from keras_longattn.layers import EntmaxAttention
from keras_longattn.layers import FullAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import input_gradient
from keras_longattn.testing import rel_error
from keras_longattn.testing.properties import AttentionLayerProperties

B, N, DIM, H, D = 2, 13, 16, 2, 8


def _np(x):
    return keras.ops.convert_to_numpy(x)


def _x(seed=0, n=N, batch=B):
    return np.random.default_rng(seed).standard_normal((batch, n, DIM)).astype("float32")


class TestEntmaxAttention15(AttentionLayerConformance):
    layer_cls = EntmaxAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "alpha": 1.5}
    # The only path is the dense one: the reference checks compare it with
    # itself, so long lengths add nothing but time.
    reference_lengths = (5, 37)


class TestEntmaxAttentionLearned(AttentionLayerConformance):
    layer_cls = EntmaxAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "alpha": "learned", "alpha_init": 1.3}
    reference_lengths = (5, 37)


class TestEntmaxAttentionSparsemax(AttentionLayerConformance):
    """α = 2 (sort-based sparsemax); the machinery shared with α = 1.5 runs
    with --run-slow."""

    layer_cls = EntmaxAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "alpha": 2.0}
    reference_lengths = (16,)
    secondary = True


def _projections(layer, x):
    """Scaled scores ``(B, H, T, S)`` of ``layer`` on ``x``, from its
    weights in NumPy (float64)."""
    wq, bq, wk, bk = (np.asarray(w, "float64") for w in layer.get_weights()[:4])
    q = np.einsum("btc,chd->bthd", x, wq) + bq
    k = np.einsum("bsc,chd->bshd", x, wk) + bk
    return np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(layer.key_dim)


def _np_sparsemax(z, visible):
    """Euclidean projection of the visible entries of each row onto the
    simplex (Martins & Astudillo 2016), zeros elsewhere."""
    out = np.zeros_like(z)
    for idx in np.ndindex(z.shape[:-1]):
        row, vis = z[idx], visible[idx]
        if not vis.any():
            continue
        zs = np.sort(row[vis])[::-1]
        k = np.arange(1, zs.size + 1)
        cums = np.cumsum(zs)
        support = k[1 + k * zs > cums].max()
        tau = (cums[support - 1] - 1) / support
        out[idx][vis] = np.maximum(row[vis] - tau, 0.0)
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_alpha_one_equals_full_attention(causal):
    x = _x()
    mask = np.ones((B, N), bool)
    mask[0, -4:] = False
    full = FullAttention(num_heads=H, key_dim=D)
    full(x, x)
    layer = EntmaxAttention(num_heads=H, key_dim=D, alpha=1.0)
    layer(x, x)
    layer.set_weights(full.get_weights())
    for kwargs in ({}, {"value_mask": mask, "query_mask": mask}):
        ours, w_ours = layer(x, x, use_causal_mask=causal, return_attention_scores=True,
                             **kwargs)
        theirs, w_theirs = full(x, x, use_causal_mask=causal, return_attention_scores=True,
                                **kwargs)
        np.testing.assert_allclose(_np(ours), _np(theirs), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(_np(w_ours), _np(w_theirs), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("causal", [True, False])
def test_alpha_two_gives_the_sparsemax_of_the_scores(causal):
    x = _x(1)
    layer = EntmaxAttention(num_heads=H, key_dim=D, alpha=2.0)
    _, weights = layer(x, x, use_causal_mask=causal, return_attention_scores=True)
    scores = _projections(layer, x)
    visible = np.broadcast_to(np.tril(np.ones((N, N), bool)) if causal else True, scores.shape)
    expected = _np_sparsemax(scores, visible)
    np.testing.assert_allclose(_np(weights), expected, atol=2e-6)
    assert np.any(expected == 0.0)


@pytest.mark.parametrize("alpha", [1.25, 1.5, 2.0, "learned"])
def test_weights_sum_to_one_with_exact_zeros(alpha):
    x = _x(2) * 3.0  # spread scores, so that entmax leaves keys out
    mask = np.ones((B, N), bool)
    mask[1, :3] = False
    layer = EntmaxAttention(num_heads=H, key_dim=D, alpha=alpha)
    _, w = layer(x, x, value_mask=mask, use_causal_mask=True, return_attention_scores=True)
    w = _np(w)
    sees = np.tril(np.ones((N, N), bool))[None, None] & mask[:, None, None, :]
    sees = np.broadcast_to(sees, w.shape)
    rows = sees.any(-1)
    assert not rows.all()  # the first queries of example 1 see no key
    np.testing.assert_allclose(w.sum(-1)[rows], 1.0, atol=1e-5)
    np.testing.assert_array_equal(w.sum(-1)[~rows], 0.0)
    assert np.all(w[~sees] == 0.0)
    assert np.all(w >= 0.0)
    # Exact zeros among visible keys: the point of entmax.
    assert ((w == 0.0) & sees).sum() > 0.1 * sees.sum()


def test_softmax_has_no_zeros_among_visible_keys():
    x = _x(2)
    layer = EntmaxAttention(num_heads=H, key_dim=D, alpha=1.0)
    _, w = layer(x, x, return_attention_scores=True)
    assert np.all(_np(w) > 0.0)


def _alpha_logit_loss(layer, x):
    """``f(logits)``: the sum of the layer's output, with the α logits
    given as a tensor (through ``stateless_call``)."""
    trainable = list(layer.trainable_variables)
    position = [v.path for v in trainable].index(layer._alpha_logits.logits.path)
    non_trainable = list(layer.non_trainable_variables)

    def f(logits):
        values = list(trainable)
        values[position] = logits
        out, _ = layer.stateless_call(values, non_trainable, x, x, use_causal_mask=True)
        weights = np.linspace(-1.0, 1.0, np.prod(out.shape)).reshape(out.shape)
        return out * keras.ops.convert_to_tensor(weights.astype("float32"))

    return f


def test_learned_alpha_gets_a_finite_nonzero_gradient():
    x = _x(3)
    layer = EntmaxAttention(num_heads=H, key_dim=D, alpha="learned", alpha_init=1.4)
    layer(x, x)
    np.testing.assert_allclose(_np(layer.alphas()), [1.4, 1.4], rtol=1e-6)
    f = _alpha_logit_loss(layer, x)
    logits = _np(layer._alpha_logits.logits).astype("float32")
    grad = input_gradient(f, logits)
    assert np.all(np.isfinite(grad)) and np.all(grad != 0.0)

    def total(v):
        return float(np.sum(_np(f(keras.ops.convert_to_tensor(v)))))

    step = 1e-2
    fd = np.array([(total(logits + step * e) - total(logits - step * e)) / (2 * step)
                   for e in np.eye(H, dtype="float32")])
    np.testing.assert_allclose(grad, fd, rtol=5e-2, atol=1e-3)


def test_learned_alpha_moves_in_training_and_is_read_per_head():
    x = _x(4, batch=4)
    inp = keras.Input((N, DIM))
    attention = EntmaxAttention(num_heads=H, key_dim=D, alpha="learned")
    model = keras.Model(inp, attention(inp, inp, use_causal_mask=True))
    model.compile(optimizer=keras.optimizers.Adam(5e-2), loss="mse")
    before = _np(attention.alphas())
    model.fit(x, np.roll(x, 1, axis=1), epochs=3, batch_size=2, verbose=0)
    after = _np(attention.alphas())
    assert after.shape == (H,)
    assert np.all((after > 1.0) & (after <= 2.0))
    assert not np.allclose(before, after)


def test_multi_head_attention_weights_keep_the_learned_alpha():
    x = _x(5)
    mha = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D)
    mha(x, x)
    layer = EntmaxAttention.from_multi_head_attention(mha, alpha="learned", alpha_init=1.7)
    np.testing.assert_allclose(_np(layer.alphas()), [1.7, 1.7], rtol=1e-6)
    for ours, theirs in zip(layer.get_weights(), mha.get_weights()):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("alpha", [1.5, "learned"])
def test_decoding_gives_the_full_forward_pass(alpha):
    keras.utils.set_random_seed(0)
    layer = EntmaxAttention(num_heads=H, key_dim=D, alpha=alpha)
    x = _x(6)
    expected = _np(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(B, N)
    outs, index = [], 0
    for size in (5, 1, 1, 3, 3):
        part = x[:, index:index + size]
        out, cache = layer(part, part, use_causal_mask=True, cache=cache,
                           cache_update_index=index)
        assert layer.last_implementation == "decode"
        outs.append(_np(out))
        index += size
    np.testing.assert_allclose(np.concatenate(outs, axis=1), expected, atol=2e-5)


def test_grouped_heads_equal_repeated_heads():
    x = _x(7)
    grouped = EntmaxAttention(num_heads=4, key_dim=D, alpha=1.5, num_key_value_heads=2)
    grouped(x, x)
    twin = EntmaxAttention(num_heads=4, key_dim=D, alpha=1.5)
    twin(x, x)
    weights = []
    for v, w in zip(grouped.weights, grouped.get_weights()):
        if "/key/" in v.path or "/value/" in v.path:
            w = np.repeat(w, 2, axis=-2)
        weights.append(w)
    twin.set_weights(weights)
    assert rel_error(_np(grouped(x, x, use_causal_mask=True)),
                     _np(twin(x, x, use_causal_mask=True))) < 1e-6


@pytest.mark.parametrize("alpha", [0.5, 2.5, -1, float("nan"), "sparse", True, None])
def test_bad_alpha_is_refused(alpha):
    with pytest.raises(ValueError, match=f"alpha={alpha!r}"):
        EntmaxAttention(num_heads=H, key_dim=D, alpha=alpha)


@pytest.mark.parametrize("alpha_init", [1.0, 2.0, 0.3, "1.5"])
def test_bad_alpha_init_is_refused(alpha_init):
    with pytest.raises(ValueError, match=f"alpha_init={alpha_init!r}"):
        EntmaxAttention(num_heads=H, key_dim=D, alpha="learned", alpha_init=alpha_init)


def test_bad_n_iter_is_refused():
    with pytest.raises(ValueError, match="n_iter=0"):
        EntmaxAttention(num_heads=H, key_dim=D, alpha=1.3, n_iter=0)


def test_alphas_of_an_unbuilt_learned_layer_are_refused():
    with pytest.raises(ValueError, match="built"):
        EntmaxAttention(num_heads=H, key_dim=D, alpha="learned").alphas()
    fixed = EntmaxAttention(num_heads=H, key_dim=D, alpha=1.25)
    np.testing.assert_array_equal(_np(fixed.alphas()), [1.25, 1.25])


class TestEntmaxAttentionProperties(AttentionLayerProperties):
    """The property checks of the contract for a learned α (random
    lengths, padding, dtypes, batch composition, non-finite padding)."""

    layer_cls = EntmaxAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "alpha": "learned", "alpha_init": 1.4}
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding",
                     "test_prop_batch_composition", "test_prop_dynamic_length")
    invalid_arguments = {"alpha": (0.5, 2.5, "sparse"), "alpha_init": (1.0, 2.0),
                         "n_iter": (0, 1.5)}
