"""keras-hub backbones converted to our attention (keras_longattn.hub).

For GPT-2, Llama and Mistral (grouped-query attention, rotary positions),
BERT and RoBERTa, built from tiny configs (no downloads) with random weights:
the converted backbone equals the original where the pattern covers the
whole input (padded inputs, compared at the real positions), differs with a
real window, extends learned positions by repeating the trained table, saves
and loads as ``.keras``. The converted decoders generate with keras-hub's
``generate`` (compiled by keras-hub: ``jax.jit`` on JAX,
``tf.function(jit_compile=True)`` on TensorFlow) through our caches the
tokens of the original model (Mistral's band against LocalAttention's ring),
and with a real window the tokens of a loop that re-runs the converted model.
Bad inputs are ValueErrors naming the argument.
"""

import importlib
import sys

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import keras  # noqa: E402
from keras import ops  # noqa: E402

from keras_longattn import hub  # noqa: E402

# keras-hub's tasks override compile(): Keras warns on loading any of them.
pytestmark = pytest.mark.filterwarnings("ignore:`compile\\(\\)` was not called")

VOCAB, HIDDEN, HEADS, LENGTH, MAX_LEN = 120, 32, 4, 12, 16

FULL_WINDOW = {"class_name": "LocalAttention", "config": {"window": 64}}
SMALL_WINDOW = {"class_name": "LocalAttention", "config": {"window": 3}}


def _randomized(backbone, seed=0):
    """``backbone`` with weights of N(0, 0.3) (norm scales 1 + N(0, 0.3)):
    keras-hub's initializers (std 0.02) make every attention nearly uniform,
    under which a wrong mask or rotary position changes little."""
    rng = np.random.default_rng(seed)
    for variable in backbone.weights:
        base = 1.0 if variable.path.endswith(("gamma", "scale")) else 0.0
        variable.assign((base + rng.normal(0.0, 0.3, variable.shape)).astype("float32"))
    return backbone


def _gpt2():
    return _randomized(keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=HEADS, hidden_dim=HIDDEN,
        intermediate_dim=64, max_sequence_length=MAX_LEN, dropout=0.0))


def _llama(**kwargs):
    return _randomized(keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=HEADS, num_key_value_heads=2,
        hidden_dim=HIDDEN, intermediate_dim=64, rope_max_wavelength=500, **kwargs))


def _mistral(sliding_window=64, **kwargs):
    return _randomized(keras_hub.models.MistralBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=HEADS, num_key_value_heads=2,
        hidden_dim=HIDDEN, intermediate_dim=64, rope_max_wavelength=500,
        sliding_window=sliding_window, **kwargs))


def _roberta():
    return _randomized(keras_hub.models.RobertaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=HEADS, hidden_dim=HIDDEN,
        intermediate_dim=64, max_sequence_length=MAX_LEN, dropout=0.0))


def _bert():
    return _randomized(keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=HEADS, hidden_dim=HIDDEN,
        intermediate_dim=64, max_sequence_length=MAX_LEN, dropout=0.0))


BUILDERS = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "bert": _bert,
            "roberta": _roberta}


@pytest.fixture(scope="module")
def backbones():
    keras.utils.set_random_seed(0)
    return {name: build() for name, build in BUILDERS.items()}


