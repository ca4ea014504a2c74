"""``model.export`` of models built with the attention layers (issue #50,
item 6), on the backend the tests run on:

* TensorFlow and JAX: a TensorFlow SavedModel (``format="tf_saved_model"``;
  JAX through jax2tf), loaded back with ``tf.saved_model.load``;
* torch: ONNX (``format="onnx"``, the TorchDynamo exporter, which needs
  static shapes: the input signature names the batch), run with
  onnxruntime.

* TensorFlow: LiteRT too (``format="litert"``), run with
  ``tf.lite.Interpreter``.

The exports go through :func:`keras_longattn.export.export_model` (which
refuses first what cannot export) and each output is compared with the
Keras model's on the same weights and inputs, padding mask included where
the model takes one. Cases that do not export today are the entries of
``export.REFUSALS``: ``export_model`` refuses them before writing anything,
and the plain ``model.export`` of each runs as a strict xfail, so that when
one starts to export its test fails until the entry goes. The layers that
export share one model (a branch each), so that a backend pays for one
export. The decode step (:func:`keras_longattn.export.export_decode_step`,
caches as inputs and outputs) is run step by step from the artifact, and a
GPT-2 backbone converted by ``hub.longify`` is exported like any model.
"""

import keras
import numpy as np
import pytest

from keras_longattn import export
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

def _format():
    return "onnx" if BACKEND == "torch" else "tf_saved_model"


#: (layer class name) -> why it does not export in this backend's format.
DOES_NOT_EXPORT = {name: reason for (backend, format, name), reason in export.REFUSALS.items()
                   if backend == BACKEND and format == _format()}


def _layer(name):
    return getattr(L, name)(num_heads=2, key_dim=8, **CONFIGS[name])


def _signature(inputs):
    """Fixed-shape specs of ``inputs`` (a list, or a dict of named inputs)."""
    spec = lambda x: keras.InputSpec(shape=x.shape, dtype=str(x.dtype))  # noqa: E731
    if isinstance(inputs, dict):
        return [{k: spec(v) for k, v in inputs.items()}]
    signature = [spec(x) for x in inputs]
    return [signature] if len(signature) > 1 else signature


def _runner(path, names=None):
    """A function that runs the artifact at ``path`` (this backend's
    format) on a list of arrays in the model's input order, or on a dict of
    named inputs, and returns the list of its outputs."""
    if BACKEND == "torch":
        import onnxruntime

        session = onnxruntime.InferenceSession(path)
        input_names = [spec.name for spec in session.get_inputs()]

        def run(arrays):
            if isinstance(arrays, dict) and set(arrays) != set(input_names):
                arrays = [arrays[k] for k in sorted(arrays)]  # keras.tree's order
            feed = arrays if isinstance(arrays, dict) else dict(zip(input_names, arrays))
            return session.run(None, feed)

        return run
    import tensorflow as tf

    restored = tf.saved_model.load(path)

    def run(arrays):
        single = not isinstance(arrays, dict) and len(arrays) == 1
        outputs = restored.serve(arrays[0] if single else arrays)
        if isinstance(outputs, dict):
            return [outputs[k].numpy() for k in sorted(outputs)]
        return [o.numpy() for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs])]

    return run


def _path(tmp_path):
    return str(tmp_path / ("model.onnx" if BACKEND == "torch" else "saved_model"))


def _export(model, inputs, tmp_path, checked=True):
    """Exports ``model`` in this backend's format (the shapes of ``inputs``,
    every dimension fixed) through :func:`keras_longattn.export.export_model`
    (``checked``) or plain ``model.export``, and returns :func:`_runner`."""
    if BACKEND == "torch":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    path = _path(tmp_path)
    signature = _signature(inputs)
    if checked:
        export.export_model(model, path, _format(), input_signature=signature, verbose=False)
    else:
        model.export(path, format=_format(), input_signature=signature, verbose=False)
    return _runner(path)


def _exporting(names):
    return [n for n in names if n not in DOES_NOT_EXPORT]


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


