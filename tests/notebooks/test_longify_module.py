"""The longify notebook's data builders, conversions and measures
(``keras_longattn.reproductions.longify``), on tiny sizes and on every
backend."""

import keras
import numpy as np
import pytest

pytest.importorskip("keras_hub")

from keras_longattn import hub  # noqa: E402
from keras_longattn.reproductions import longify as lg  # noqa: E402

TINY = lg.Config(short_length=8, long_length=24, vocabulary_size=300, num_layers=1,
                 num_heads=2, hidden_dim=16, intermediate_dim=32, window=4, num_keys=3,
                 batch_size=4, task_steps=2, finetune_steps=1, test_examples=8, grid=4)
TEXT = np.arange(5, 295, dtype="int32")  # stands in for tokenized text: no key id in it
KEYS = lg.key_ids(TINY.vocabulary_size, TINY.num_keys)


def _task(count=64, length=40, low=16, high=39, seed=0, ids=None):
    return lg.make_far_key_task(ids if ids is not None else np.tile(TEXT, 3), count, length,
                                low, high, num_keys=3, vocabulary_size=300, seed=seed,
                                grid=4, num_decoys=2)


def test_far_key_task_puts_the_answer_on_the_grid_and_decoys_off_it():
    tokens, labels, positions = _task()
    assert tokens.shape == (64, 40) and tokens.dtype == np.int32
    assert np.all(tokens[:, 0] == lg.START_ID)
    assert np.all(positions % 4 == 0) and positions.min() >= 16 and positions.max() <= 39
    np.testing.assert_array_equal(tokens[np.arange(64), positions], KEYS[labels])
    for row, position in zip(tokens, positions):
        found = np.nonzero(np.isin(row, KEYS))[0]
        assert position in found
        # every other key stands off the grid (2 decoys, which may coincide)
        assert all(j % 4 for j in found if j != position) and 1 <= len(found) <= 3
    # the same seed gives the same examples; another seed other ones
    np.testing.assert_array_equal(_task()[0], tokens)
    assert not np.array_equal(_task(seed=1)[0], tokens)
    assert set(np.unique(labels)) == {0, 1, 2}


def test_far_key_task_removes_keys_from_the_text():
    text = np.full(200, KEYS[0], "int32")  # text made of a key only
    tokens, _, positions = _task(count=8, ids=text)
    keys_found = np.isin(tokens, KEYS).sum(axis=1)
    assert np.all(keys_found <= 3)  # the answer and at most two decoys
    assert np.sum(tokens == lg.UNK_ID) > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(low=0), "min_position"), (dict(low=30, high=20), "min_position"),
    (dict(low=17, high=19), "grid"), (dict(count=0), "count"),
])
def test_far_key_task_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _task(**kwargs)


def test_text_windows_and_config_checks():
    windows = lg.text_windows(TEXT, 5, 10, np.random.default_rng(0))
    assert windows.shape == (5, 10)
    np.testing.assert_array_equal(np.diff(windows, axis=1), 1)  # consecutive tokens
    with pytest.raises(ValueError, match="longer than the text"):
        lg.text_windows(TEXT, 1, 1000, np.random.default_rng(0))
    with pytest.raises(ValueError, match="long_length"):
        lg.Config(short_length=16, long_length=16)
    with pytest.raises(ValueError, match="window"):
        lg.Config(window=0)
    assert TINY.chance == pytest.approx(100 / 3)


def test_long_attention_configs():
    assert lg.long_attention("local", 8) == {"class_name": "LocalAttention",
                                             "config": {"window": 8}}
    lf = lg.long_attention("longformer", 8)
    assert lf["class_name"] == "LongformerAttention" and lf["config"]["global_tokens"] == 1
    assert lg.long_attention("longformer", 8, "no_global")["config"]["global_tokens"] == 0
    assert lg.long_attention("longformer", 8, "dense_swap")["class_name"] == "FullAttention"
    with pytest.raises(ValueError, match="arm"):
        lg.long_attention("truncated", 8)


def _table(backbone):
    return keras.ops.convert_to_numpy(
        backbone.embeddings.position_embedding.position_embeddings)


