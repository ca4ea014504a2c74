"""``model.export`` of models built with the attention layers (issue #50,
item 6), on the backend the tests run on:

* TensorFlow and JAX: a TensorFlow SavedModel (``format="tf_saved_model"``;
  JAX through jax2tf), loaded back with ``tf.saved_model.load``;
* torch: ONNX (``format="onnx"``, the TorchDynamo exporter, which needs
  static shapes: the input signature names the batch), run with
  onnxruntime.

Each export's output is compared with the Keras model's on the same
weights and inputs, padding mask included where the model takes one. Cases
that do not export today are listed in :data:`DOES_NOT_EXPORT` with the
reason, and run as strict xfails: when one starts to export, its test
fails until the entry goes. The layers that export share one model (a
branch each), so that a backend pays for one export.
"""

import keras
import numpy as np
import pytest

from keras_longattn import layers as L
from keras_longattn.models import build_causal_language_model

# What exports differs by backend: every test runs on each of them.
pytestmark = pytest.mark.every_backend

BACKEND = keras.backend.backend()
T, FEATURES, BATCH = 32, 16, 2

#: Small configs of every attention layer (num_heads=2, key_dim=8 added).
CONFIGS = {
    "FullAttention": {},
    "LocalAttention": {"window": 8},
    "SparseAttention": {"pattern": "strided", "block_length": 8},
    "RoutingAttention": {"num_clusters": 2},
    "AdaMRAAttention": {},
    "LinformerAttention": {"k": 8, "max_length": T},
    "SynthesizerAttention": {"max_length": T},
    "LongformerAttention": {"window": 8},
    "BigBirdAttention": {"block_size": 4},
    "NystromAttention": {"num_landmarks": 8},
    "LSHAttention": {},
    "LinearAttention": {},
    "PerformerAttention": {},
    "EntmaxAttention": {},
    "AdaptiveSpanAttention": {"max_span": 16},
}

#: On torch, the layers whose default path is a custom kernel (the C++ band
#: kernel) export through their portable path, named here.
TORCH_PORTABLE = {"LocalAttention": "blocked", "SparseAttention": "blocked",
                  "LongformerAttention": "blocked"}

#: (backend, layer) -> why the export fails today.
DOES_NOT_EXPORT = {
    ("jax", "RoutingAttention"): "jax.lax.top_k lowers to a StableHLO composite op that "
    "TensorFlow's XlaCallModule cannot deserialize (JAX 0.10 beside TensorFlow 2.21)",
    ("jax", "BigBirdAttention"): "jax.lax.top_k lowers to a StableHLO composite op that "
    "TensorFlow's XlaCallModule cannot deserialize (JAX 0.10 beside TensorFlow 2.21)",
    ("torch", "RoutingAttention"): "torch.export stops at a data-dependent guard "
    "(GuardOnDataDependentSymNode) in the routed path, and the TorchScript fallback "
    "fails the layer's shape validation (traced shapes are tensors)",
    ("torch", "LSHAttention"): "torch.export stops at a data-dependent guard in the hashed "
    "path, and the TorchScript fallback fails the layer's shape validation",
}


def _layer(name):
    config = dict(num_heads=2, key_dim=8, **CONFIGS[name])
    if BACKEND == "torch" and name in TORCH_PORTABLE:
        config["implementation"] = TORCH_PORTABLE[name]
    return getattr(L, name)(**config)


def _export(model, inputs, tmp_path):
    """Exports ``model`` in this backend's format (static shapes on torch:
    those of ``inputs``, a list of arrays in the model's input order) and
    returns a function that runs the artifact on such a list (a list of
    its outputs)."""
    if BACKEND == "torch":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
        import onnxruntime

        path = str(tmp_path / "model.onnx")
        signature = [keras.InputSpec(shape=x.shape, dtype=str(x.dtype)) for x in inputs]
        model.export(path, format="onnx", verbose=False,
                     input_signature=[signature] if len(signature) > 1 else signature)
        session = onnxruntime.InferenceSession(path)
        names = [spec.name for spec in session.get_inputs()]
        return lambda arrays: session.run(None, dict(zip(names, arrays)))
    import tensorflow as tf

    path = str(tmp_path / "saved_model")
    model.export(path, format="tf_saved_model", verbose=False)
    restored = tf.saved_model.load(path)
    def run(arrays):
        outputs = restored.serve(arrays if len(arrays) > 1 else arrays[0])
        return [o.numpy() for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs])]

    return run


