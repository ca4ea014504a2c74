"""Every layer under keras.distribution on 8 simulated devices: data
parallel (8 replicas) and model parallel (4 replicas x 2 model shards with
keras_longattn.parallel.layout_map) give the single-device logits, and a few
training steps the same losses and weights; routing centroids are the same
on every replica.

Tolerance: float32, 2e-4 absolute on logits and losses, 5e-4 on weights
after training (the sharded programs sum in a different order).
"""

import keras
import numpy as np
import pytest

from keras_longattn import layers as L
from keras_longattn.models import build_causal_language_model
from keras_longattn.models import build_sequence_classifier
from keras_longattn.parallel import ContextParallel
from keras_longattn.parallel import layout_map

LENGTH = 32
BATCH = 8
DIM = 16
HEADS = 2
KEY_DIM = 8

#: name -> (layer factory, causal): causal layers go into the causal
#: language model, the others into the classifier (padded inputs).
LAYERS = {
    "full": (lambda: L.FullAttention(HEADS, KEY_DIM), True),
    "local": (lambda: L.LocalAttention(HEADS, KEY_DIM, window=8), True),
    "sparse": (lambda: L.SparseAttention(HEADS, KEY_DIM, pattern="strided", block_length=4),
               True),
    "routing": (lambda: L.RoutingAttention(HEADS, KEY_DIM, num_clusters=2), True),
    "longformer": (lambda: L.LongformerAttention(HEADS, KEY_DIM, window=4, global_tokens=1),
                   False),
    "bigbird": (lambda: L.BigBirdAttention(HEADS, KEY_DIM, block_size=4, global_blocks=1),
                False),
    "linformer": (lambda: L.LinformerAttention(HEADS, KEY_DIM, k=8, max_length=LENGTH), False),
    "synthesizer": (lambda: L.SynthesizerAttention(HEADS, KEY_DIM, max_length=LENGTH,
                                                   kind="dense+random+vanilla"), True),
    "adamra": (lambda: L.AdaMRAAttention(HEADS, KEY_DIM), False),
    "linear": (lambda: L.LinearAttention(HEADS, KEY_DIM), True),
    "performer": (lambda: L.PerformerAttention(HEADS, KEY_DIM), True),
    "nystrom": (lambda: L.NystromAttention(HEADS, KEY_DIM, num_landmarks=4), False),
    "lsh": (lambda: L.LSHAttention(HEADS, KEY_DIM), False),
}


def _build(name):
    factory, causal = LAYERS[name]
    common = dict(vocab_size=32, sequence_length=LENGTH, dim=DIM, num_layers=1,
                  num_heads=HEADS, attention=factory(), feedforward_dim=32)
    if causal:
        return build_causal_language_model(**common)
    return build_sequence_classifier(num_classes=4, **common)


def _data(name):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 32, size=(BATCH, LENGTH)).astype("int32")
    if LAYERS[name][1]:
        return tokens, rng.integers(0, 32, size=(BATCH, LENGTH)).astype("int32")
    tokens[::2, LENGTH - 7:] = 0  # padding (token 0) on half the rows
    return tokens, rng.integers(0, 4, size=(BATCH,)).astype("int32")


def _run(name, weights, distribution=None):
    """Logits, the losses of three SGD steps and the weights after them."""
    keras.utils.set_random_seed(0)
    if distribution is None:
        model = _build(name)
    else:
        with distribution.scope():
            model = _build(name)
    model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(name)
    logits = np.asarray(model.predict_on_batch(x))
    losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
    return model, logits, losses, [np.asarray(w) for w in model.get_weights()]


def _reference(name):
    keras.utils.set_random_seed(0)
    weights = _build(name).get_weights()
    return weights, _run(name, weights)


