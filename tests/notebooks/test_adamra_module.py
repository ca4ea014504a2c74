"""The AdaMRA notebook's functions, moved into
``keras_longattn.reproductions.adamra``: probes, configs, baselines, the
suite runner's labels and the compiled cost."""

import numpy as np
import pytest

import keras

from keras_longattn.layers import AdaMRAAttention
from keras_longattn.reproductions import adamra as ar

# A model trained once, on PyTorch: JAX runs the same code in the planted
# tests (tests/notebooks/test_planted_real.py) and the notebooks, on CI time.
trains = pytest.mark.skipif(keras.backend.backend() != "torch",
                            reason="trains a model: run once, on PyTorch")


def _inputs(length=32, dim=16):
    return np.random.default_rng(1).normal(size=(2, length, dim)).astype("float32")


@pytest.mark.parametrize("routing,kept", [("learned", 1.0), ("random", None)])
def test_routing_probe_tells_content_from_position(routing, kept):
    keras.utils.set_random_seed(0)
    layer = AdaMRAAttention(num_heads=4, key_dim=8, routing=routing)
    probe = ar.routing_probe(layer, _inputs())
    assert np.isclose(sum(probe["head_shares"]), 1.0)
    if kept is None:  # a head per position: permuted queries change heads
        assert probe["kept_head"] < 0.6
    else:
        assert probe["kept_head"] == kept


def test_mechanism_probes_of_a_config():
    probes = ar.mechanism_probes(ar.adamra_spec(ar.DEFAULT_RATES), length=32, dim=16,
                                 key_dim=8)
    assert set(probes) == {"head_shares", "kept_head", "segment_probe"}
    assert probes["kept_head"] == 1.0
    assert probes["segment_probe"]["inside"] < 1e-4 < probes["segment_probe"]["across"]


def test_constant_router_is_one_class_and_builds_from_its_reference():
    assert ar.ConstantRouterAdaMRA is ar.ConstantRouterAdaMRA
    spec = ar._variant_spec("constant_router")
    probes = ar.mechanism_probes(spec, length=32, dim=16, key_dim=8)
    assert probes["head_shares"] == [1.0, 0.0, 0.0, 0.0]


def test_specs_and_claim_names():
    assert ar.adamra_spec(ar.TABLE1_RATES)["config"] == {
        "num_heads": 3, "compression_rates": [0.5, 0.125, 0.03125]}
    specs = ar.ablation_specs(ar.DEFAULT_RATES)
    assert specs["random"]["config"]["routing"] == "random"
    assert ar.claim_arm_name("rates-1/4x4", specs["rates-1/4x4"]) == "rates:1/4,1/4,1/4,1/4"
    assert ar.claim_arm_name("random", specs["random"]) == "random"


def test_task_baselines_majority_class():
    baselines = ar.task_baselines(["listops", "image"], "ci")
    assert baselines["listops"]["chance"] == 10.0
    # The generated ListOps test set is not balanced.
    assert baselines["listops"]["majority"] > 15.0
    assert 10.0 <= baselines["image"]["majority"] < 11.0


@trains
def test_run_arms_labels_rows_by_arm():
    arms = {"rates-1/4x4": ar.ablation_specs(ar.DEFAULT_RATES)["rates-1/4x4"]}
    results, acc = ar.run_arms(arms, ["image"], seeds=1, size="tiny")
    assert {row["layer"] for row in results} == {"rates-1/4x4"}
    assert list(acc) == ["rates-1/4x4"] and len(acc["rates-1/4x4"]["image"]) == 1


@pytest.mark.skipif(keras.backend.backend() != "jax",
                    reason="compiled by XLA in this process on JAX (elsewhere a JAX subprocess: "
                    "the same programs)")
def test_compiled_cost_of_adamra_is_below_full_attention():
    cost = ar.cost_against_full(ar.adamra_spec(ar.DEFAULT_RATES), 256, num_heads=4,
                                head_dim=16)
    assert cost["adamra"]["flops"] < cost["full"]["flops"]
    assert cost["adamra"]["temp_bytes"] < cost["full"]["temp_bytes"]
