"""The entmax notebook's task builders, models and probes
(``keras_longattn.reproductions.entmax``), on tiny sizes."""

import keras
import numpy as np
import pytest

from keras_longattn.layers import EntmaxAttention
from keras_longattn.reproductions import entmax as em

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

TINY = em.RecallConfig(pairs=4, num_keys=6, num_values=3, layers=2, dim=8, num_heads=2,
                       batch_size=4, steps=2, test_sequences=8, learning_rate=1e-2)


def test_recall_sequences_hold_the_answer():
    (keys, values), labels = em.make_recall(50, 5, 9, 4, seed=3)
    assert keys.shape == values.shape == (50, 6) and labels.shape == (50,)
    assert keys.dtype == values.dtype == labels.dtype == np.int32
    for k, v, y in zip(keys, values, labels):
        assert len(set(k[:-1].tolist())) == 5  # distinct stored keys
        assert v[-1] == 4  # the query's value is "unknown"
        (where,) = np.nonzero(k[:-1] == k[-1])
        assert len(where) == 1 and v[where[0]] == y
    again = em.make_recall(50, 5, 9, 4, seed=3)
    np.testing.assert_array_equal(again[0][0], keys)


def test_recall_refuses_bad_sizes():
    with pytest.raises(ValueError, match="pairs"):
        em.make_recall(4, 10, 9, 4)
    with pytest.raises(ValueError, match="num_values"):
        em.make_recall(4, 2, 9, 1)
    with pytest.raises(ValueError, match="dim"):
        em.RecallConfig(dim=30, num_heads=4)
    with pytest.raises(ValueError, match="steps"):
        em.RecallConfig(steps=0)
    assert TINY.length == 5 and TINY.chance == pytest.approx(1 / 3)


def test_arms_and_variants_build_the_right_layers():
    softmax = em.arm_attention("softmax", 2, 4)
    assert type(softmax) is EntmaxAttention and softmax.alpha == 1.0
    assert em.arm_attention("entmax15", 2, 4).alpha == 1.5
    assert em.arm_attention("learned", 2, 4).learns_alpha
    assert isinstance(em.arm_attention("learned", 2, 4, "alpha_stuck_at_1"), em.AlphaStuckAtOne)
    # A variant replaces only the arms it names.
    assert type(em.arm_attention("entmax15", 2, 4, "alpha_stuck_at_1")) is EntmaxAttention
    assert isinstance(em.arm_attention("entmax15", 2, 4, "entmax_scores_frozen"),
                      em.FrozenScoresEntmax)
    assert type(em.arm_attention("softmax", 2, 4, "entmax_scores_frozen")) is EntmaxAttention
    assert em.arm_attention("softmax", 2, 4, "softmax_control_sparse").alpha == 1.5
    assert isinstance(em.arm_attention("softmax", 2, 4, "mask_ignored"), em.MaskIgnoringEntmax)
    with pytest.raises(ValueError, match="arm"):
        em.arm_attention("sparsemax", 2, 4)
    with pytest.raises(ValueError, match="variant"):
        em.arm_attention("softmax", 2, 4, "nonsense")
    assert set(em.VARIANT_ARMS) == {v.name for v in em.PLANTED.variants}


def _model(arm, variant=None, seed=0):
    keras.utils.set_random_seed(seed)
    return em.build_recall_model(
        lambda name: em.arm_attention(arm, TINY.num_heads, TINY.dim // TINY.num_heads,
                                      variant, name=name), TINY)


def test_weights_zero_shares_and_alphas_of_a_model():
    (keys, values), _ = TINY.test_set()
    model = _model("softmax")
    assert [layer.name for layer in em.attention_layers(model)] == ["attention_0",
                                                                    "attention_1"]
    weights = em.attention_weights(model, [keys, values], batch_size=3)
    assert len(weights) == 2 and weights[0].shape == (8, 2, 5, 5)
    np.testing.assert_allclose(weights[1].sum(-1), 1.0, atol=1e-5)
    assert em.zero_shares(weights).shape == (2, 2)
    assert np.all(em.zero_shares(weights) == 0.0)
    np.testing.assert_allclose(em.layer_alphas(model), 1.0)
    learned = _model("learned")
    np.testing.assert_allclose(em.layer_alphas(learned), 1.5, atol=1e-6)
    # Sparsemax-like weights on sharp scores: zeros are counted per head.
    sharp = [np.array([[[[0.0, 1.0], [0.5, 0.5]], [[1.0, 0.0], [1.0, 0.0]]]], "float32")]
    np.testing.assert_allclose(em.zero_shares(sharp), [[0.25, 0.5]])


def test_alpha_stuck_at_one_is_softmax_with_alpha_one():
    x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype("float32")
    stuck = em.AlphaStuckAtOne(num_heads=2, key_dim=4, alpha="learned")
    softmax = EntmaxAttention(num_heads=2, key_dim=4, alpha=1.0)
    stuck(x, x)
    softmax(x, x)
    softmax.set_weights(stuck.get_weights()[:-1])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(stuck.alphas()), [1.0, 1.0])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(stuck(x, x)),
                               keras.ops.convert_to_numpy(softmax(x, x)), atol=1e-5)


def test_mask_probe_passes_the_real_layers_and_catches_the_leak():
    for arm in em.ARMS:
        probe = em.mask_probe(arm, length=6, dim=8)
        assert probe["masked_weight"] == 0.0 and probe["output_change"] == 0.0
        assert probe["row_error"] < 1e-5
    leaky = em.mask_probe("entmax15", "mask_ignored", length=6, dim=8)
    assert leaky["masked_weight"] > 1e-3 and leaky["output_change"] > 1e-3


# The frozen variant's query and key projections get no gradient, which the
# TensorFlow and PyTorch optimizers report: the point of the variant.
@pytest.mark.filterwarnings("ignore:Gradients do not exist")
@pytest.mark.parametrize("variant,moves", [(None, True), ("entmax_scores_frozen", False)])
def test_frozen_scores_train_no_query_projection(variant, moves):
    measures, model = em.train_arm("entmax15", 0, TINY, variant)
    layer = em.attention_layers(model)[0]
    fresh = _model("entmax15", variant)
    before = keras.ops.convert_to_numpy(em.attention_layers(fresh)[0]._query_dense.kernel)
    after = keras.ops.convert_to_numpy(layer._query_dense.kernel)
    assert bool(np.any(np.abs(after - before) > 1e-7)) is moves
    assert set(measures) == {"accuracy", "zeros", "alpha_start", "alpha_end", "seconds"}
    assert measures["zeros"].shape == (2, 2) and 0.0 <= measures["accuracy"] <= 1.0
