"""MLM, PLM and MPNet pre-training models on one encoder: each trains with
``fit`` on every backend; what a prediction may depend on, by perturbation
through the whole model (its own and later predicted tokens never; the
positions of later predicted tokens only with MPNet's position
compensation); saving; bad arguments."""

import keras
import numpy as np
import pytest

from keras_longattn.models import permute_for_prediction
from keras_longattn.models.mpnet import build_pretraining_model

V, N = 32, 12


def _batch(seed=0, batch=4):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V - 1, size=(batch, N))
    data = permute_for_prediction(tokens, 0.25, seed=seed)
    return {"tokens": data["tokens"].astype("int32"),
            "positions": data["positions"].astype("int32")}, data["num_predicted"]


def _model(objective):
    keras.utils.set_random_seed(0)
    return build_pretraining_model(V, N, dim=16, num_layers=2, num_heads=2,
                                   objective=objective, predict_ratio=0.25)


def _logits(model, inputs):
    return keras.ops.convert_to_numpy(model(inputs))


@pytest.mark.parametrize("objective", ["mlm", "plm", "mpnet"])
def test_a_prediction_never_sees_its_own_or_later_predicted_tokens(objective):
    model = _model(objective)
    inputs, b = _batch()
    assert model.num_predicted == b == 3
    base = _logits(model, inputs)
    assert base.shape == (4, b, V)
    for t in range(b):
        changed = {**inputs, "tokens": inputs["tokens"].copy()}
        changed["tokens"][:, N - b + t] = (changed["tokens"][:, N - b + t] + 5) % (V - 1)
        moved = _logits(model, changed)
        # rows up to t never see token t (MLM: no row sees any predicted token)
        rows = slice(0, b) if objective == "mlm" else slice(0, t + 1)
        np.testing.assert_allclose(moved[:, rows], base[:, rows], atol=1e-5, rtol=0)
        if objective != "mlm" and t < b - 1:  # later rows see it
            assert np.abs(moved[:, t + 1:] - base[:, t + 1:]).max() > 1e-4


@pytest.mark.parametrize("objective,compensated", [("plm", False), ("mpnet", True)])
def test_position_compensation(objective, compensated):
    """With MPNet the first prediction knows where the later predicted
    tokens sit; with PLM it does not."""
    model = _model(objective)
    inputs, b = _batch(1)
    base = _logits(model, inputs)
    changed = {**inputs, "positions": inputs["positions"].copy()}
    changed["positions"][:, -1] = (changed["positions"][:, -1] + 3) % N
    moved = _logits(model, changed)
    difference = np.abs(moved[:, 0] - base[:, 0]).max()
    if compensated:
        assert difference > 1e-4
    else:
        assert difference < 1e-5


@pytest.mark.parametrize("objective", ["mlm", "plm", "mpnet"])
def test_fit_lowers_the_loss(objective):
    model = _model(objective)
    # One fixed sentence in many permutations: learnable in a few steps.
    sentence = np.arange(N)[None] % (V - 1)
    tokens = np.repeat(sentence, 64, axis=0)
    data = permute_for_prediction(tokens, 0.25, seed=3)
    x = {"tokens": data["tokens"].astype("int32"), "positions": data["positions"].astype("int32")}
    y = data["tokens"][:, -data["num_predicted"]:].astype("int32")
    model.compile(keras.optimizers.Adam(1e-2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=16, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses


def test_encoder_and_saving(tmp_path):
    model = _model("mpnet")
    inputs, _ = _batch()
    encoded = keras.ops.convert_to_numpy(model.encode(inputs["tokens"]))
    assert encoded.shape == (4, N, 16)
    path = tmp_path / "mpnet.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(_logits(loaded, inputs), _logits(model, inputs), atol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="objective"):
        build_pretraining_model(V, N, objective="clm")
    with pytest.raises(ValueError, match="predict_ratio"):
        build_pretraining_model(V, N, predict_ratio=0.0)
    with pytest.raises(ValueError, match="mask_token_id"):
        build_pretraining_model(V, N, mask_token_id=V)
    with pytest.raises(ValueError, match="attention_mask"):
        build_pretraining_model(V, N, attention={"class_name": "LocalAttention",
                                                 "config": {"num_heads": 2, "key_dim": 8,
                                                            "window": 4}})


@pytest.mark.parametrize("objective", ["mlm", "plm", "mpnet"])
def test_more_tokens_than_the_position_table_are_refused(objective):
    """More tokens than the model was built for: NaN logits on JAX, raw
    index errors on torch and TensorFlow, before the check; now a
    ValueError naming the input, its length and the maximum."""
    model = build_pretraining_model(V, N, dim=16, num_layers=1, num_heads=2,
                                    objective=objective, predict_ratio=0.25)
    long = N + 4
    inputs = {"tokens": np.zeros((2, long), "int32"),
              "positions": np.tile(np.arange(long, dtype="int32"), (2, 1))}
    with pytest.raises(ValueError, match=rf"`tokens` must hold at most {N} tokens"
                                         rf".*Received: tokens of length {long}"):
        model(inputs)
    with pytest.raises(ValueError, match=rf"`positions` must hold at most {N} tokens"
                                         rf".*Received: positions of length {long}"):
        model({"tokens": inputs["tokens"][:, :N], "positions": inputs["positions"]})
    with pytest.raises(ValueError, match=rf"`tokens` must hold at most {N} tokens"):
        model.encode(inputs["tokens"][:, : N + 1])
    # Under jax.jit (static shapes), the same error while tracing.
    if keras.config.backend() == "jax":
        import jax

        with pytest.raises(ValueError, match=rf"`tokens` must hold at most {N}"):
            jax.jit(lambda x: model(x))(inputs)