def _compare(reference, distributed):
    _, logits, losses, weights = reference
    _, d_logits, d_losses, d_weights = distributed
    np.testing.assert_allclose(d_logits, logits, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(d_losses, losses, atol=2e-4, rtol=1e-4)
    assert len(d_weights) == len(weights)
    for a, b in zip(d_weights, weights):
        np.testing.assert_allclose(a, b, atol=5e-4, rtol=1e-3)
    # The training changed the weights (so equal weights mean equal steps).
    assert losses[0] != losses[-1]


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_model_parallel_equals_one_device(devices, name):
    mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"),
                                         keras.distribution.list_devices()[:8])
    distribution = keras.distribution.ModelParallel(layout_map=layout_map(mesh),
                                                    batch_dim_name="batch")
    weights, reference = _reference(name)
    distributed = _run(name, weights, distribution)
    _compare(reference, distributed)
    model = distributed[0]
    sharded = [w.path for w in model.weights
               if w.value.sharding.spec and any(s == "model" for s in w.value.sharding.spec)]
    # The attention projections and the feed-forward are split over "model".
    assert any("/query/kernel" in p for p in sharded), sharded
    assert any("/attention_output/kernel" in p for p in sharded), sharded
    assert any("/hidden/kernel" in p for p in sharded), sharded


@pytest.mark.parametrize("name", ["full", "local", "routing", "longformer", "performer"])
def test_data_parallel_equals_one_device(devices, name):
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:8])
    weights, reference = _reference(name)
    distributed = _run(name, weights, distribution)
    _compare(reference, distributed)
    if name == "routing":
        centroids = [w for w in distributed[0].weights if "centroids" in w.path]
        assert centroids
        for variable in centroids:
            shards = [np.asarray(s.data) for s in variable.value.addressable_shards]
            assert len(shards) == 8
            for shard in shards[1:]:
                np.testing.assert_array_equal(shard, shards[0])
        # Training moved the centroids (the check above is not on constants).
        before = [w for w, v in zip(weights, distributed[0].weights) if "centroids" in v.path]
        assert any(not np.allclose(b, np.asarray(v.value)) for b, v in zip(before, centroids))


@pytest.mark.parametrize("name", ["local", "full"])
def test_context_parallel_distribution_equals_one_device(devices, name):
    """Inputs split over batch (2) and sequence (4): the same logits, losses
    and trained weights as one device."""
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "sequence"),
                                         keras.distribution.list_devices()[:8])
    distribution = ContextParallel(mesh)
    assert distribution.get_data_layout((BATCH, LENGTH)).axes == ("batch", "sequence")
    assert distribution.get_data_layout((BATCH, LENGTH, DIM)).axes == (
        "batch", "sequence", None)
    weights, reference = _reference(name)
    _compare(reference, _run(name, weights, distribution))


def test_context_parallel_arguments(devices):
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "sequence"),
                                         keras.distribution.list_devices()[:8])
    with pytest.raises(ValueError, match="sequence_dim_name.*'seq'"):
        ContextParallel(mesh, sequence_dim_name="seq")
    with pytest.raises(ValueError, match="batch_dim_name.*'data'"):
        ContextParallel(mesh, batch_dim_name="data")
    with pytest.raises(ValueError, match="different axes"):
        ContextParallel(mesh, batch_dim_name="sequence")
    with pytest.raises(TypeError, match="device_mesh"):
        ContextParallel("mesh")
    only_sequence = ContextParallel(
        keras.distribution.DeviceMesh((8,), ("sequence",), keras.distribution.list_devices()[:8]),
        batch_dim_name=None)
    assert only_sequence.get_data_layout((4, 16)).axes == (None, "sequence")


def test_layout_map_arguments():
    if keras.backend.backend() != "jax":
        with pytest.raises(NotImplementedError, match="JAX backend"):
            layout_map(None)
        return
    mesh = keras.distribution.DeviceMesh((1,), ("model",), keras.distribution.list_devices()[:1])
    with pytest.raises(ValueError, match="model_axis.*'heads'"):
        layout_map(mesh, model_axis="heads")
    with pytest.raises(TypeError, match="device_mesh"):
        layout_map("mesh")
    replicated = layout_map(mesh, shard_key_value_heads=False)
    assert replicated["a/key/kernel"].axes == (None, None, None)
    assert layout_map(mesh)["a/key/kernel"].axes == (None, "model", None)
    assert layout_map(mesh)["block/attention_output/kernel"].axes == ("model", None, None)
    assert layout_map(mesh)["block/output/kernel"].axes == ("model", None)
    assert layout_map(mesh)["norm/gamma"] is None
