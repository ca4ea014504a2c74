"""The model builders: shapes, causality, padding, patterns, saving, fit."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import BaseAttention
from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.models import AttentionSublayer
from keras_longattn.models import FeedForwardSublayer
from keras_longattn.models import build_causal_language_model
from keras_longattn.models import build_image_density_model
from keras_longattn.models import build_matching_model
from keras_longattn.models import build_sequence_classifier
from keras_longattn.models import build_sublayers
from keras_longattn.models import interleaved_pattern
from keras_longattn.models import sandwich_pattern

N, DIM, HEADS, VOCAB = 24, 16, 2, 30
SMALL = dict(dim=DIM, num_heads=HEADS)
LOCAL = {"class_name": "LocalAttention", "config": {"window": 6}}


def tokens(batch=2, seed=0, low=1, high=VOCAB, length=N):
    rng = np.random.default_rng(seed)
    return rng.integers(low, high, size=(batch, length)).astype("int32")


def padded_tokens():
    x = tokens()
    x[0, 15:] = 0
    x[1, 7:] = 0
    return x


def perturb_padding_row(layer):
    """Overwrites the embedding of token 0 (padding) with large values."""
    table = layer.embeddings
    new = to_np(table).copy()
    new[0] = np.random.default_rng(5).standard_normal(new.shape[1]) * 50.0
    table.assign(new)


def attention_layers(model):
    layers = []
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            layers += attention_layers(layer)
        elif isinstance(layer, AttentionSublayer):
            layers.append(layer.attention)
    return layers


@keras.saving.register_keras_serializable(package="keras_longattn_tests")
class ShortAttention(BaseAttention):
    """Dense attention that refuses sequences longer than ``max_length``."""

    def __init__(self, num_heads, key_dim, max_length=16, **kwargs):
        super().__init__(num_heads, key_dim, **kwargs)
        self.max_length = max_length

    def check_sequence_length(self, n):
        if n > self.max_length:
            raise ValueError(
                f"ShortAttention takes at most {self.max_length} positions. "
                f"Received: sequence_length={n}"
            )

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length}


# ---------------------------------------------------------------- fixtures
# One model of each kind per module (building is the slow part of these
# tests); tests that change weights restore them.
@pytest.fixture(scope="module")
def language_model():
    """Tied embeddings, rotary positions, local then full attention."""
    return build_causal_language_model(
        VOCAB, N, attention=[LOCAL, {"class_name": "FullAttention", "config": {}}],
        tie_embeddings=True, positions="rotary", **SMALL)


@pytest.fixture(scope="module", params=["mean", "cls"])
def classifier(request):
    # With a class token the attention sees n + 1 = N positions.
    length = N - 1 if request.param == "cls" else N
    return build_sequence_classifier(
        VOCAB, length, 3, attention=LOCAL, pooling=request.param,
        layer_pattern=sandwich_pattern(2, 1), **SMALL)


@pytest.fixture(scope="module")
def matching_model():
    return build_matching_model(VOCAB, N, attention=LOCAL, normalize_first=False,
                                **SMALL)


@pytest.fixture(scope="module")
def image_model():
    return build_image_density_model(4, N, attention=LOCAL, **SMALL)


# ------------------------------------------------------------------ shapes
def classifier_inputs(classifier):
    return padded_tokens()[:, : classifier.input_shape[1]]


def test_output_shapes(language_model, classifier, matching_model, image_model):
    assert tuple(language_model(tokens()).shape) == (2, N, VOCAB)
    assert tuple(classifier(classifier_inputs(classifier)).shape) == (2, 3)
    assert tuple(matching_model([padded_tokens(), tokens()]).shape) == (2, 2)
    assert tuple(image_model(tokens(high=4)).shape) == (2, N, 4)


def test_default_attention_is_local_window_128():
    # What the builders use when `attention` is None.
    layers = build_sublayers("sfsf", dim=DIM)
    attention = [l.attention for l in layers if isinstance(l, AttentionSublayer)]
    assert len(attention) == 2
    for layer in attention:
        assert isinstance(layer, LocalAttention)
        assert (layer.num_heads, layer.key_dim, layer.window) == (4, DIM // 4, 128)


def test_tied_rotary_language_model(language_model):
    untied = build_causal_language_model(VOCAB, N, attention=LOCAL, **SMALL)
    # No Dense head (DIM * VOCAB + VOCAB) and no position table (N * DIM).
    assert untied.count_params() - language_model.count_params() == (
        DIM * VOCAB + VOCAB + N * DIM)
    assert "logits" not in [l.name for l in language_model.layers]
    layers = attention_layers(language_model)
    assert [type(l) for l in layers] == [LocalAttention, FullAttention]
    assert all(l.rotary_max_wavelength == 10000.0 for l in layers)


# --------------------------------------------------------------- causality
def _check_causal(model):
    x = tokens()
    x2 = x.copy()
    cut = 11
    x2[:, cut:] = tokens(seed=9)[:, cut:]
    out1, out2 = to_np(model(x)), to_np(model(x2))
    np.testing.assert_allclose(out1[:, :cut], out2[:, :cut], atol=1e-5)
    assert np.abs(out1[:, cut:] - out2[:, cut:]).max() > 1e-4


def test_language_model_is_causal(language_model):
    _check_causal(language_model)


def test_image_model_predicts_pixel_i_from_pixels_before_i(image_model):
    x = tokens(high=4)
    cut = 9
    x2 = x.copy()
    x2[:, cut] = (x[:, cut] + 1) % 4  # change pixel `cut` only
    out1, out2 = to_np(image_model(x)), to_np(image_model(x2))
    # Logits up to and including position `cut` do not see pixel `cut`.
    np.testing.assert_allclose(out1[:, : cut + 1], out2[:, : cut + 1], atol=1e-5)
    assert np.abs(out1[:, cut + 1] - out2[:, cut + 1]).max() > 1e-4


# ----------------------------------------------------------------- padding
def _perturbed_padding(model, embedding, inputs):
    saved = to_np(embedding.embeddings).copy()
    before = to_np(model(inputs))
    try:
        perturb_padding_row(embedding)
        after = to_np(model(inputs))
    finally:
        embedding.embeddings.assign(saved)
    return before, after


def test_classifier_ignores_padded_positions(classifier):
    before, after = _perturbed_padding(
        classifier, classifier.get_layer("token_embedding"),
        classifier_inputs(classifier))
    np.testing.assert_allclose(after, before, atol=1e-5)


def test_matching_model_shares_its_encoder_and_ignores_padding(matching_model):
    encoder = matching_model.get_layer("encoder")
    assert len(attention_layers(matching_model)) == 2  # one shared encoder
    before, after = _perturbed_padding(
        matching_model, encoder.get_layer("token_embedding"),
        [padded_tokens(), tokens(seed=2)])
    np.testing.assert_allclose(after, before, atol=1e-5)


# ---------------------------------------------------------------- patterns
def test_sandwich_pattern_keeps_parameter_count():
    counts = {}
    for k in (0, 1, 3):
        model = build_causal_language_model(
            VOCAB, N, attention=LOCAL, layer_pattern=sandwich_pattern(3, k),
            **SMALL)
        counts[k] = model.count_params()
        kinds = "".join(
            "s" if isinstance(l, AttentionSublayer) else "f"
            for l in model.layers
            if isinstance(l, (AttentionSublayer, FeedForwardSublayer))
        )
        assert kinds == sandwich_pattern(3, k)
    assert counts[0] == counts[1] == counts[3]
    default = build_causal_language_model(VOCAB, N, num_layers=3, attention=LOCAL,
                                          **SMALL)
    assert default.count_params() == counts[0]
    assert "".join(
        "s" if isinstance(l, AttentionSublayer) else "f"
        for l in default.layers
        if isinstance(l, (AttentionSublayer, FeedForwardSublayer))
    ) == interleaved_pattern(3)


def test_per_layer_attention_list():
    full = FullAttention(num_heads=2, key_dim=8)
    model = build_sequence_classifier(
        VOCAB, N, 2, layer_pattern="sfsfsf",
        attention=[LOCAL, "LocalAttention", full], **SMALL)
    layers = attention_layers(model)
    assert [type(l) for l in layers] == [LocalAttention, LocalAttention, FullAttention]
    assert layers[0].window == 6 and layers[1].window == 128
    # Instances are templates: each sublayer gets a fresh clone.
    assert layers[2] is not full
    assert len({id(l) for l in layers}) == 3


def test_single_instance_is_cloned_per_sublayer():
    template = LocalAttention(num_heads=2, key_dim=8, window=5)
    model = build_causal_language_model(VOCAB, N, attention=template, **SMALL)
    layers = attention_layers(model)
    assert len({id(l) for l in layers}) == 2
    assert all(l is not template and l.window == 5 for l in layers)


# ------------------------------------------------------------------ saving
def _round_trip(model, inputs, tmp_path):
    expected = to_np(model(inputs))
    path = tmp_path / f"{model.name}.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_np(loaded(inputs)), expected, rtol=0, atol=1e-6)
    return loaded


def test_keras_round_trip_language_model(tmp_path, language_model):
    loaded = _round_trip(language_model, tokens(), tmp_path)
    layers = attention_layers(loaded)
    assert [type(l) for l in layers] == [LocalAttention, FullAttention]
    assert all(l.rotary_max_wavelength == 10000.0 for l in layers)


def test_keras_round_trip_classifier(tmp_path, classifier):
    _round_trip(classifier, classifier_inputs(classifier), tmp_path)


def test_keras_round_trip_matching(tmp_path, matching_model):
    _round_trip(matching_model, [padded_tokens(), tokens()], tmp_path)


def test_keras_round_trip_image(tmp_path, image_model):
    _round_trip(image_model, tokens(high=4), tmp_path)


# --------------------------------------------------------------------- fit
def test_two_step_fit_has_finite_loss():
    model = build_causal_language_model(VOCAB, N, num_layers=1, attention=LOCAL,
                                        dropout=0.1, **SMALL)
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    seq = tokens(batch=4, length=N + 1)
    history = model.fit(seq[:, :-1], seq[:, 1:], batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])


# -------------------------------------------------------------- positions
def test_rotary_positions_without_fixed_length():
    lm = build_causal_language_model(VOCAB, None, attention=LOCAL,
                                     positions="rotary", **SMALL)
    assert not any(l.name == "position_embedding" for l in lm.layers)
    assert tuple(lm(tokens()).shape) == (2, N, VOCAB)


def test_rotary_refused_by_odd_key_dim():
    odd = {"class_name": "LocalAttention",
           "config": {"num_heads": 2, "key_dim": 7, "window": 4}}
    with pytest.raises(ValueError, match="positions='rotary'"):
        build_causal_language_model(VOCAB, N, attention=odd, positions="rotary",
                                    **SMALL)
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    with pytest.raises(ValueError, match="positions='rotary'.*MultiHeadAttention"):
        build_causal_language_model(VOCAB, N, attention=mha, positions="rotary",
                                    **SMALL)


# -------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "builder, kwargs, pattern",
    [
        (build_causal_language_model, dict(layer_pattern="ff"), r"layer_pattern='ff'"),
        (build_causal_language_model, dict(layer_pattern="sfx"), r"layer_pattern='sfx'"),
        (build_causal_language_model, dict(vocab_size=1), r"vocab_size=1"),
        (build_causal_language_model, dict(dim=18), r"dim=18, num_heads=4"),
        (build_causal_language_model, dict(positions="sinusoidal"),
         r"positions='sinusoidal'"),
        (build_causal_language_model, dict(num_layers=3, layer_pattern="sfsf"),
         r"num_layers=3"),
        (build_causal_language_model, dict(num_layers=0), r"num_layers=0"),
        (build_causal_language_model, dict(sequence_length=None), r"sequence_length"),
        (build_causal_language_model, dict(dropout=1.5), r"dropout=1.5"),
        (build_causal_language_model, dict(attention=[LOCAL] * 3),
         r"attention with 3 entries"),
        (build_causal_language_model, dict(attention=lambda i: LOCAL), r"attention"),
        (build_causal_language_model,
         dict(attention={"class_name": "NoSuchAttention", "config": {}}),
         r"NoSuchAttention"),
        (build_sequence_classifier, dict(num_classes=1), r"num_classes=1"),
        (build_sequence_classifier, dict(pooling="max"), r"pooling='max'"),
        (build_matching_model, dict(num_classes=1), r"num_classes=1"),
        (build_image_density_model, dict(levels=1), r"levels=1"),
        (build_image_density_model, dict(layer_pattern="ff"), r"layer_pattern='ff'"),
    ],
)
def test_bad_arguments_are_refused(builder, kwargs, pattern):
    args = {"vocab_size": VOCAB, "sequence_length": N}
    if builder is build_sequence_classifier:
        args["num_classes"] = 2
    if builder is build_image_density_model:
        args = {"levels": 4, "sequence_length": N}
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        builder(**args)


def test_same_instance_twice_in_list_is_refused():
    layer = LocalAttention(num_heads=2, key_dim=8, window=4)
    with pytest.raises(ValueError, match=r"attention\[0\] and attention\[1\]"):
        build_causal_language_model(VOCAB, N, attention=[layer, layer], **SMALL)


def test_check_sequence_length_hook():
    short = keras.saving.serialize_keras_object(ShortAttention(2, 8, max_length=N))
    # Fits as is ...
    build_sequence_classifier(VOCAB, N, 2, attention=short, **SMALL)
    # ... but not with the class token (n + 1 positions) nor a longer input.
    with pytest.raises(ValueError, match=f"sequence_length={N + 1}"):
        build_sequence_classifier(VOCAB, N, 2, attention=short, pooling="cls",
                                  **SMALL)
    with pytest.raises(ValueError, match=f"sequence_length={N + 8}"):
        build_causal_language_model(VOCAB, N + 8, attention=short, **SMALL)


def test_short_config_of_a_keras_layer_is_accepted():
    """``{"class_name": "MultiHeadAttention", "config": {...}}`` (no
    ``module`` entry, the form of the benchmark's ``mha`` entry and of the
    LRA suite's layers) gives keras.layers.MultiHeadAttention."""
    from keras_longattn.models._attention_config import deserialize_attention

    layer = deserialize_attention({"class_name": "MultiHeadAttention",
                                   "config": {"num_heads": 2, "key_dim": 8}})
    assert type(layer) is keras.layers.MultiHeadAttention
    assert layer.num_heads == 2
    with pytest.raises(ValueError, match="could not be turned into a layer"):
        deserialize_attention({"class_name": "NoSuchAttention", "config": {}})
    with pytest.raises(ValueError, match="could not be turned into a layer"):
        deserialize_attention({"class_name": "Dense", "config": {"units": 2, "bogus": 1}})