@pytest.mark.parametrize("name", sorted(DOES_NOT_EXPORT))
def test_what_does_not_export_is_listed_with_its_reason(name, tmp_path, request):
    # the plain model.export really fails (strict: when it starts to work,
    # the entry of export.REFUSALS must go) ...
    request.applymarker(pytest.mark.xfail(reason=DOES_NOT_EXPORT[name], strict=True))
    keras.utils.set_random_seed(0)
    inputs = keras.Input((T, FEATURES))
    model = keras.Model(inputs, _layer(name)(inputs, inputs))
    x = np.random.RandomState(0).normal(size=(BATCH, T, FEATURES)).astype("float32")
    (got,) = _export(model, [x], tmp_path, checked=False)([x])
    np.testing.assert_allclose(got, keras.ops.convert_to_numpy(model(x)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(DOES_NOT_EXPORT))
def test_export_model_refuses_what_does_not_export_before_writing(name, tmp_path):
    inputs = keras.Input((T, FEATURES))
    inner = keras.Model(inputs, _layer(name)(inputs, inputs))
    outer_in = keras.Input((T, FEATURES))
    model = keras.Model(outer_in, inner(outer_in))  # found inside a nested model too
    with pytest.raises(ValueError, match=f"{name} .* does not export to {_format()} "
                       f"from the {BACKEND} backend: "):
        export.export_model(model, _path(tmp_path), _format())
    assert not list(tmp_path.iterdir())


def test_formats_not_tested_on_this_backend_are_refused(tmp_path):
    inputs = keras.Input((T, FEATURES))
    model = keras.Model(inputs, _layer("FullAttention")(inputs, inputs))
    with pytest.raises(ValueError, match="`format` must be one of .* Received: format='h5'"):
        export.export_model(model, _path(tmp_path), "h5")


@pytest.mark.skipif(BACKEND != "torch", reason="the band kernel is torch's")
def test_the_band_kernel_exports_through_the_portable_path_on_torch(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((T, FEATURES))
    layer = _layer("LocalAttention")
    model = keras.Model(inputs, layer(inputs, inputs))
    x = np.random.RandomState(0).normal(size=(BATCH, T, FEATURES)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(x))
    assert layer.last_implementation == "band_kernel"
    (got,) = _export(model, [x], tmp_path)([x])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert layer.implementation == "auto"  # restored after the export


def test_a_causal_language_model_exports_with_the_same_logits(tmp_path):
    keras.utils.set_random_seed(0)
    attention = L.LocalAttention(num_heads=2, key_dim=16, window=8)
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


def _lite_runner(path):
    """Runs a LiteRT flatbuffer through its signature (inputs ``args_0``,
    ``args_0_1`` ... in the model's input order, outputs ``output_<i>``)."""
    import tensorflow as tf

    interpreter = tf.lite.Interpreter(model_path=path)
    runner = interpreter.get_signature_runner()
    names = sorted(runner.get_input_details(), key=lambda n: (len(n), n))

    def run(arrays):
        out = runner(**dict(zip(names, arrays)))
        return [out[k] for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[1]))]

    return run


LITE_REFUSED = {name: reason for (backend, format, name), reason in export.REFUSALS.items()
                if backend == "tensorflow" and format == "litert"}


@pytest.mark.skipif(BACKEND != "tensorflow", reason="LiteRT is tested from TensorFlow")
def test_every_attention_layer_exports_to_litert(tmp_path):
    keras.utils.set_random_seed(0)
    names = [n for n in sorted(CONFIGS) if n not in LITE_REFUSED]
    inputs = keras.Input((T, FEATURES), batch_size=BATCH)
    outputs = [_layer(name)(inputs, inputs) for name in names]
    model = keras.Model(inputs, outputs)
    x = np.random.RandomState(0).normal(size=(BATCH, T, FEATURES)).astype("float32")
    expected = [keras.ops.convert_to_numpy(y) for y in model(x)]
    path = str(tmp_path / "model.tflite")
    export.export_model(model, path, "litert", input_signature=_signature([x]), verbose=False)
    got = _lite_runner(path)([x])
    assert len(got) == len(names)
    for name, a, b in zip(names, got, expected):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="LiteRT is tested from TensorFlow")
@pytest.mark.parametrize("name", sorted(LITE_REFUSED))
def test_what_does_not_export_to_litert_is_refused_and_really_fails(name, tmp_path):
    inputs = keras.Input((T, FEATURES), batch_size=BATCH)
    model = keras.Model(inputs, _layer(name)(inputs, inputs))
    path = str(tmp_path / "model.tflite")
    with pytest.raises(ValueError, match=f"{name} .* does not export to litert"):
        export.export_model(model, path, "litert")
    x = np.random.RandomState(0).normal(size=(BATCH, T, FEATURES)).astype("float32")
    model.export(path, format="litert", input_signature=_signature([x]), verbose=False)
    with pytest.raises((RuntimeError, ValueError)):  # the interpreter cannot run it
        _lite_runner(path)([x])


def _decoder():
    """Local ring cache then a full-length cache, learned positions."""
    keras.utils.set_random_seed(0)
    return build_causal_language_model(
        vocab_size=64, sequence_length=T, dim=32, num_layers=2, num_heads=2,
        attention=[{"class_name": "LocalAttention", "config": {"window": 4}}, "FullAttention"])


def _step_formats():
    return [f for f in export.FORMATS[BACKEND] if (BACKEND, f) not in export.DECODE_STEP_REFUSALS]