def _exporting(names):
    return [n for n in names if (BACKEND, n) not in DOES_NOT_EXPORT]


def test_every_attention_layer_exports_with_the_same_outputs(tmp_path):
    # One model, one branch per layer (one export instead of fifteen).
    keras.utils.set_random_seed(0)
    names = _exporting(sorted(CONFIGS))
    inputs = keras.Input((T, FEATURES))
    layers = {name: _layer(name) for name in names}
    outputs = [layers[name](inputs, inputs) for name in names]
    model = keras.Model(inputs, outputs)
    x = np.random.RandomState(0).normal(size=(BATCH, T, FEATURES)).astype("float32")
    expected = [keras.ops.convert_to_numpy(y) for y in model(x)]
    got = _export(model, [x], tmp_path)([x])
    assert len(got) == len(names)
    for name, a, b in zip(names, got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("name", sorted({n for b, n in DOES_NOT_EXPORT if b == BACKEND}))
def test_what_does_not_export_is_listed_with_its_reason(name, tmp_path, request):
    request.applymarker(pytest.mark.xfail(reason=DOES_NOT_EXPORT[(BACKEND, name)],
                                          strict=True))
    keras.utils.set_random_seed(0)
    inputs = keras.Input((T, FEATURES))
    model = keras.Model(inputs, _layer(name)(inputs, inputs))
    x = np.random.RandomState(0).normal(size=(BATCH, T, FEATURES)).astype("float32")
    (got,) = _export(model, [x], tmp_path)([x])
    np.testing.assert_allclose(got, keras.ops.convert_to_numpy(model(x)), rtol=1e-4, atol=1e-5)


def test_a_causal_language_model_exports_with_the_same_logits(tmp_path):
    keras.utils.set_random_seed(0)
    attention = L.LocalAttention(num_heads=2, key_dim=16, window=8,
                                 implementation=TORCH_PORTABLE["LocalAttention"] if BACKEND == "torch"
                                 else "auto")
    model = build_causal_language_model(vocab_size=64, sequence_length=T, dim=32,
                                        num_layers=2, num_heads=2, attention=attention)
    tokens = np.random.RandomState(1).randint(0, 64, size=(BATCH, T)).astype("int32")
    expected = keras.ops.convert_to_numpy(model(tokens))
    run = _export(model, [tokens], tmp_path)
    (got,) = run([tokens])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # the artifact computes from its input, not from constants of the trace
    other = (tokens + 1) % 64
    np.testing.assert_allclose(run([other])[0], keras.ops.convert_to_numpy(model(other)),
                               rtol=1e-4, atol=1e-4)
    assert not np.allclose(run([other])[0], got)


def test_a_padding_mask_is_an_input_of_the_export(tmp_path):
    keras.utils.set_random_seed(0)
    x_in = keras.Input((T, FEATURES), name="x")
    mask_in = keras.Input((T,), dtype="bool", name="mask")
    attention = _layer("LocalAttention")
    model = keras.Model([x_in, mask_in], attention(x_in, x_in, value_mask=mask_in))
    x = np.random.RandomState(0).normal(size=(BATCH, T, FEATURES)).astype("float32")
    mask = np.ones((BATCH, T), bool)
    mask[1, T - 8:] = False
    expected = keras.ops.convert_to_numpy(model([x, mask]))
    run = _export(model, [x, mask], tmp_path)
    (got,) = run([x, mask])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    # perturbing the padded tokens moves no other token's output, in the
    # export too; a mask of ones makes them visible again
    perturbed = x.copy()
    perturbed[1, T - 8:] += 5.0
    (again,) = run([perturbed, mask])
    np.testing.assert_allclose(again[1, :T - 8], got[1, :T - 8], rtol=1e-4, atol=1e-5)
    (unmasked,) = run([perturbed, np.ones_like(mask)])
    assert np.abs(unmasked[1, :T - 8] - got[1, :T - 8]).max() > 1e-3
