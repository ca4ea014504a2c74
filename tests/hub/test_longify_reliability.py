"""Reliability of keras_longattn.hub (issue #45): conversions that used to
fail late or silently.

* grouped-query Llama and Mistral convert to ``LongformerAttention``: its
  global key/value projections (one per query head) start as the local
  key/value heads repeated over their groups, so a covering window with a
  global token equals the original;
* an attention without a causal mode is refused by ``longify`` for a
  decoder, up front;
* ``LongGPT2CausalLM.generate`` past the (extended) position table is
  refused before generating (keras-hub clamps the positions on JAX, torch
  fails with a raw index error);
* the converted tasks' ``call_with_cache`` refuses float ids, ids outside
  the vocabulary and positions past the table (the decoding properties of
  :mod:`keras_longattn.testing.model_properties`), and ``generate`` prompts
  outside the vocabulary.

Tiny backbones (one or two layers, width 16, vocabulary 32).
"""

import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

import keras  # noqa: E402
from keras import ops  # noqa: E402

from keras_longattn import hub  # noqa: E402
from keras_longattn.testing.model_properties import CausalModelDecodingProperties  # noqa: E402

# keras-hub's tasks override compile(): Keras warns on loading any of them.
pytestmark = pytest.mark.filterwarnings("ignore:`compile\\(\\)` was not called")

VOCAB, HIDDEN, HEADS, KV_HEADS, TABLE = 32, 16, 4, 2, 12


def _randomized(backbone, seed=0):
    """Weights of N(0, 0.3) (norm scales 1 + N(0, 0.3)), so that attention
    is far from uniform and a wrong projection shows."""
    rng = np.random.default_rng(seed)
    for variable in backbone.weights:
        base = 1.0 if variable.path.endswith(("gamma", "scale")) else 0.0
        variable.assign((base + rng.normal(0.0, 0.3, variable.shape)).astype("float32"))
    return backbone


def _gpt2(num_layers=1):
    return _randomized(keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=num_layers, num_heads=2, hidden_dim=HIDDEN,
        intermediate_dim=32, max_sequence_length=8, dropout=0.0))


def _llama(num_layers=1):
    return _randomized(keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=num_layers, num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS, hidden_dim=HIDDEN, intermediate_dim=32,
        rope_max_wavelength=500))


def _mistral(num_layers=1):
    return _randomized(keras_hub.models.MistralBackbone(
        vocabulary_size=VOCAB, num_layers=num_layers, num_query_heads=HEADS,
        num_key_value_heads=KV_HEADS, hidden_dim=HIDDEN, intermediate_dim=32,
        rope_max_wavelength=500, sliding_window=64))


def _bert():
    return _randomized(keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=HIDDEN,
        intermediate_dim=32, max_sequence_length=8, dropout=0.0))


def _inputs(length=10, seed=1):
    rng = np.random.default_rng(seed)
    padding = np.ones((2, length), "int32")
    padding[0, length - 3:] = 0  # right padding
    return {"token_ids": rng.integers(1, VOCAB, (2, length)).astype("int32"),
            "padding_mask": padding}


def _real_difference(a, b, x):
    real = x["padding_mask"] == 1
    a, b = ops.convert_to_numpy(a(x)), ops.convert_to_numpy(b(x))
    return float(np.max(np.abs(a[real] - b[real])))


LONGFORMER = {"class_name": "LongformerAttention", "config": {"window": 32, "global_tokens": 1}}


