"""The layers pick context parallelism themselves (issue #35): under a
keras_longattn.parallel.ContextParallel distribution on 8 simulated devices
(2 batch x 4 sequence), FullAttention (ring), LocalAttention (halo),
LongformerAttention (halo and global tokens) and SparseAttention strided
(halo and column all-to-all) run their "context_parallel" path, with outputs
and gradients (weights and inputs) equal to the same layer on its
single-device path, causal and not, with padded keys; outside the
distribution "auto" never picks it; calls it cannot honour are refused with
a reason; a few SGD steps of a causal language model give the single-device
loss curve.

Tolerance: float32, 2e-5 absolute on attention outputs and gradients (the
parts are merged in another order), 2e-4 on losses (as
tests/parallel/test_distribution.py).
"""

import contextlib

import keras
import numpy as np
import pytest

from keras_longattn import layers as L
from keras_longattn.models import build_causal_language_model

B, T, F = 2, 64, 16
HEADS, KEY_DIM = 2, 8
ATOL = 2e-5

#: name -> (layer class, constructor arguments, single-device path).
LAYERS = {
    "full": (L.FullAttention, {}, "fused"),
    "local": (L.LocalAttention, {"window": 8}, "blocked"),
    "longformer": (L.LongformerAttention,
                   {"window": 4, "dilation": [1, 2], "global_tokens": 2}, "blocked"),
    "sparse": (L.SparseAttention,
               {"pattern": "strided", "block_length": 8, "combination": "merged"}, "blocked"),
}


def _distribution(sequence_devices=4):
    from keras_longattn.parallel import ContextParallel

    batch = 8 // sequence_devices
    mesh = keras.distribution.DeviceMesh((batch, sequence_devices), ("batch", "sequence"),
                                         keras.distribution.list_devices()[:8])
    return ContextParallel(mesh)


def _pair(name):
    """The layer (``"auto"``) and its twin on the single-device path, with
    the same weights."""
    cls, kwargs, single = LAYERS[name]
    layer = cls(HEADS, KEY_DIM, **kwargs)
    twin = cls(HEADS, KEY_DIM, implementation=single, **kwargs)
    for one in (layer, twin):
        one.build((B, T, F), (B, T, F))
    twin.set_weights(layer.get_weights())
    return layer, twin


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, F)).astype("float32")
    mask = np.ones((B, T), bool)
    mask[1, T - 13:] = False  # right padding on the second example
    mask[0, 5:9] = False  # a gap in the first
    return x, mask


def _outputs_and_grads(layer, x, mask):
    """Outputs, causal and not, and the gradients of ``sum(sin(out))``
    with respect to the weights and the input, from one compiled program;
    also the path each call took."""
    import jax
    import jax.numpy as jnp

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]
    ran = {}

    def loss(weights, x, causal):
        out, _ = layer.stateless_call(weights, non_trainable, x, x, key_mask=mask,
                                      use_causal_mask=causal)
        ran[causal] = layer.last_implementation
        return jnp.sum(jnp.sin(out)), out

    def both(weights, x):
        grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        results = []
        for causal in (False, True):
            (_, out), grads = grad(weights, x, causal)
            results.append((out, grads))
        return results

    results = jax.jit(both)(trainable, x)
    return results, ran


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_context_parallel_equals_one_device(devices, name):
    layer, twin = _pair(name)
    x, mask = _inputs()
    distribution = _distribution()
    with distribution.scope():
        got, ran = _outputs_and_grads(layer, x, mask)
    assert ran == {False: "context_parallel", True: "context_parallel"}
    want, ran_twin = _outputs_and_grads(twin, x, mask)
    assert "context_parallel" not in ran_twin.values()
    for (out, (w_grads, x_grad)), (out_1, (w_grads_1, x_grad_1)) in zip(got, want):
        np.testing.assert_allclose(np.asarray(out), np.asarray(out_1), atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(x_grad), np.asarray(x_grad_1), atol=ATOL,
                                   rtol=1e-5)
        assert len(w_grads) == len(layer.trainable_variables)
        for a, b in zip(w_grads, w_grads_1):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=1e-5)
    # The comparison has something to compare: padded keys change the output.
    assert np.abs(np.asarray(got[0][0])).max() > 1e-3


def test_auto_picks_context_parallel_only_in_scope(devices):
    layer = L.LocalAttention(HEADS, KEY_DIM, window=8)
    layer.build((B, T, F), (B, T, F))
    call = dict(use_causal_mask=True, query_length=T, key_length=T)
    assert layer.select_implementation(**call) != "context_parallel"
    distribution = _distribution()
    with distribution.scope():
        assert layer.select_implementation(**call) == "context_parallel"
    keras.distribution.set_distribution(distribution)
    try:
        assert layer.select_implementation(**call) == "context_parallel"
    finally:
        keras.distribution.set_distribution(None)
    assert layer.select_implementation(**call) != "context_parallel"
    # Another kind of distribution is not context parallelism.
    data = keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:8])
    with data.scope():
        assert layer.select_implementation(**call) != "context_parallel"
        named = L.LocalAttention(HEADS, KEY_DIM, window=8, implementation="context_parallel")
        with pytest.raises(ValueError, match="no keras_longattn.parallel.ContextParallel"):
            named.select_implementation(**call)


