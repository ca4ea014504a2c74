"""Unit tests of the Sparse Transformer notebook's functions
(``keras_longattn.reproductions.sparse_transformer``): the layers of its
arms, its training function, the compiled cost and the planted variants'
layers. They run on every backend."""

import numpy as np
import pytest

import keras

from keras_longattn.layers import FullAttention, LocalAttention, SparseAttention
from keras_longattn.reproductions import sparse_transformer as st

# A model trained once, on PyTorch: JAX runs the same code in the planted
# tests (tests/notebooks/test_planted_real.py) and the notebooks, on CI time.
trains = pytest.mark.skipif(keras.backend.backend() != "torch",
                            reason="trains a model: run once, on PyTorch")


def test_make_attention_builds_each_arm():
    kinds = {m: st.make_attention(m, 8, dim=16, num_heads=4) for m in st.MECHANISMS}
    assert isinstance(kinds["dense"], FullAttention)
    assert isinstance(kinds["local"], LocalAttention) and kinds["local"].window == 8
    for pattern in ("strided", "fixed"):
        layer = kinds[pattern]
        assert isinstance(layer, SparseAttention)
        assert (layer.pattern, layer.block_length, layer.combination) == (
            pattern, 8, "multihead")


def test_make_attention_refuses_an_unknown_mechanism():
    with pytest.raises(ValueError, match="mechanism=.*sliding"):
        st.make_attention("sliding", 8, dim=16, num_heads=4)


def test_planted_run_refuses_an_unknown_variant():
    with pytest.raises(ValueError, match="variant='no_such_bug'"):
        st._planted_run("no_such_bug")


def test_equal_layers_share_a_key_and_different_ones_do_not():
    dense = st._layer_key(FullAttention(num_heads=4, key_dim=8))
    assert dense == st._layer_key(FullAttention(num_heads=4, key_dim=8))
    swapped = st._broken_sparse("dense_swap", "strided", 8, num_heads=4, key_dim=8,
                                summary_width=None)
    assert st._layer_key(swapped) == dense
    real = st._broken_sparse(None, "strided", 8, num_heads=4, key_dim=8, summary_width=None)
    leak = st._broken_sparse("causal_mask_dropped", "strided", 8, num_heads=4, key_dim=8,
                             summary_width=None)
    assert len({st._layer_key(real), st._layer_key(leak), dense}) == 3


def test_planted_layers_break_the_measured_coverage():
    # The real two-head layers pass; head B removed leaves pattern A only
    # (incomplete); the causal mask dropped reads later positions.
    def coverage(variant, pattern):
        keras.utils.set_random_seed(0)
        layer = st._broken_sparse(variant, pattern, 4, num_heads=2, key_dim=4,
                                  summary_width=1)
        return st.two_step_coverage(st.measured_head_masks(layer, 16, 8))

    for pattern in ("strided", "fixed"):
        assert coverage(None, pattern) == (True, True)
        assert coverage("head_b_removed", pattern)[0] is False
        assert coverage("causal_mask_dropped", pattern)[1] is False


@trains
def test_train_image_arm_runs_and_scores_both_halves():
    images = np.random.default_rng(0).integers(0, 4, size=(40, 8))
    data = st.make_repeated_images(images, 1, 8)
    config = st.TrainConfig(dim=8, num_layers=1, num_heads=2, learning_rate=1e-2,
                            batch_size=8, steps=3)
    arm = st.train_image_arm(lambda: st.make_attention("strided", 4, dim=8, num_heads=2),
                             data, data[:8], levels=4, seed=0, config=config)
    assert set(arm) == {"first", "repeated", "step_seconds"}
    assert np.isfinite(arm["first"]) and np.isfinite(arm["repeated"])
    assert len(arm["step_seconds"]) == config.steps - 1


def test_compiled_cost_counts_dense_above_strided_on_jax():
    make = {"dense": lambda: st.make_attention("dense", 8, dim=16, num_heads=2),
            "strided": lambda: st.make_attention("strided", 8, dim=16, num_heads=2)}
    cost = st.measure_compiled_cost(make, 128, 16)
    if keras.backend.backend() != "jax":
        assert cost is None
        return
    assert cost["dense"]["flops"] > 1.5 * cost["strided"]["flops"] > 0
    assert cost["dense"]["temp_bytes"] > cost["strided"]["temp_bytes"] > 0


@trains
def test_dense_plateau_sweep_picks_dense_best_rate_and_trains_the_others_with_it():
    images = np.random.default_rng(0).integers(0, 4, size=(40, 8))
    data = st.make_repeated_images(images, 1, 8)
    config = st.TrainConfig(dim=8, num_layers=1, num_heads=2, learning_rate=1e-2,
                            batch_size=8, steps=2)
    sweep = st.dense_plateau_sweep(data, data[:8], levels=4, seeds=1, steps=2,
                                   learning_rates=[1e-3, 1e-2], config=config,
                                   block_length=4, log=None)
    assert sweep["steps"] == 2 and set(sweep["grid"]) == {"0.001", "0.01"}
    best = min(sweep["grid"], key=lambda rate: sweep["grid"][rate]["first"][0])
    assert sweep["best_learning_rate"] == float(best)
    assert sweep["arms"]["dense"] == sweep["grid"][best]
    assert set(sweep["arms"]) == {"dense", "strided", "local"}
    for arm in sweep["arms"].values():
        assert len(arm["first"]) == len(arm["repeated"]) == 1