# ------------------------------------------- grouped-query to Longformer
@pytest.mark.parametrize("build", [_llama, _mistral], ids=["llama", "mistral"])
def test_grouped_query_backbone_converts_to_longformer(build):
    """The global key/value projections hold a copy of each key/value head
    per query head of its group; a covering window with a global token
    equals the original."""
    keras.utils.set_random_seed(0)
    original = build()
    converted = hub.longify(original, LONGFORMER)
    layer = converted.transformer_layers[0]._self_attention_layer
    assert (layer.num_heads, layer.num_key_value_heads) == (HEADS, KV_HEADS)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(layer._query_global_dense.kernel),
        ops.convert_to_numpy(layer._query_dense.kernel))
    for name in ("key", "value"):
        local = ops.convert_to_numpy(getattr(layer, f"_{name}_dense").kernel)
        projected = ops.convert_to_numpy(getattr(layer, f"_{name}_global_dense").kernel)
        assert local.shape[1] == KV_HEADS and projected.shape[1] == HEADS
        np.testing.assert_array_equal(projected, np.repeat(local, HEADS // KV_HEADS, axis=1))
    x = _inputs()
    assert _real_difference(original, converted, x) < 1e-4


def test_grouped_query_longformer_generates_the_original_tokens():
    """Generation through Longformer's cache, global token included."""
    keras.utils.set_random_seed(0)
    original = _llama()
    reference = keras_hub.models.LlamaCausalLM(backbone=original, preprocessor=None)
    reference.compile(sampler="greedy")
    task = hub.LongLlamaCausalLM(backbone=hub.longify(original, LONGFORMER),
                                 preprocessor=None)
    task.compile(sampler="greedy")
    prompts = {"token_ids": np.zeros((2, 10), "int32"), "padding_mask": np.zeros((2, 10), bool)}
    prompts["token_ids"][:, :4] = np.random.default_rng(2).integers(1, VOCAB, (2, 4))
    prompts["padding_mask"][:, :4] = True
    np.testing.assert_array_equal(
        task.generate(prompts, stop_token_ids=None)["token_ids"],
        reference.generate(prompts, stop_token_ids=None)["token_ids"])


# ------------------------------------------ attention without causal mode
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize(
    "attention",
    [
        {"class_name": "LinformerAttention", "config": {"k": 4}},
        {"class_name": "NystromAttention", "config": {"num_landmarks": 4}},
        {"class_name": "AdaMRAAttention"},
    ],
    ids=lambda a: a["class_name"],
)
def test_a_decoder_refuses_an_attention_without_causal_mode(build, attention):
    name = attention["class_name"]
    with pytest.raises(ValueError, match=rf"causal decoder.*{name} has no causal mode"
                                         rf".*supports_causal is False.*'{name}'"):
        hub.longify(build(), attention)


def test_an_encoder_takes_an_attention_without_causal_mode():
    converted = hub.longify(_bert(), {"class_name": "LinformerAttention", "config": {"k": 4}})
    layer = converted.transformer_layers[0]._self_attention_layer
    assert type(layer).__name__ == "LinformerAttention"


def test_generation_needs_a_layer_with_a_cache():
    """A causal attention without a decoding cache converts, and generate
    says why it cannot decode."""
    converted = hub.longify(_gpt2(), {"class_name": "LSHAttention",
                                     "config": {"bucket_size": 4}})
    task = hub.LongGPT2CausalLM(backbone=converted, preprocessor=None)
    task.compile(sampler="greedy")
    prompts = {"token_ids": np.ones((1, 6), "int32"), "padding_mask": np.ones((1, 6), bool)}
    with pytest.raises(ValueError, match="cannot generate: .*LSHAttention"):
        task.generate(prompts, stop_token_ids=None)


# ---------------------------------------------- generation past the table
@pytest.fixture(scope="module")
def gpt2_task():
    keras.utils.set_random_seed(0)
    converted = hub.longify(_gpt2(), {"class_name": "LocalAttention", "config": {"window": 4}},
                            max_sequence_length=TABLE)
    task = hub.LongGPT2CausalLM(backbone=converted, preprocessor=None)
    task.compile(sampler="greedy")
    return task


def _prompts(length):
    token_ids = np.zeros((2, length), "int32")
    token_ids[:, :3] = np.random.default_rng(3).integers(1, VOCAB, (2, 3))
    padding_mask = np.zeros((2, length), bool)
    padding_mask[:, :3] = True
    return {"token_ids": token_ids, "padding_mask": padding_mask}


def test_generation_past_the_position_table_is_refused(gpt2_task):
    match = rf"`max_length` must be at most .*position table \({TABLE},.*max_length={TABLE + 4}"
    with pytest.raises(ValueError, match=match):
        gpt2_task.generate(_prompts(TABLE + 4), stop_token_ids=None)
    # The compiled generation checks too, before generating (whatever the
    # inputs: a preprocessor's output is not checked by generate()).
    with pytest.raises(ValueError, match=match):
        gpt2_task.make_generate_function()(
            {k: ops.convert_to_tensor(v) for k, v in _prompts(TABLE + 4).items()},
            stop_token_ids=None)
    # Up to the table, it generates.
    out = gpt2_task.generate(_prompts(TABLE), stop_token_ids=None)["token_ids"]
    assert out.shape == (2, TABLE) and np.all((out >= 0) & (out < VOCAB))


@pytest.mark.parametrize("value", [VOCAB, -1])
def test_generation_prompts_outside_the_vocabulary_are_refused(gpt2_task, value):
    prompts = _prompts(8)
    prompts["token_ids"][1, 2] = value
    with pytest.raises(ValueError, match=rf"\[0, {VOCAB}\).*token id {value}"):
        gpt2_task.generate(prompts, stop_token_ids=None)
    # Padding is not a prompt token: any id there is fine.
    prompts = _prompts(8)
    prompts["token_ids"][1, 6] = value
    gpt2_task.generate(prompts, stop_token_ids=None)


# --------------------------------------------------- decoding properties
class _HubDecoding(CausalModelDecodingProperties):
    vocab_size = VOCAB

    def generate(self, model, prompt, max_length):
        prompt = np.asarray(prompt)
        token_ids = np.zeros((prompt.shape[0], max_length), "int32")
        token_ids[:, : prompt.shape[1]] = prompt
        padding_mask = np.zeros(token_ids.shape, bool)
        padding_mask[:, : prompt.shape[1]] = True
        model.compile(sampler="greedy")
        return model.generate({"token_ids": token_ids, "padding_mask": padding_mask},
                              stop_token_ids=None)


class TestLongGPT2CausalLMDecoding(_HubDecoding):
    position_table = TABLE

    def make_model(self):
        converted = hub.longify(_gpt2(), {"class_name": "LocalAttention",
                                         "config": {"window": 4}}, max_sequence_length=TABLE)
        return hub.LongGPT2CausalLM(backbone=converted, preprocessor=None)


class TestLongLlamaCausalLMDecoding(_HubDecoding):
    position_table = None  # rotary

    def make_model(self):
        converted = hub.longify(_llama(), {"class_name": "LocalAttention",
                                          "config": {"window": 4}})
        return hub.LongLlamaCausalLM(backbone=converted, preprocessor=None)
