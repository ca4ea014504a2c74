"""Unit tests of the Linformer notebook's functions that live in
``keras_longattn.reproductions.linformer``: the arms, the longer-trained
baseline's claims, and the spectrum of Figure 1 measured on a trained
model (a tiny one here)."""

import numpy as np
import pytest

import keras

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import linformer as lf

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

# A model trained once, on PyTorch: JAX runs the same code in the planted
# tests (tests/notebooks/test_planted_real.py) and the notebooks, on CI time.
trains = pytest.mark.skipif(keras.backend.backend() != "torch",
                            reason="trains a model: run once, on PyTorch")


def test_parity_arms():
    arms = lf.parity_arms([16, 32], 64)
    assert list(arms) == ["full", "k16", "k32", "k1"]
    assert arms["full"]["class_name"] == "FullAttention"
    assert arms["k16"]["config"] == dict(lf.HEADS, k=16, max_length=65)
    assert arms["k1"]["config"]["k"] == 1


def _long(full, k, spectrum=None):
    return {"accuracy": {"full": full, "k8": k},
            "spectrum": spectrum or [], "spectrum_init": spectrum or []}


def test_long_claims_are_reported_and_gated():
    margins = {"parity_margin": 5.0, "spectrum_min_share": 0.9}
    (claim,) = lf.long_claims(_long([80.0, 81.0], [79.0, 80.5]), margins, steps=450,
                              spectrum_k=4)
    assert claim.name == "long_parity_k8" and not claim.asserted
    assert claim.verdict == cl.REPRODUCED
    (claim,) = lf.long_claims(_long([70.0, 81.0], [79.0, 80.5]), margins, steps=450,
                              spectrum_k=4)
    assert claim.verdict == cl.NOT_TESTABLE  # spread 11 > margin 5
    (claim,) = lf.long_claims(_long([80.0], [60.0]), margins, steps=20, spectrum_k=4)
    assert claim.verdict == cl.NOT_TESTABLE  # one seed: no spread
    (claim,) = lf.long_claims(_long([80.0, 81.0], [60.0, 61.0]), margins, steps=450,
                              spectrum_k=4)
    assert claim.verdict == cl.NOT_REPRODUCED and not claim.failed


def test_long_claims_spectrum():
    # Curves (seeds, layers, heads, S): the share at index k is read.
    low = np.broadcast_to(np.minimum(1.0, np.arange(1, 9) / 2.0), (1, 2, 2, 8)).tolist()
    flat = np.broadcast_to(np.arange(1, 9) / 8.0, (1, 2, 2, 8)).tolist()
    margins = {"parity_margin": 5.0, "spectrum_min_share": 0.9}
    claims = {c.name: c for c in lf.long_claims(
        {**_long([80.0, 81.0], [80.0, 81.0]), "spectrum": low, "spectrum_init": flat},
        margins, steps=450, spectrum_k=2)}
    spectrum = claims["spectrum_low_rank"]
    assert spectrum.verdict == cl.REPRODUCED and not spectrum.asserted
    assert "initialisation 0.250" in spectrum.ours
    claims = {c.name: c for c in lf.long_claims(
        {**_long([80.0, 81.0], [80.0, 81.0]), "spectrum": flat, "spectrum_init": flat},
        margins, steps=450, spectrum_k=2)}
    assert claims["spectrum_low_rank"].verdict == cl.NOT_REPRODUCED


@trains
def test_long_baseline_measures_the_spectrum():
    # The notebook's section 4 on a tiny size: the full arm is trained
    # through a recording layer, and the spectrum of its attention matrices
    # is a cumulative share rising to 1, after training and at
    # initialisation.
    setup = lf.load_task("image", 16, train_examples=64, test_examples=32, steps=2,
                         batch_size=8, learning_rate=1e-3)
    arms = lf.parity_arms([4], 16)
    arms.pop("k1")
    long = lf.long_baseline(setup, arms, 1, model_config={"pooling": "cls", "num_layers": 1},
                            spectrum_examples=5, verbose=False)
    assert set(long["accuracy"]) == {"full", "k4"}
    assert all(0.0 <= a[0] <= 100.0 for a in long["accuracy"].values())
    for curves in (long["spectrum"], long["spectrum_init"]):
        curves = np.asarray(curves)
        assert curves.shape == (1, 1, lf.HEADS["num_heads"], 17)
        assert np.all(np.diff(curves, axis=-1) >= -1e-3)
        np.testing.assert_allclose(curves[..., -1], 1.0, atol=1e-3)
        assert 0.0 < lf.spectrum_at(curves[0], 4) <= 1.0


def test_spectrum_needs_a_recording_model():
    setup = lf.load_task("image", 16, train_examples=64, test_examples=32, steps=1,
                         batch_size=8, learning_rate=1e-3)
    _, model = lf.train_with_model(setup, {"class_name": "FullAttention",
                                           "config": dict(lf.HEADS)}, 0,
                                   model_config={"pooling": "cls", "num_layers": 1})
    with pytest.raises(ValueError, match="RecordingFullAttention"):
        lf.attention_spectrum(model, setup.data.x_test[:2])


def test_planted_self_only_attention_sees_only_itself():
    # The planted full-attention arm: each query's output depends on its
    # own position only.
    keras.utils.set_random_seed(0)
    layer = lf.SelfOnlyFullAttention(num_heads=2, key_dim=4)
    x = np.random.default_rng(0).normal(size=(1, 6, 8)).astype("float32")
    out = keras.ops.convert_to_numpy(layer(x, x))
    y = x.copy()
    y[:, 3:] = 0.0
    changed = keras.ops.convert_to_numpy(layer(y, y))
    np.testing.assert_allclose(out[:, :3], changed[:, :3], rtol=1e-5, atol=1e-6)
