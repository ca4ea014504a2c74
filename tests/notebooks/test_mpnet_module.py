"""The MPNet notebook's data builders, models, probes and training
(``keras_longattn.reproductions.mpnet``), on tiny sizes and synthetic
bytes (the Wikipedia sample is read only by the held-out set)."""

import keras
import numpy as np
import pytest

from keras_longattn.models import two_stream_masks
from keras_longattn.models.mpnet import PretrainingModel
from keras_longattn.reproductions import mpnet as mp

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

TINY = mp.PretrainConfig(length=10, predict_ratio=0.3, dim=8, layers=1, num_heads=2,
                         batch_size=4, steps=3, learning_rate=1e-2, valid_windows=8)
DATA = np.random.default_rng(0).integers(0, 256, size=2_000).astype("int32")


def _inputs(n=TINY.length, count=3, seed=0):
    inputs, _ = mp.pretraining_batch(DATA, n, count, TINY.predict_ratio, seed)
    return inputs


def test_pretraining_batch_permutes_windows_and_predicts_the_last_tokens():
    inputs, targets = mp.pretraining_batch(DATA, 10, 4, 0.3, seed=1)
    assert inputs["tokens"].shape == inputs["positions"].shape == (4, 10)
    assert inputs["tokens"].dtype == np.int32 and targets.shape == (4, 3)
    np.testing.assert_array_equal(targets, inputs["tokens"][:, -3:])
    for tokens, positions in zip(inputs["tokens"], inputs["positions"]):
        assert sorted(positions) == list(range(10))
        window = np.empty(10, "int32")
        window[positions] = tokens  # undo the permutation: a window of DATA
        start = np.nonzero(DATA[:-9] == window[0])[0]
        assert any(np.array_equal(DATA[s:s + 10], window) for s in start)
    again, _ = mp.pretraining_batch(DATA, 10, 4, 0.3, seed=1)
    np.testing.assert_array_equal(again["tokens"], inputs["tokens"])
    with pytest.raises(ValueError, match="data"):
        mp.pretraining_batch(DATA[:5], 10, 4, 0.3, seed=0)
    with pytest.raises(ValueError, match="predict_ratio"):
        mp.pretraining_batch(DATA, 10, 4, 0.0, seed=0)


def test_held_out_set_is_fixed_consecutive_windows():
    inputs, targets = mp.held_out_set(DATA, 10, 5, 0.3)
    again, _ = mp.held_out_set(DATA, 10, 5, 0.3)
    np.testing.assert_array_equal(inputs["positions"], again["positions"])
    window = np.empty(10, "int32")
    window[inputs["positions"][2]] = inputs["tokens"][2]
    np.testing.assert_array_equal(window, DATA[20:30])
    assert targets.shape == (5, 3)
    with pytest.raises(ValueError, match="num_windows"):
        mp.held_out_set(DATA, 10, 500, 0.3)


def test_config_checks_its_arguments():
    assert TINY.num_predicted == 3
    with pytest.raises(ValueError, match="predict_ratio"):
        mp.PretrainConfig(predict_ratio=1.5)
    with pytest.raises(ValueError, match="num_heads"):
        mp.PretrainConfig(dim=10, num_heads=4)
    with pytest.raises(ValueError, match="steps"):
        mp.PretrainConfig(steps=0)


def test_models_of_the_objectives_and_variants():
    assert type(mp.build_model("mpnet", TINY)) is PretrainingModel
    leaky = mp.build_model("mpnet", TINY, "own_content_query")
    assert isinstance(leaky, mp.OwnContentQueryModel)
    assert all(isinstance(b, mp.OwnContentQueryBlock) for b in leaky.encoder_layers)
    # The replaced blocks are no longer tracked: the same weights as the real model.
    assert len(leaky.weights) == len(mp.build_model("mpnet", TINY).weights)
    assert isinstance(mp.build_model("mpnet", TINY, "no_position_compensation"),
                      mp.PositionlessMaskModel)
    frozen = mp.build_model("plm", TINY, "frozen_weights")
    assert isinstance(frozen, mp.FrozenPretrainingModel) and not frozen.trainable_weights
    # A variant that does not break an objective builds the real model.
    assert type(mp.build_model("mlm", TINY, "own_content_query")) is PretrainingModel
    assert type(mp.build_model("plm", TINY, "no_position_compensation")) is PretrainingModel
    with pytest.raises(ValueError, match="objective"):
        mp.build_model("bert", TINY)
    with pytest.raises(ValueError, match="variant"):
        mp.build_model("mpnet", TINY, "nonsense")