def _inputs(name, length=LENGTH):
    """Two rows: one right-padded, one left-padded (in a causal decoder,
    left padding is the padding that real queries would see)."""
    rng = np.random.default_rng(1)
    padding = np.ones((2, length), "int32")
    padding[0, length - 4:] = 0
    padding[1, :3] = 0
    x = {"token_ids": rng.integers(1, VOCAB, (2, length)).astype("int32"),
         "padding_mask": padding}
    if name == "bert":
        x["segment_ids"] = (np.arange(length)[None] >= length // 2).astype("int32").repeat(2, 0)
    return x


def _outputs(backbone, x):
    out = backbone(x)
    if isinstance(out, dict):
        return {k: ops.convert_to_numpy(v) for k, v in out.items()}
    return {"sequence_output": ops.convert_to_numpy(out)}


def _max_difference(a, b, x=None):
    """The largest difference of the outputs ``a`` and ``b``; with the
    inputs ``x``, sequence outputs at real (unpadded) positions only: a
    padded query that sees no key (the left-padded start of a causal row)
    gets an arbitrary output from keras-hub and zero attention from ours."""
    real = None if x is None else x["padding_mask"] == 1
    return max(
        float(np.max(np.abs(a[k] - b[k] if real is None or a[k].ndim != 3
                            else a[k][real] - b[k][real])))
        for k in a)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_covering_pattern_equals_the_original(backbones, name):
    original = backbones[name]
    attention = {"class_name": "FullAttention"} if name == "llama" else FULL_WINDOW
    converted = hub.longify(original, attention)
    assert type(converted).__name__ == "Long" + type(original).__name__
    assert isinstance(converted, type(original))
    x = _inputs(name)
    causal = name in ("gpt2", "llama", "mistral")
    assert _max_difference(_outputs(original, x), _outputs(converted, x),
                           x if causal else None) < 1e-4
    # The padding reaches our layer: without it the real queries differ.
    unpadded = dict(x, padding_mask=np.ones_like(x["padding_mask"]))
    assert _max_difference(_outputs(original, x), _outputs(converted, unpadded), x) > 1e-2
    for block in converted.transformer_layers:
        layer = block._self_attention_layer
        assert type(layer).__name__ == attention["class_name"]
        assert layer.last_implementation not in (None, "reference")
    # The original keeps its own attention and weights.
    assert not type(original.transformer_layers[0]._self_attention_layer).__module__.startswith(
        "keras_longattn")


def test_llama_local_window_covering_equals_the_original(backbones):
    """Grouped-query heads and rotary positions carried into LocalAttention."""
    original = backbones["llama"]
    converted = hub.longify(original, FULL_WINDOW)
    layer = converted.transformer_layers[0]._self_attention_layer
    heads = (layer.num_heads, layer.num_key_value_heads, layer.key_dim)
    assert heads == (HEADS, 2, HIDDEN // HEADS)
    assert layer.rotary_max_wavelength == 500 and not layer.use_bias
    x = _inputs("llama")
    assert _max_difference(_outputs(original, x), _outputs(converted, x), x) < 1e-4


def test_mistral_sliding_window_is_local_attention_with_that_window():
    """Mistral's band (query i sees keys i - 4 < j <= i) is LocalAttention's
    window 4, with a head size other than hidden_dim / heads; windows 3 and
    5 differ. Compared at real positions: keras-hub gives a padded query
    that sees no key an arbitrary output, ours zero attention."""
    keras.utils.set_random_seed(3)
    original = _mistral(sliding_window=4, head_dim=16)
    x = _inputs("mistral")
    real = x["padding_mask"] == 1
    expected = _outputs(original, x)["sequence_output"][real]
    for window, same in ((4, True), (3, False), (5, False)):
        converted = hub.longify(original, {"class_name": "LocalAttention",
                                           "config": {"window": window}})
        assert converted.transformer_layers[0]._self_attention_layer.key_dim == 16
        difference = np.max(np.abs(_outputs(converted, x)["sequence_output"][real] - expected))
        assert (difference < 1e-4) == same, (window, difference)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_real_window_changes_the_outputs(backbones, name):
    original = backbones[name]
    x = _inputs(name)
    converted = hub.longify(original, SMALL_WINDOW)
    assert _max_difference(_outputs(original, x), _outputs(converted, x), x) > 1e-2


def _position_table(backbone):
    layer = getattr(backbone, "position_embedding", None)
    if layer is None:  # RoBERTa: inside TokenAndPositionEmbedding.
        layer = backbone.embeddings.position_embedding
    return ops.convert_to_numpy(layer.position_embeddings)


@pytest.mark.parametrize("name", ["gpt2", "bert", "roberta"])
def test_learned_positions_are_extended_by_repeating_the_table(backbones, name):
    original = backbones[name]
    converted = hub.longify(original, {"class_name": "LocalAttention", "config": {"window": 5}},
                            max_sequence_length=40)
    assert converted.max_sequence_length == 40
    old, new = _position_table(original), _position_table(converted)
    assert new.shape == (40, HIDDEN)
    for i in (0, 5, 15, 16, 17, 31, 39):
        np.testing.assert_array_equal(new[i], old[i % MAX_LEN])
    # The extended model runs past the trained length.
    out = _outputs(converted, _inputs(name, length=40))["sequence_output"]
    assert out.shape == (2, 40, HIDDEN) and np.all(np.isfinite(out))


def test_longformer_global_projections_start_as_the_local_ones(backbones):
    """The Longformer recipe on RoBERTa: global projections copied from the
    local ones, so a covering window with a global first token equals the
    original; weights our layer adds elsewhere keep their initialization."""
    original = backbones["roberta"]
    converted = hub.longify(
        original, {"class_name": "LongformerAttention",
                   "config": {"window": 32, "global_tokens": 1}}, max_sequence_length=64)
    layer = converted.transformer_layers[0]._self_attention_layer
    for name in ("query", "key", "value"):
        local = getattr(layer, f"_{name}_dense").weights
        projected = getattr(layer, f"_{name}_global_dense").weights
        for a, b in zip(local, projected, strict=True):
            np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    x = _inputs("roberta")
    assert _max_difference(_outputs(original, x), _outputs(converted, x), x) < 1e-4
    routed = hub.longify(original, {"class_name": "RoutingAttention",
                                    "config": {"num_clusters": 2, "window": 4}})
    assert np.all(np.isfinite(_outputs(routed, x)["sequence_output"]))


def test_other_weights_are_carried_over_unchanged(backbones):
    original = backbones["gpt2"]
    converted = hub.longify(original, SMALL_WINDOW, max_sequence_length=32)
    old = {v.path: ops.convert_to_numpy(v) for v in original.weights}
    assert len(old) == len(converted.weights)
    for v in converted.weights:
        if v.path != "position_embedding/embeddings":
            np.testing.assert_array_equal(ops.convert_to_numpy(v), old[v.path])


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_keras_round_trip(backbones, name, tmp_path):
    attention = {"class_name": "LocalAttention", "config": {"window": 5}}
    converted = hub.longify(backbones[name], attention)
    path = str(tmp_path / f"{name}.keras")
    converted.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded) is type(converted)
    assert loaded.attention == attention
    assert loaded.transformer_layers[1].attention == attention
    x = _inputs(name)
    assert _max_difference(_outputs(converted, x), _outputs(loaded, x)) == 0.0


def test_tied_llama_embeddings_convert():
    """LlamaBackbone's config leaves out tie_word_embeddings: the converter
    keeps it (a tied table has no separate output projection)."""
    tied = _llama(tie_word_embeddings=True)
    converted = hub.longify(tied, FULL_WINDOW)
    assert converted.tie_word_embeddings and len(converted.weights) == len(tied.weights)
    assert hub.longify(converted, FULL_WINDOW).tie_word_embeddings


def test_a_converted_backbone_converts_again(backbones):
    original = backbones["gpt2"]
    once = hub.longify(original, SMALL_WINDOW)
    twice = hub.longify(once, FULL_WINDOW, max_sequence_length=24)
    x = _inputs("gpt2")
    assert _max_difference(_outputs(original, x), _outputs(twice, x), x) < 1e-4


# ------------------------------------------------------------------- errors
def test_without_keras_hub_the_module_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub.src.models.backbone", None)  # import fails
    for name in [m for m in sys.modules if m == "keras_longattn.hub"
                 or m.startswith("keras_longattn.hub.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install keras-longattn\[hub\]"):
        importlib.import_module("keras_longattn.hub")


def test_unsupported_backbone_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="`backbone` must be one of .*Sequential"):
        hub.longify(model, FULL_WINDOW)


@pytest.mark.parametrize(
    "attention, match",
    [
        ({"class_name": "Dense", "config": {"units": 4}}, r"attention\['class_name'\].*'Dense'"),
        ({"class_name": "BaseAttention"}, r"attention\['class_name'\]"),
        ("LocalAttention", "`attention` must be a Keras layer config"),
        ({"config": {"window": 4}}, "`attention` must be a Keras layer config"),
        ({"class_name": "LocalAttention", "config": {"window": 4, "num_heads": 2}},
         "may not set num_heads"),
        ({"class_name": "LocalAttention", "config": [4]}, r"attention\['config'\]"),
    ],
)
def test_bad_attention_config_is_refused(backbones, attention, match):
    with pytest.raises(ValueError, match=match):
        hub.longify(backbones["gpt2"], attention)


def test_a_shorter_length_is_refused(backbones):
    with pytest.raises(ValueError, match=r"`max_sequence_length`.*\(16\).*=8"):
        hub.longify(backbones["bert"], FULL_WINDOW, max_sequence_length=8)
    with pytest.raises(ValueError, match="`max_sequence_length`.*=20.0"):
        hub.longify(backbones["gpt2"], FULL_WINDOW, max_sequence_length=20.0)
    with pytest.raises(ValueError, match="rotary positions.*max_sequence_length=64"):
        hub.longify(backbones["llama"], FULL_WINDOW, max_sequence_length=64)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: _llama(rope_frequency_adjustment_factor=8.0, rope_low_freq_factor=1.0,
                        rope_high_freq_factor=4.0, rope_pretraining_sequence_length=16),
         "rope_frequency_adjustment_factor=8.0"),
        (lambda: _mistral(rope_scaling_factor=4.0), "rope_scaling_factor=4.0"),
    ],
    ids=["llama3_frequencies", "mistral_scaling"],
)
def test_rotary_our_layers_cannot_reproduce_is_refused(build, match):
    with pytest.raises(ValueError, match="rotary embedding differs.*" + match):
        hub.longify(build(), FULL_WINDOW)


