"""Exporting models built with the attention layers, and their decode step.

:func:`export_model` is ``model.export`` with the cases that cannot export
refused before anything is written (a ``ValueError`` naming the layer, the
backend, the format and the reason), and with the paths that have no
counterpart in the target format swapped for their portable equivalent
while the model is traced (the C++ band kernel of ``LocalAttention``,
``SparseAttention`` and ``LongformerAttention`` on torch runs as
``"blocked"`` for ONNX: the same outputs).

:func:`decode_step_model` turns a :class:`~keras_longattn.models.CausalLanguageModel`
into a functional Keras model of one decoding step with the caches as
explicit inputs and outputs, and :func:`export_decode_step` exports it, so
that a server can run prefill and decode steps of the exported artifact and
keep the caches itself.

Formats, by backend (those of ``keras.Model.export``):

* ``"tf_saved_model"`` from TensorFlow and JAX (JAX through jax2tf);
* ``"onnx"`` from torch (the TorchDynamo exporter; the input signature
  must fix every dimension);
* ``"litert"`` from TensorFlow (give the input signature with every
  dimension fixed too: with a free batch dimension the interpreter rejects
  ``LinformerAttention``'s projection tensors when it loads the model).

On JAX, the run-time checks of traced values (a cache position beyond the
cache, a token id outside the vocabulary) are host callbacks, which jax2tf
cannot serialize: while exporting they take the form they have under XLA
on TensorFlow (``keras_longattn.ops.checks``), so the artifact returns NaN
logits and the caches it was given, unchanged, for a refused step.
"""

import contextlib

import keras

from keras_longattn.kernels import backend_ops
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.models.causal_language_model import CausalLanguageModel

FORMATS = {
    "tensorflow": ("tf_saved_model", "litert"),
    "jax": ("tf_saved_model",),
    "torch": ("onnx",),
}

_TOP_K = ("jax.lax.top_k lowers to a StableHLO composite op that the XlaCallModule "
          "of TensorFlow cannot deserialize: the SavedModel is written but fails when "
          "it runs; export this layer from the TensorFlow backend")
_TORCH_GUARD = ("torch.export stops at a data-dependent guard (GuardOnDataDependentSymNode) "
                "in its {what}, and the TorchScript fallback cannot trace the layer's "
                "shape checks")
_FLEX_OPS = ("the converted model needs TensorFlow Select ops (Flex delegate), which "
             "the LiteRT interpreter runs only with the Flex delegate linked")

#: (backend, format, layer class name) -> why such a layer does not export.
REFUSALS = {
    ("jax", "tf_saved_model", "RoutingAttention"): _TOP_K,
    ("jax", "tf_saved_model", "BigBirdAttention"): _TOP_K,
    ("torch", "onnx", "RoutingAttention"): _TORCH_GUARD.format(what="cluster sorting"),
    ("torch", "onnx", "LSHAttention"): _TORCH_GUARD.format(what="bucket sorting"),
    ("tensorflow", "litert", "LSHAttention"): _FLEX_OPS,
    ("tensorflow", "litert", "AdaMRAAttention"): _FLEX_OPS,
}

#: (backend, format) -> why the decode step does not export there.
DECODE_STEP_REFUSALS = {
    ("torch", "onnx"): (
        "the ring caches read one slot by a traced index (index_select of a "
        "0-d index), which torch.onnx translates to a Squeeze that ONNX Runtime "
        "rejects when it loads the model, and a learned position table is sliced "
        "at a traced start (a data-dependent size for torch.export)"),
}

#: Paths that have no counterpart in a format, by (backend, format):
#: ``implementation`` names that run them, and the portable path used instead.
_PORTABLE_FOR = {("torch", "onnx"): ("band_kernel", "blocked")}


def _check_format(format):
    backend = keras.backend.backend()
    formats = FORMATS.get(backend, ())
    if format not in formats:
        raise ValueError(
            f"`format` must be one of {formats} on the {backend} backend (the formats "
            f"whose artifacts are tested). Received: format={format!r}"
        )
    return backend


def _attention_layers(model):
    return [layer for layer in model._flatten_layers(include_self=True, recursive=True)
            if isinstance(layer, BaseAttention)]


def export_refusal(model, format):
    """Why ``model`` cannot be exported to ``format`` on the active backend,
    naming the first attention layer that cannot (None: it can).

    Raises:
        ValueError: a ``format`` that is not tested on this backend.
    """
    backend = _check_format(format)
    for layer in _attention_layers(model):
        reason = REFUSALS.get((backend, format, type(layer).__name__))
        if reason is not None:
            return (f"{type(layer).__name__} {layer.name!r} does not export to "
                    f"{format} from the {backend} backend: {reason}")
    return None


@contextlib.contextmanager
def _exporting(model, backend, format):
    """Portable paths for the kernels that ``format`` has no counterpart for,
    and the run-time checks of traced values as flags on JAX, while ``model``
    is traced; both restored afterwards."""
    swapped = []
    kernel, portable = _PORTABLE_FOR.get((backend, format), (None, None))
    if kernel is not None:
        for layer in _attention_layers(model):
            if kernel in layer.implementations and layer.implementation in ("auto", kernel):
                swapped.append((layer, layer.implementation))
                layer.implementation = portable
    table = backend_ops()
    checks_as_flags = backend == "jax" and "refuse_at_run_time" not in vars(table)
    if checks_as_flags:
        table.refuse_at_run_time = lambda bad, value, message: (value, False)
    try:
        yield
    finally:
        if checks_as_flags:
            del table.refuse_at_run_time
        for layer, implementation in swapped:
            layer.implementation = implementation