@pytest.mark.parametrize("kind", ["plm", "mpnet"])
def test_the_planted_block_adds_exactly_the_diagonal(kind):
    block = mp.OwnContentQueryBlock(kind=kind)
    n, b = 6, 2
    L = n + b if kind == "mpnet" else n
    _, leaky = block._masks(L, b)
    _, real = two_stream_masks(n, b, kind)
    diff = np.argwhere(keras.ops.convert_to_numpy(leaky) != real)
    np.testing.assert_array_equal(diff, [[0, n - b], [1, n - b + 1]])


def test_query_leak_probe_tells_the_real_query_stream_from_the_planted_one():
    keras.utils.set_random_seed(0)
    inputs = _inputs()
    for objective in ("plm", "mpnet"):
        probe = mp.query_leak_probe(mp.build_model(objective, TINY), inputs)
        assert probe["own"].shape == (3,) and probe["later"].shape == (2,)
        assert probe["own"].max() <= 1e-5 and probe["later"].min() >= 1e-3, objective
    leaky = mp.query_leak_probe(mp.build_model("mpnet", TINY, "own_content_query"), inputs)
    assert leaky["own"].min() >= 1e-3


def test_position_probe_sees_position_compensation():
    keras.utils.set_random_seed(0)
    inputs = _inputs()
    assert mp.position_probe(mp.build_model("mpnet", TINY), inputs) >= 1e-3
    assert mp.position_probe(mp.build_model("mlm", TINY), inputs) >= 1e-3
    assert mp.position_probe(mp.build_model("plm", TINY), inputs) <= 1e-6
    assert mp.position_probe(mp.build_model("mpnet", TINY, "no_position_compensation"),
                             inputs) <= 1e-6
    one = mp.PretrainConfig(length=4, predict_ratio=0.25, dim=8, layers=1, num_heads=2)
    with pytest.raises(ValueError, match="2 predicted"):
        mp.position_probe(mp.build_model("mpnet", one), _inputs(n=4))


def test_corruption_task():
    tokens, labels = mp.make_corruption_task(DATA, 40, 16, corrupted=3, seed=0)
    assert tokens.shape == (40, 16) and labels.sum() == 20
    windows = np.lib.stride_tricks.sliding_window_view(DATA, 16)
    for row, label in zip(tokens, labels):
        best = int(np.min(np.sum(windows != row, axis=1)))
        assert best == (3 if label else 0)
    with pytest.raises(ValueError, match="corrupted"):
        mp.make_corruption_task(DATA, 4, 16, corrupted=0)


def test_encoder_classifier_shares_the_pretrained_encoder():
    keras.utils.set_random_seed(0)
    base = mp.build_model("mpnet", TINY)
    model = mp.EncoderClassifier(base, 2)
    tokens = DATA[:30].reshape(3, 10)
    assert tuple(model(tokens).shape) == (3, 2)
    shared = {id(v) for v in base.weights}
    own = [v for v in model.weights if id(v) not in shared]
    assert [v.path for v in own] == [v.path for v in model.classifier.weights]
    # The classifier's encoder is the pre-trained model's plain encoder.
    pooled = keras.ops.mean(base.encode(tokens), axis=1)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(tokens)),
                               keras.ops.convert_to_numpy(model.classifier(pooled)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:The model does not have any trainable weights")
def test_fit_trains_and_the_frozen_variant_does_not():
    held = mp.held_out_set(DATA, TINY.length, TINY.valid_windows, TINY.predict_ratio)
    after, before, model = mp.train_objective("mpnet", 0, TINY, held_out=held,
                                              train_data=DATA)
    assert set(after) == {"bits", "accuracy", "first_accuracy"}
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == TINY.steps
    assert after["bits"] != before["bits"]
    after, before, frozen = mp.train_objective("mpnet", 0, TINY, "frozen_weights",
                                               held_out=held, train_data=DATA)
    assert after == before