@pytest.mark.parametrize("format", _step_formats())
def test_the_decode_step_exports_with_the_caches_as_inputs_and_outputs(format, tmp_path):
    model = _decoder()
    tokens = np.random.RandomState(1).randint(0, 64, size=(BATCH, T)).astype("int32")
    expected = keras.ops.convert_to_numpy(model(tokens))[:, :10]  # causal: the first 10
    path = str(tmp_path / ("step.tflite" if format == "litert" else "step"))
    step = export.export_decode_step(model, path, format, batch_size=BATCH, max_length=T,
                                     num_tokens=2)
    assert [x.name for x in step.inputs[:2]] == ["token_ids", "cache_update_index"]
    run = _lite_runner(path) if format == "litert" else _runner(path)
    cache = [keras.ops.convert_to_numpy(c)
             for c in keras.tree.flatten(model.init_caches(BATCH, T))]
    assert len(step.inputs) == 2 + len(cache)
    logits = []
    for start in range(0, 10, 2):  # five steps of two tokens, the caches fed back
        out = run([tokens[:, start:start + 2], np.array(start, "int32"), *cache])
        logits.append(out[0])
        assert [c.shape for c in out[1:]] == [c.shape for c in cache]
        cache = out[1:]
    np.testing.assert_allclose(np.concatenate(logits, axis=1), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's run-time checks are host callbacks")
def test_an_exported_decode_step_refuses_a_position_beyond_the_cache_with_nan(tmp_path):
    # the checks of traced positions take their XLA form in the artifact:
    # NaN logits, the caches returned unchanged
    model = _decoder()
    path = str(tmp_path / "step")
    export.export_decode_step(model, path, batch_size=BATCH, max_length=T)
    run = _runner(path)
    cache = [keras.ops.convert_to_numpy(c) + 1.0
             for c in keras.tree.flatten(model.init_caches(BATCH, T))]
    tokens = np.zeros((BATCH, 1), "int32")
    ok = run([tokens, np.array(T - 1, "int32"), *cache])
    assert np.isfinite(ok[0]).all()
    bad = run([tokens, np.array(T, "int32"), *cache])
    assert np.isnan(bad[0]).all()
    for before, after in zip(cache, bad[1:]):
        np.testing.assert_array_equal(after, before)
    # and the exporting left the Keras model's own checks as they were
    with pytest.raises(ValueError, match="cache_update_index|sequence_length"):
        model.call_with_cache(tokens, model.init_caches(BATCH, T), T)


@pytest.mark.parametrize("format", [f for f in export.FORMATS[BACKEND]
                                    if (BACKEND, f) in export.DECODE_STEP_REFUSALS])
def test_a_decode_step_that_does_not_export_is_refused_and_really_fails(format, tmp_path,
                                                                       request):
    pytest.importorskip("onnxruntime")
    model = _decoder()
    with pytest.raises(ValueError, match=f"The decode step does not export to {format}"):
        export.export_decode_step(model, _path(tmp_path), format, batch_size=BATCH,
                                  max_length=T)
    assert not list(tmp_path.iterdir())
    request.applymarker(pytest.mark.xfail(
        reason=export.DECODE_STEP_REFUSALS[(BACKEND, format)], strict=True))
    step = export.decode_step_model(model, BATCH, T)
    step.export(_path(tmp_path), format=format, verbose=False,
                input_signature=export.decode_step_signature(step))
    cache = [keras.ops.convert_to_numpy(c) for c in keras.tree.flatten(model.init_caches(BATCH, T))]
    _runner(_path(tmp_path))([np.zeros((BATCH, 1), "int32"), np.array(0, "int32"), *cache])


def test_decode_step_model_refuses_bad_arguments():
    with pytest.raises(ValueError, match="CausalLanguageModel.*Received: model of type Dense"):
        export.decode_step_model(keras.layers.Dense(2), BATCH, T)
    with pytest.raises(ValueError, match="`num_tokens` must be a positive int. Received: "
                       "num_tokens=0"):
        export.decode_step_model(_decoder(), BATCH, T, num_tokens=0)


def test_a_longified_gpt2_backbone_exports_with_the_same_outputs(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    from keras_longattn import hub

    keras.utils.set_random_seed(0)
    original = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=T, dropout=0.0)
    rng = np.random.default_rng(0)
    for variable in original.weights:  # away from near-uniform attention
        base = 1.0 if variable.path.endswith(("gamma", "scale")) else 0.0
        variable.assign((base + rng.normal(0.0, 0.3, variable.shape)).astype("float32"))
    converted = hub.longify(original, {"class_name": "LocalAttention", "config": {"window": 4}})
    padding = np.ones((BATCH, T), "int32")
    padding[1, T - 5:] = 0
    x = {"token_ids": rng.integers(1, 64, (BATCH, T)).astype("int32"), "padding_mask": padding}
    expected = keras.ops.convert_to_numpy(converted(x))
    (got,) = _export(converted, x, tmp_path)(x)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