def export_model(model, filepath, format="tf_saved_model", input_signature=None, **kwargs):
    """``model.export(filepath, format, input_signature, **kwargs)``, after
    :func:`export_refusal` (raised as a ``ValueError`` before anything is
    written), with portable paths where ``format`` has no counterpart for a
    kernel (on torch, ONNX: ``"blocked"`` for the band kernel).

    On torch, give ``input_signature`` with every dimension fixed (the
    TorchDynamo exporter); the default is the model's input shapes with the
    batch dimension they were built with.
    """
    backend = _check_format(format)
    reason = export_refusal(model, format)
    if reason is not None:
        raise ValueError(reason)
    with _exporting(model, backend, format):
        model.export(filepath, format=format, input_signature=input_signature, **kwargs)


class DecodeStep(keras.layers.Layer):
    """One :meth:`CausalLanguageModel.call_with_cache` with the caches as a
    flat list: ``call(token_ids, cache_update_index, cache_leaves)`` returns
    ``[logits, *new_cache_leaves]``, the leaves in the order of
    ``keras.tree.flatten(model.init_caches(batch_size, max_length))``."""

    def __init__(self, language_model, batch_size, max_length, **kwargs):
        super().__init__(**kwargs)
        self.language_model = language_model
        self.batch_size = batch_size
        self.max_length = max_length
        self._structure = language_model.init_caches(batch_size, max_length)

    def call(self, token_ids, cache_update_index, cache_leaves):
        cache = keras.tree.pack_sequence_as(self._structure, list(cache_leaves))
        logits, _, new_cache = self.language_model.call_with_cache(
            token_ids, cache, cache_update_index)
        return [logits, *keras.tree.flatten(new_cache)]


def decode_step_model(model, batch_size, max_length, num_tokens=1):
    """A functional model of one decoding step of ``model``.

    Args:
        model: a :class:`~keras_longattn.models.CausalLanguageModel`.
        batch_size: the batch of the step (fixed: the caches have it).
        max_length: the length of the caches (``init_caches``).
        num_tokens: tokens per step (1 for decoding; a prefill chunk's size
            for prefill steps).

    Returns:
        A ``keras.Model`` with inputs ``[token_ids (batch_size, num_tokens)
        int32, cache_update_index () int32, *cache_leaves]`` and outputs
        ``[logits (batch_size, num_tokens, vocab_size), *new_cache_leaves]``;
        the cache leaves are those of
        ``keras.tree.flatten(model.init_caches(batch_size, max_length))``,
        which also gives the first step's caches.

    Raises:
        ValueError: a ``model`` that is not a CausalLanguageModel, a
            ``num_tokens`` that is not a positive int, and what
            ``init_caches`` refuses (a layer without a cache, a bad
            ``batch_size`` or ``max_length``).
    """
    if not isinstance(model, CausalLanguageModel):
        raise ValueError(
            "`model` must be a keras_longattn CausalLanguageModel (it has the decoding "
            f"caches). Received: model of type {type(model).__name__}"
        )
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"`num_tokens` must be a positive int. Received: num_tokens={num_tokens!r}")
    step = DecodeStep(model, batch_size, max_length, name="decode_step")
    leaves = keras.tree.flatten(step._structure)
    token_ids = keras.Input(batch_shape=(step.batch_size, num_tokens), dtype="int32",
                            name="token_ids")
    index = keras.Input(batch_shape=(), dtype="int32", name="cache_update_index")
    cache_inputs = [
        keras.Input(batch_shape=tuple(leaf.shape),
                    dtype=keras.backend.standardize_dtype(leaf.dtype), name=f"cache_{i}")
        for i, leaf in enumerate(leaves)
    ]
    outputs = step(token_ids, index, cache_inputs)
    return keras.Model([token_ids, index, *cache_inputs], outputs,
                       name=f"{model.name}_decode_step")


def decode_step_signature(step_model):
    """The fixed-shape input signature of a :func:`decode_step_model`: one
    ``keras.InputSpec`` per input, in a list for its single list argument."""
    return [[keras.InputSpec(shape=tuple(x.shape), dtype=x.dtype) for x in step_model.inputs]]


def export_decode_step(model, filepath, format="tf_saved_model", *, batch_size, max_length,
                       num_tokens=1, **kwargs):
    """Exports :func:`decode_step_model` of ``model`` to ``format`` (every
    dimension fixed), refusing first where the step or a layer cannot export
    (:data:`DECODE_STEP_REFUSALS`, :func:`export_refusal`).

    The artifact takes ``[token_ids, cache_update_index, *cache_leaves]``
    and returns ``[logits, *new_cache_leaves]`` (a ``tf.saved_model.load``
    artifact's ``serve`` takes the list; LiteRT and ONNX take the inputs by
    name: ``token_ids``, ``cache_update_index``, ``cache_0`` ...).
    """
    backend = _check_format(format)
    reason = DECODE_STEP_REFUSALS.get((backend, format))
    if reason is not None:
        raise ValueError(
            f"The decode step does not export to {format} from the {backend} backend: {reason}"
        )
    step = decode_step_model(model, batch_size, max_length, num_tokens)
    export_model(step, filepath, format=format, input_signature=decode_step_signature(step),
                 **kwargs)
    return step