def test_context_parallel_refusals(devices):
    distribution = _distribution()
    with distribution.scope():
        def refusal(layer, **call):
            call = dict(dict(use_causal_mask=True, query_length=T, key_length=T), **call)
            assert layer.select_implementation(**call) != "context_parallel"
            named = type(layer).from_config(
                dict(layer.get_config(), implementation="context_parallel"))
            with pytest.raises(ValueError) as info:
                named.select_implementation(**call)
            return str(info.value)

        local = L.LocalAttention(HEADS, KEY_DIM, window=8)
        assert "not a multiple of 4" in refusal(local, query_length=66, key_length=66)
        assert "cross-attention" in refusal(local, use_causal_mask=False, key_length=32)
        assert "window's extent" in refusal(L.LocalAttention(HEADS, KEY_DIM, window=40))
        assert "lengths must be known" in refusal(local, query_length=None, key_length=None)
        assert "dropout" in refusal(L.LocalAttention(HEADS, KEY_DIM, window=8, dropout=0.1),
                                    training=True)
        # Causal ring attention cuts the sequence into 2 x 4 chunks.
        assert "not a multiple of 8" in refusal(L.FullAttention(HEADS, KEY_DIM),
                                                query_length=36, key_length=36)
        assert "attention_mask" in refusal(L.FullAttention(HEADS, KEY_DIM),
                                           attention_mask=True)
        assert "'fixed'" in refusal(L.SparseAttention(HEADS, KEY_DIM, pattern="fixed",
                                                      block_length=8))
        assert "multiple of the 4 devices" in refusal(
            L.SparseAttention(HEADS, KEY_DIM, block_length=2), query_length=16,
            key_length=16)
        assert "global_tokens=20" in refusal(
            L.LongformerAttention(HEADS, KEY_DIM, window=4, global_tokens=20))


def test_named_path_outside_context_parallel_is_refused():
    """On any backend: outside a ContextParallel (or off JAX) the named path
    refuses with its reason, and "auto" does not take it."""
    layer = L.FullAttention(HEADS, KEY_DIM, implementation="context_parallel")
    reason = ("no keras_longattn.parallel.ContextParallel" if keras.backend.backend() == "jax"
              else "JAX backend only")
    with pytest.raises(ValueError, match=reason):
        layer.select_implementation(query_length=T, key_length=T)
    assert L.FullAttention(HEADS, KEY_DIM).select_implementation(
        query_length=T, key_length=T) != "context_parallel"


def test_longformer_global_mask_is_refused(devices):
    layer, _ = _pair("longformer")
    x, mask = _inputs()
    global_mask = np.zeros((B, T), bool)
    global_mask[:, 0] = True
    with _distribution().scope():
        layer(x[:, :16], x[:, :16], global_mask=global_mask[:, :16])
    assert layer.last_implementation != "context_parallel"


def test_training_loss_curve_equals_one_device(devices):
    """A tiny causal language model with Local attention, 5 SGD steps,
    inputs split over batch (2) and sequence (4)."""
    length, batch, vocab = 32, 4, 32

    def build():
        return build_causal_language_model(
            vocab_size=vocab, sequence_length=length, dim=F, num_layers=1,
            attention=L.LocalAttention(HEADS, KEY_DIM, window=8), feedforward_dim=32)

    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(batch, length)).astype("int32")
    y = rng.integers(0, vocab, size=(batch, length)).astype("int32")
    keras.utils.set_random_seed(0)
    weights = build().get_weights()

    def run(distribution):
        scope = distribution.scope() if distribution is not None else contextlib.nullcontext()
        with scope:
            model = build()
            model.set_weights(weights)
            model.compile(optimizer=keras.optimizers.SGD(0.5),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            losses = [float(model.train_on_batch(x, y)) for _ in range(5)]
        attention = [layer for layer in model._flatten_layers()
                     if isinstance(layer, L.LocalAttention)]
        assert len(attention) == 1
        return losses, attention[0].last_implementation

    losses, ran = run(None)
    cp_losses, cp_ran = run(_distribution())
    assert ran != "context_parallel"
    assert cp_ran == "context_parallel"
    np.testing.assert_allclose(cp_losses, losses, atol=2e-4, rtol=1e-4)
    assert losses[-1] < losses[0] - 1e-2  # the steps trained the model
