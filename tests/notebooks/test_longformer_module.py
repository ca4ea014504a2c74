"""The Longformer notebook's training and measuring functions
(``keras_longattn.reproductions.longformer``), on tiny sizes."""

import keras
import numpy as np
import pytest

from keras_longattn.layers import FullAttention, LongformerAttention
from keras_longattn.reproductions import longformer as lf

# A model trained once, on PyTorch: JAX runs the same code in the planted
# tests (tests/notebooks/test_planted_real.py) and the notebooks, on CI time.
trains = pytest.mark.skipif(keras.backend.backend() != "torch",
                            reason="trains a model: run once, on PyTorch")

TINY = lf.TaskConfig(length=12, window=4, layers=1, dim=8, num_heads=2, classes=2, fillers=4,
                     min_position=4, batch_size=4, steps=3, test_examples=8)


def test_task_config_refuses_a_signal_inside_the_reach():
    with pytest.raises(ValueError, match="min_position"):
        lf.TaskConfig(length=32, window=16, layers=1, min_position=8)
    assert TINY.chance == 50.0 and TINY.filler_from == 3


def test_layers_of_the_arms_and_variants():
    assert type(lf.task_attention("full", TINY)) is FullAttention
    local = lf.task_attention("local", TINY)
    assert local.window == 4 and local.global_tokens == 0
    assert lf.task_attention("global", TINY).global_tokens == 1
    assert isinstance(lf.task_attention("global", TINY, "no_global"), lf.LocalOnlyLongformer)
    # A variant replaces only the arm it breaks.
    assert type(lf.task_attention("global", TINY, "full_cut_to_window")) is LongformerAttention
    cut = lf.task_attention("full", TINY, "full_cut_to_window")
    assert isinstance(cut, LongformerAttention) and cut.window == TINY.window
    assert lf.task_attention("local", TINY, "leaky_control").window > 2 * TINY.length
    assert lf.longformer_layer("quadratic_memory", num_heads=2, key_dim=4,
                               window=4).implementation == "reference"
    with pytest.raises(ValueError, match="variant"):
        lf.longformer_layer("nonsense", num_heads=2, key_dim=4)
    with pytest.raises(ValueError, match="arm"):
        lf.task_attention("nonsense", TINY)
    assert set(lf.VARIANT_ARMS) == set(lf.VARIANT_MEASURES) == {
        v.name for v in lf.PLANTED.variants}


@trains
def test_a_reused_model_trains_as_a_fresh_one():
    # run_task reinitialises an arm's model for its next seed: the same
    # weights as a model built and trained fresh with that seed.
    test_set = TINY.test_set()
    _, seed0 = lf.train_task_arm("global", 0, TINY, test_set=test_set)
    fresh_acc, fresh = lf.train_task_arm("global", 1, TINY, test_set=test_set)
    reused_acc, reused = lf.train_task_arm("global", 1, TINY, test_set=test_set, reuse=seed0)
    assert reused is seed0
    assert fresh_acc == reused_acc
    for a, b in zip(fresh.get_weights(), reused.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(keras.ops.convert_to_numpy(reused.optimizer.iterations)) == TINY.steps


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="compiled cost: JAX only")
def test_compiled_cost_grows_with_the_pattern():
    rows = lf.compiled_scaling([64, 256], window=8, global_tokens=2, num_heads=2, head_dim=8)
    for arm in ("full", "longformer"):
        assert all(row["status"] == "ok" and row["temp_mib"] > 0 and row["gflops"] > 0
                   for row in rows[arm].values())
    full_growth = lf.memory_growth(rows["full"], key="temp_mib")[1]
    lf_growth = lf.memory_growth(rows["longformer"], key="temp_mib")[1]
    assert full_growth > 10 and lf_growth < 5
    with pytest.raises(ValueError, match="arms"):
        lf.compiled_scaling([64], window=8, arms=("dense",))


@pytest.mark.skipif(keras.backend.backend() == "jax", reason="the refusal off JAX")
def test_compiled_cost_refuses_other_backends():
    with pytest.raises(ValueError, match="JAX"):
        lf.compiled_cost(FullAttention(num_heads=2, key_dim=4), 16, 8)