def test_dense_masks_never_reach_our_layer(backbones):
    converted = hub.longify(backbones["gpt2"], SMALL_WINDOW)
    block = converted.transformer_layers[0]
    x = np.zeros((1, 4, HIDDEN), "float32")
    with pytest.raises(ValueError, match="decoder_attention_mask with shape"):
        block(x, decoder_attention_mask=np.ones((1, 4, 4), "int32"))


# --------------------------------------------------------------- generation
def _prompts(length=16):
    rng = np.random.default_rng(2)
    token_ids = np.zeros((2, length), "int32")
    token_ids[:, :5] = rng.integers(1, VOCAB, (2, 5))
    padding_mask = np.zeros((2, length), bool)
    padding_mask[0, :5] = True
    padding_mask[1, :3] = True  # ragged prompts
    return {"token_ids": token_ids, "padding_mask": padding_mask}


def _greedy(task):
    task.compile(sampler="greedy")
    return task


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generation_through_our_caches_equals_the_original(backbones, name):
    original = backbones[name]
    hub_task = {"gpt2": keras_hub.models.GPT2CausalLM,
                "llama": keras_hub.models.LlamaCausalLM}[name]
    long_task = {"gpt2": hub.LongGPT2CausalLM, "llama": hub.LongLlamaCausalLM}[name]
    expected = _greedy(hub_task(backbone=original, preprocessor=None)).generate(
        _prompts(), stop_token_ids=None)
    converted = hub.longify(original, {"class_name": "LocalAttention", "config": {"window": 16}})
    task = _greedy(long_task(backbone=converted, preprocessor=None))
    got = task.generate(_prompts(), stop_token_ids=None)
    np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])
    # The Local cache is a ring of the window, not keras-hub's full length.
    layer = converted.transformer_layers[0]._self_attention_layer
    assert tuple(task._build_cache(ops.zeros((2, 40), "int32")).shape) == (
        2, 2, 2, 15, layer.num_key_value_heads, HIDDEN // HEADS)
    assert layer.last_implementation == "decode"


def test_beam_search_through_our_caches_equals_the_original(backbones):
    """keras-hub's BeamSampler repeats our caches per beam."""
    original = backbones["gpt2"]
    expected = keras_hub.models.GPT2CausalLM(backbone=original, preprocessor=None)
    expected.compile(sampler=keras_hub.samplers.BeamSampler(num_beams=2))
    converted = hub.longify(original, {"class_name": "LocalAttention", "config": {"window": 16}})
    task = hub.LongGPT2CausalLM(backbone=converted, preprocessor=None)
    task.compile(sampler=keras_hub.samplers.BeamSampler(num_beams=2))
    prompts = _prompts(length=12)
    np.testing.assert_array_equal(
        task.generate(prompts, stop_token_ids=None)["token_ids"],
        expected.generate(prompts, stop_token_ids=None)["token_ids"])


def test_mistral_generation_with_its_band_equals_the_original():
    """Mistral's sliding window of 4 through keras-hub's full cache and band
    mask against LocalAttention's ring of 3 positions, past the window."""
    original = _mistral(sliding_window=4)
    reference = _greedy(keras_hub.models.MistralCausalLM(backbone=original, preprocessor=None))
    converted = hub.longify(original, {"class_name": "LocalAttention", "config": {"window": 4}})
    task = _greedy(hub.LongMistralCausalLM(backbone=converted, preprocessor=None))
    expected = reference.generate(_prompts(), stop_token_ids=None)
    got = task.generate(_prompts(), stop_token_ids=None)
    np.testing.assert_array_equal(got["token_ids"], expected["token_ids"])
    # A stop token: the same tokens and the same mask of what was generated.
    stop = (int(expected["token_ids"][0, 9]),)
    expected = reference.generate(_prompts(), stop_token_ids=stop)
    got = task.generate(_prompts(), stop_token_ids=stop)
    np.testing.assert_array_equal(got["padding_mask"], expected["padding_mask"])
    assert not got["padding_mask"][0, 10:].any()


def test_generation_with_a_real_window_equals_rerunning_the_model(backbones):
    converted = hub.longify(backbones["gpt2"], {"class_name": "LocalAttention",
                                               "config": {"window": 4}})
    task = _greedy(hub.LongGPT2CausalLM(backbone=converted, preprocessor=None))
    prompts = _prompts(length=12)
    got = task.generate(prompts, stop_token_ids=None)["token_ids"]
    # Greedy by hand: the whole sequence through the model for each token.
    tokens = prompts["token_ids"].copy()
    lengths = prompts["padding_mask"].sum(axis=1)
    for position in range(int(lengths.min()), tokens.shape[1]):
        logits = ops.convert_to_numpy(task({"token_ids": tokens,
                                            "padding_mask": np.ones_like(tokens)}))
        choice = logits[:, position - 1].argmax(axis=-1)
        keep = position < lengths
        tokens[:, position] = np.where(keep, tokens[:, position], choice)
    np.testing.assert_array_equal(got, tokens)


def test_generation_round_trips_through_keras(backbones, tmp_path):
    converted = hub.longify(backbones["llama"], {"class_name": "LocalAttention",
                                                "config": {"window": 4}})
    task = _greedy(hub.LongLlamaCausalLM(backbone=converted, preprocessor=None))
    expected = task.generate(_prompts(), stop_token_ids=None)["token_ids"]
    path = str(tmp_path / "llama_lm.keras")
    task.save(path)
    loaded = _greedy(keras.saving.load_model(path))
    assert type(loaded) is hub.LongLlamaCausalLM
    np.testing.assert_array_equal(
        loaded.generate(_prompts(), stop_token_ids=None)["token_ids"], expected)
