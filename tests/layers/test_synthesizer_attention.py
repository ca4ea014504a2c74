"""SynthesizerAttention: the conformance suite, a NumPy loop of every
kind and of a mixture, the learned mixture weights, fixed random tables,
shorter and longer inputs, the vanilla limit and bad input."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import FullAttention
from keras_longattn.layers import SynthesizerAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error

KWARGS = {"num_heads": 2, "key_dim": 8, "max_length": 64}
SINGLE_KINDS = ("dense", "random", "fixed_random", "factorized_dense",
                "factorized_random")


# ---------------------------------------------------------- conformance
class TestSynthesizerMixture(AttentionLayerConformance):
    """Dense, random and dot-product logits mixed by learned weights."""

    layer_cls = SynthesizerAttention
    init_kwargs = dict(KWARGS, kind="dense+random+vanilla")
    implementation = "synthetic"
    reference_lengths = (16, 37)


class TestSynthesizerFactorized(AttentionLayerConformance):
    """The factorized kinds and a fixed random table (factors (8, 8))."""

    layer_cls = SynthesizerAttention
    init_kwargs = dict(KWARGS, kind="factorized_dense+factorized_random+fixed_random",
                       rank=3)
    implementation = "synthetic"
    secondary = True
    reference_lengths = (37,)


# ------------------------------------------------------------- helpers
def _x(B=2, T=37, F=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, F)).astype("float32")


def _var(layer, name):
    return to_np(getattr(layer._synthesizer, name)).astype("float64")


def numpy_synthesizer(layer, query, value, value_mask=None, causal=False):
    """The layer in NumPy (float64), one example, head and query at a time,
    from the paper's definitions of each component."""
    q = to_np(layer._query_dense(query)).astype("float64")
    k = to_np(layer._key_dense(value)).astype("float64")
    v = to_np(layer._value_dense(value)).astype("float64")
    B, T, H, d = q.shape
    S = k.shape[1]
    keep = np.ones((B, S), bool) if value_mask is None else np.asarray(value_mask, bool)
    comps = layer.components
    if len(comps) > 1:
        m = _var(layer, "mixture_logits")
        mix = np.exp(m - m.max()) / np.exp(m - m.max()).sum()
    else:
        mix = np.ones(1)
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                row = np.zeros(S)
                relu = np.maximum(q[b, t, h], 0.0)
                for c, w in zip(comps, mix):
                    if c == "vanilla":
                        logits = k[b, :, h] @ q[b, t, h] / np.sqrt(d)
                    elif c == "dense":
                        full = relu @ _var(layer, "dense_kernel")[h] + _var(layer, "dense_bias")[h]
                        logits = full[:S]
                    elif c == "factorized_dense":
                        a_, b_ = layer.factors
                        A = relu @ _var(layer, "factor_a_kernel")[h] + _var(layer, "factor_a_bias")[h]
                        Bf = relu @ _var(layer, "factor_b_kernel")[h] + _var(layer, "factor_b_bias")[h]
                        logits = np.array([A[s % a_] * Bf[s // a_] for s in range(S)])
                    elif c == "random":
                        logits = _var(layer, "random_logits")[h, t, :S]
                    elif c == "fixed_random":
                        logits = _var(layer, "fixed_random_logits")[h, t, :S]
                    else:
                        R = _var(layer, "random_left")[h] @ _var(layer, "random_right")[h].T
                        logits = R[t, :S]
                    row += w * logits
                visible = keep[b] & ((np.arange(S) <= t) if causal else True)
                if not visible.any():
                    continue
                p = np.where(visible, np.exp(row - row[visible].max()), 0.0)
                out[b, t, h] = (p / p.sum()) @ v[b, :, h]
    kernel, bias = (to_np(w).astype("float64") for w in layer._output_dense.weights)
    return np.einsum("bthd,hdo->bto", out, kernel) + bias


def _randomize_mixture(layer):
    if len(layer.components) > 1:
        m = layer._synthesizer.mixture_logits
        m.assign(np.linspace(-1.0, 1.0, m.shape[0]).astype("float32"))


# ----------------------------------------------------------- definition
@pytest.mark.parametrize(
    "kind",
    # The mixture covers dense, random and vanilla on every backend; the
    # single kinds (the same keras.ops code; the factorized ones also run
    # the conformance suite) are grid points: torch only in CI.
    ["dense+random+vanilla"] + [pytest.param(k, marks=pytest.mark.grid) for k in SINGLE_KINDS],
)
def test_equals_numpy_loop(kind):
    """Each kind (and a mixture with unequal weights) is the paper's
    definition, causal and with padding, on inputs shorter than max_length
    (the leading rows and columns of the tables)."""
    x = _x()
    mask = np.ones((2, 37), bool)
    mask[1, :9] = False  # left padding: early causal rows see no key
    layer = SynthesizerAttention(**dict(KWARGS, kind=kind, rank=3))
    layer(x, x)
    _randomize_mixture(layer)
    for causal in (False, True):
        out = to_np(layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal))
        expected = numpy_synthesizer(layer, x, x, value_mask=mask, causal=causal)
        assert rel_error(out[mask], expected[mask]) < 1e-5, (kind, causal)


@pytest.mark.grid  # keras.ops code, the same on every backend: torch only in CI
def test_factorized_dense_tiles_a_and_b():
    """Position s takes A[s mod a] * B[s // a]; the default factors are
    (ceil(sqrt(l)), ceil(l / ceil(sqrt(l))))."""
    assert SynthesizerAttention(**KWARGS).factors == (8, 8)
    assert SynthesizerAttention(**dict(KWARGS, max_length=50)).factors == (8, 7)
    layer = SynthesizerAttention(**dict(KWARGS, kind="factorized_dense", factors=(3, 5),
                                        max_length=15))
    x = _x(T=15)
    layer(x, x)
    syn = layer._synthesizer
    syn.factor_a_kernel.assign(np.zeros(syn.factor_a_kernel.shape, "float32"))
    syn.factor_b_kernel.assign(np.zeros(syn.factor_b_kernel.shape, "float32"))
    syn.factor_a_bias.assign(np.tile([1.0, 2.0, 3.0], (2, 1)).astype("float32"))
    syn.factor_b_bias.assign(np.tile([1.0, 10.0, 100.0, 1e3, 1e4], (2, 1)).astype("float32"))
    q = layer._query_dense(x)
    logits = to_np(layer.synthetic_logits(q, layer._key_dense(x), "float32"))
    expected = np.outer([1.0, 10.0, 100.0, 1e3, 1e4], [1.0, 2.0, 3.0]).reshape(-1)
    np.testing.assert_allclose(logits[0, 1, 4], expected)


# --------------------------------------------------------------- mixture
def test_mixture_weights_are_learned():
    """The mixture weights are a softmax over one learned scalar per
    component (equal at first), and a training step moves them."""
    layer = SynthesizerAttention(**dict(KWARGS, kind="random+vanilla"))
    x = _x()
    inp = keras.Input((37, 16))
    model = keras.Model(inp, layer(inp, inp))
    np.testing.assert_allclose(to_np(layer.mixture_weights()), [0.5, 0.5])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    model.fit(x, np.roll(x, 1, axis=1), epochs=1, batch_size=2, verbose=0)
    w = to_np(layer.mixture_weights())
    assert abs(w.sum() - 1.0) < 1e-6 and abs(w[0] - 0.5) > 1e-6
    names = [v.path.split("/", 1)[1] for v in layer.trainable_weights]
    assert "synthesizer/mixture_logits" in names
    single = SynthesizerAttention(**dict(KWARGS, kind="random"))
    single(x, x)
    assert not any("mixture" in v.path for v in single.weights)
    np.testing.assert_array_equal(to_np(single.mixture_weights()), [1.0])


def test_fixed_random_is_not_trained():
    layer = SynthesizerAttention(**dict(KWARGS, kind="fixed_random"))
    x = _x()
    layer(x, x)
    assert [v.path.split("/", 1)[1] for v in layer.non_trainable_weights] == [
        "synthesizer/fixed_random_logits"
    ]
    assert len(layer.trainable_weights) == 8
    trainable = SynthesizerAttention(**dict(KWARGS, kind="random"))
    trainable(x, x)
    assert len(trainable.trainable_weights) == 9


# ------------------------------------------------------- limits, errors
def test_vanilla_equals_full_attention_at_any_length():
    """kind="vanilla" is multi-head attention on the same weights, with
    padding, longer than max_length (it uses no table); bidirectional on
    torch only in CI (the conformance suite checks both modes at n=37)."""
    x = _x(T=65)
    mask = np.ones((2, 65), bool)
    mask[0, 50:] = False
    full = FullAttention(num_heads=2, key_dim=8)
    full(x, x)
    overrides, tol = SynthesizerAttention(**KWARGS).full_attention_limit(65)
    layer = SynthesizerAttention(**dict(KWARGS, **overrides))
    layer(x, x)
    layer.set_weights(full.get_weights())
    modes = (True, False) if keras.backend.backend() == "torch" else (True,)
    for causal in modes:
        ours = to_np(layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal))
        theirs = to_np(full(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal))
        assert rel_error(ours[mask], theirs[mask]) <= tol


def test_longer_sequences_are_refused():
    x = _x(T=65)
    with pytest.raises(ValueError, match=r"query sequence has 65 .*query length 65 > "
                                         r"max_length=64"):
        SynthesizerAttention(**dict(KWARGS, kind="random+vanilla"))(x, x)
    dense = SynthesizerAttention(**dict(KWARGS, kind="dense"))
    with pytest.raises(ValueError, match=r"key length 65 > max_length=64"):
        dense(x, x)
    # Dense logits read the key length only: longer queries are fine.
    assert tuple(dense(x, x[:, :64]).shape) == (2, 65, 16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kind": ""}, r"empty component.*Received: kind=''"),
        ({"kind": "+random"}, r"empty component.*Received: kind='\+random'"),
        ({"kind": "random+"}, r"Received: kind='random\+'"),
        ({"kind": "random+convolution"}, r"'convolution'.*Received: kind='random\+convolution'"),
        ({"kind": "random+random"}, r"twice.*Received: kind='random\+random'"),
        ({"kind": None}, r"Received: kind=None"),
        ({"max_length": 0}, r"Received: max_length=0"),
        ({"rank": 0}, r"Received: rank=0"),
        ({"factors": (4, 4)}, r"max_length=64\)\. Received: factors=\(4, 4\)"),
        ({"factors": 8}, r"Received: factors=8"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SynthesizerAttention(**dict(KWARGS, **kwargs))


def test_defaults_and_config():
    layer = SynthesizerAttention(num_heads=2, key_dim=8)
    config = layer.get_config()
    for key, value in (("kind", "dense"), ("max_length", 512), ("rank", 8),
                       ("factors", (23, 23))):
        assert config[key] == value
    assert config["random_initializer"]["config"]["stddev"] == 1.0
    assert SynthesizerAttention.from_config(config).get_config() == config


@pytest.mark.parametrize("kind", ["random", "fixed_random", "factorized_random"])
def test_scores_have_one_row_per_example(kind):
    """Kinds whose weights do not depend on the input still return
    (B, H, T, S) scores, as MultiHeadAttention does."""
    layer = SynthesizerAttention(num_heads=2, key_dim=4, max_length=16, kind=kind)
    x = np.random.default_rng(0).standard_normal((3, 10, 8)).astype("float32")
    out, scores = layer(x, x, return_attention_scores=True)
    assert tuple(scores.shape) == (3, 2, 10, 10)
    assert tuple(out.shape) == (3, 10, 8)