def test_conversions_copy_drop_and_halve():
    backbone = lg.build_roberta(TINY)
    attention = lg.long_attention("longformer", 4)
    trained = _table(backbone)
    copied = _table(lg.convert(backbone, attention, 24))
    np.testing.assert_array_equal(copied, trained[np.arange(24) % 8])
    dropped = _table(lg.longify_dropping_positions(backbone, attention, 24))
    np.testing.assert_array_equal(dropped[:8], trained)
    assert not np.allclose(dropped[8:], copied[8:])
    assert np.std(dropped[8:]) < 0.1  # RoBERTa's initializer, not zeros, not a copy
    assert np.std(dropped[8:]) > 0
    halved = lg.convert(backbone, attention, 24, "halved_window")
    assert halved.transformer_layers[0]._self_attention_layer.window == 2
    assert isinstance(halved, hub.LongRobertaBackbone)


def test_output_difference_is_zero_only_where_the_window_covers():
    backbone = lg.build_roberta(TINY)
    covering = lg.convert(backbone, lg.long_attention("local", 16), 24)
    assert lg.output_difference(backbone, covering, 8) < 1e-5
    narrow = lg.convert(backbone, lg.long_attention("local", 2), 24)
    assert lg.output_difference(backbone, narrow, 8) > 1e-3


def test_compiled_backbone_cost():
    backbone = lg.build_roberta(TINY)
    if keras.backend.backend() != "jax":
        with pytest.raises(ValueError, match="JAX"):
            lg.compiled_backbone_cost(backbone, 8)
        return
    row = lg.compiled_backbone_cost(backbone, 8, repeats=2)
    assert row["status"] == "ok" and row["temp_mib"] > 0 and row["gflops"] > 0
    assert row["median_ms"] > 0


# The training path, once, on PyTorch: JAX runs the same code in the planted
# tests (tests/notebooks/test_planted_real.py) and the notebook.
trains = pytest.mark.skipif(keras.backend.backend() != "torch",
                            reason="trains models: run once, on PyTorch")


@trains
def test_training_path_end_to_end():
    short = lg.train_short_model(TINY)
    assert 0.0 <= short.accuracy <= 100.0 and len(short.losses) == 1
    copy_init = lg.run_copy_init(short, [0, 1])
    assert set(copy_init) == {"copied", "dropped", "short"}
    assert all(len(v) == 2 for v in copy_init.values())
    accuracy, zero_shot = lg.run_task(short, [0, 1], verbose=False)
    assert set(accuracy) == set(lg.ARMS) and all(len(v) == 2 for v in accuracy.values())
    assert set(zero_shot) == {"local", "longformer"}
    # Every answer of the LONG split lies beyond the first short_length tokens.
    tokens, _, positions = lg.long_test_set(TINY)
    assert tokens.shape == (TINY.test_examples, TINY.long_length)
    assert positions.min() >= TINY.short_length
    lm, losses = lg.train_gpt2(TINY, 1)
    assert len(losses) == 1
    generation = lg.run_generation(lm, TINY, 4, 16)
    assert generation["converted"].shape == (16,) and generation["original"].shape == (8,)
    assert generation["equal"] and isinstance(generation["text"], str)


def test_a_reused_model_trains_again_from_the_fresh_conversion():
    # The seeds after the first reuse the compiled model: its weights go
    # back to the fresh conversion, its optimizer state to zero, and its
    # learning rate must survive the reset, or the later seeds never train.
    short = lg.train_short_model(TINY)
    test_set = lg.long_test_set(TINY)
    _, _, model = lg.finetune_arm(short, "local", 0, test_set)
    _, _, again = lg.finetune_arm(short, "local", 1, test_set, reuse=model)
    assert again is model
    assert float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == pytest.approx(
        TINY.learning_rate)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == TINY.finetune_steps
    fresh = lg._classifier(
        lg.convert(short.backbone, lg.long_attention("local", TINY.window), TINY.long_length),
        lg._dense_copy(short.head, TINY.hidden_dim))
    moved = [not np.allclose(a, b) for a, b in zip(model.get_weights(), fresh.get_weights())]
    assert sum(moved) > len(moved) // 2
