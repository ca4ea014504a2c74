""":func:`longify`: a keras-hub backbone converted, weights carried over."""

import math
import numbers

import keras
import numpy as np
from keras import ops

from keras_longattn import ops as la_ops
from keras_longattn.hub._keras_hub import BertBackbone
from keras_longattn.hub._keras_hub import GPT2Backbone
from keras_longattn.hub._keras_hub import LlamaBackbone
from keras_longattn.hub._keras_hub import MistralBackbone
from keras_longattn.hub._keras_hub import PositionEmbedding
from keras_longattn.hub._keras_hub import RobertaBackbone
from keras_longattn.hub.attention import _attention_class
from keras_longattn.hub.attention import attention_spec
from keras_longattn.hub.bert_backbone import LongBertBackbone
from keras_longattn.hub.gpt2_backbone import LongGPT2Backbone
from keras_longattn.hub.llama_backbone import LongLlamaBackbone
from keras_longattn.hub.mistral_backbone import LongMistralBackbone
from keras_longattn.hub.roberta_backbone import LongRobertaBackbone


#: Positions at which a backbone's rotary embedding is compared with
#: ``keras_longattn.ops.apply_rotary`` before a conversion.
_ROTARY_PROBE_LENGTH = 256


#: keras-hub class -> its long class (a long backbone converts again).
_LONG_CLASSES = {
    GPT2Backbone: LongGPT2Backbone,
    LongGPT2Backbone: LongGPT2Backbone,
    LlamaBackbone: LongLlamaBackbone,
    LongLlamaBackbone: LongLlamaBackbone,
    MistralBackbone: LongMistralBackbone,
    LongMistralBackbone: LongMistralBackbone,
    BertBackbone: LongBertBackbone,
    LongBertBackbone: LongBertBackbone,
    RobertaBackbone: LongRobertaBackbone,
    LongRobertaBackbone: LongRobertaBackbone,
}


#: Backbones with a learned position table (``max_sequence_length`` rows).
_LEARNED_POSITIONS = (LongGPT2Backbone, LongBertBackbone, LongRobertaBackbone)


#: Causal decoders (their blocks call the attention with use_causal_mask=True).
_DECODERS = (LongGPT2Backbone, LongLlamaBackbone, LongMistralBackbone)


# ---------------------------------------------------------------- converter
def longify(backbone, attention, max_sequence_length=None):
    """A keras-hub backbone with every self-attention replaced by ours.

    Args:
        backbone: a keras-hub ``GPT2Backbone``, ``LlamaBackbone``,
            ``MistralBackbone``, ``BertBackbone`` or ``RobertaBackbone``
            (trained, or loaded from a preset), or a backbone this function
            returned (converted again).
        attention: the attention layer, as a Keras layer config of one of
            our layers: ``{"class_name": "LocalAttention", "config":
            {"window": 512}}``. The heads, head size, key/value heads,
            biases and rotary wavelength are the backbone's (the config may
            not set them); ``dropout`` and the initializers default to the
            backbone's. Mistral's own pattern (``sliding_window``) is
            ``LocalAttention`` with ``window=sliding_window``.
        max_sequence_length: the new length of a learned position table
            (GPT-2, BERT, RoBERTa): at least the backbone's; row ``i`` of the
            new table is row ``i mod L`` of the trained one (``L`` the trained
            length: the table repeated, as Longformer made RoBERTa long).
            Defaults to the backbone's length. Rotary backbones (Llama,
            Mistral) have no table and take None.

    Returns:
        A new backbone (:class:`LongGPT2Backbone`, :class:`LongLlamaBackbone`,
        :class:`LongMistralBackbone`, :class:`LongBertBackbone` or
        :class:`LongRobertaBackbone`, subclasses of keras-hub's classes) with
        the backbone's config and weights: the query, key, value and output
        projections of every attention in our layer, the norms,
        feed-forward networks and embeddings unchanged, the position table
        extended. Weights our layer has beyond the four projections start
        as in the Longformer paper for ``LongformerAttention`` (its global
        projections copy the local ones) and keep their initialization
        otherwise (Linformer's projections, Routing's centroids, ...). The
        original backbone is not modified.

    Raises:
        ValueError: ``backbone`` of another class, an ``attention`` that is
            not the config of one of our layers (or sets what the backbone
            decides), an attention without the mode the blocks call it in
            (no causal mode, ``supports_causal`` False, for GPT-2, Llama and
            Mistral: ``LinformerAttention``, ``NystromAttention``,
            ``AdaMRAAttention``; causal only for BERT and RoBERTa), a
            ``max_sequence_length`` shorter than the backbone's
            (or given for a rotary backbone), or a rotary embedding our
            layers cannot reproduce (position scaling, Llama 3.1 frequency
            adjustment).
    """
    long_class = _LONG_CLASSES.get(type(backbone))
    if long_class is None:
        supported = sorted({c.__name__ for c in _LONG_CLASSES})
        raise ValueError(
            f"`backbone` must be one of {supported} (keras-hub backbones built "
            "from their config or a preset). Received: backbone of class "
            f"{type(backbone).__name__}")
    spec = attention_spec(attention)
    _check_attention_mode(spec, long_class)
    config = backbone.get_config()
    config.pop("attention", None)
    if issubclass(long_class, _LEARNED_POSITIONS):
        old_length = int(config["max_sequence_length"])
        if max_sequence_length is None:
            max_sequence_length = old_length
        if (
            isinstance(max_sequence_length, bool)
            or not isinstance(max_sequence_length, numbers.Integral)
            or max_sequence_length < old_length
        ):
            raise ValueError(
                "`max_sequence_length` must be an int at least the backbone's "
                f"max_sequence_length ({old_length}): the trained position table "
                "is extended, never cut. Received: "
                f"max_sequence_length={max_sequence_length!r}")
        config["max_sequence_length"] = int(max_sequence_length)
    else:
        if max_sequence_length is not None:
            raise ValueError(
                f"{type(backbone).__name__} has rotary positions and no position "
                "table to extend: its length is not bounded by a table. Received: "
                f"max_sequence_length={max_sequence_length!r}")
        _check_rotary(backbone)
    if long_class is LongLlamaBackbone:
        # LlamaBackbone.get_config leaves out tie_word_embeddings.
        config["tie_word_embeddings"] = bool(backbone.tie_word_embeddings)
    if isinstance(config.get("dtype"), dict):
        config["dtype"] = keras.dtype_policies.get(config["dtype"])
    long_backbone = long_class(attention=spec, **config)
    _copy_weights(backbone, long_backbone)
    return long_backbone


def _check_attention_mode(spec, long_class):
    """ValueError unless the attention of ``spec`` has the mode the blocks of
    ``long_class`` call it in: causal for the decoders (GPT-2, Llama,
    Mistral: every call and every decoding step has
    ``use_causal_mask=True``), bidirectional for the encoders (BERT,
    RoBERTa); the layer's ``supports_causal`` / ``supports_bidirectional``."""
    cls = _attention_class(spec["class_name"])
    name = cls.__name__
    decoder = issubclass(long_class, _DECODERS)
    if decoder and not getattr(cls, "supports_causal", True):
        raise ValueError(
            f"{long_class.__name__} is a causal decoder: its blocks call the "
            f"attention with use_causal_mask=True, and {name} has no causal mode "
            f"({name}.supports_causal is False; it would be refused at the first "
            "call). Use an attention with a causal mode (e.g. LocalAttention, "
            f"FullAttention). Received: attention['class_name']={name!r}")
    if not decoder and not getattr(cls, "supports_bidirectional", True):
        raise ValueError(
            f"{long_class.__name__} is a bidirectional encoder: its blocks call "
            f"the attention with use_causal_mask=False, and {name} only supports "
            f"causal attention ({name}.supports_bidirectional is False). "
            f"Received: attention['class_name']={name!r}")


def _check_rotary(backbone):
    """ValueError unless the rotary embedding of ``backbone``'s attention
    equals ``keras_longattn.ops.apply_rotary`` with its
    ``rope_max_wavelength`` (our layers have no position scaling or
    frequency adjustment), compared on the first positions."""
    layer = backbone.transformer_layers[0]._self_attention_layer
    rotary = getattr(layer, "rotary_embedding_layer", None)
    if rotary is None:  # our layer (a converted backbone): our rotary.
        return
    head_dim = getattr(backbone, "head_dim", None) or (
        backbone.hidden_dim // backbone.num_query_heads)
    wavelength = backbone.rope_max_wavelength
    rope = {k: v for k, v in sorted(backbone.get_config().items()) if k.startswith("rope_")}
    if head_dim % 2:
        raise ValueError(
            f"Rotary positions need an even head size. Received: head size {head_dim}")
    probe = np.random.default_rng(0).standard_normal(
        (1, _ROTARY_PROBE_LENGTH, 1, head_dim)).astype("float32")
    ours = ops.convert_to_numpy(la_ops.apply_rotary(probe, wavelength))
    theirs = ops.convert_to_numpy(ops.cast(rotary(ops.convert_to_tensor(probe)), "float32"))
    error = float(np.max(np.abs(ours - theirs)))
    # Rounding of the angles alone in float32; of the result in 16 bits.
    tolerance = 1e-3 if keras.backend.standardize_dtype(rotary.compute_dtype) == "float32" \
        else 5e-2
    if not math.isfinite(error) or error > tolerance:
        settings = ", ".join(f"{k}={v!r}" for k, v in rope.items())
        raise ValueError(
            "The backbone's rotary embedding differs from keras_longattn's "
            f"rotary positions of max_wavelength={wavelength} (max difference "
            f"{error:.3g} over {_ROTARY_PROBE_LENGTH} positions): our layers have "
            f"no position scaling or frequency adjustment. Received: {settings}")


def extend_positions(table, length):
    """A learned position table of ``length`` rows made by repeating
    ``table`` (``(L, dim)``): row ``i`` is ``table[i mod L]``."""
    table = np.asarray(table)
    return table[np.arange(length) % table.shape[0]]


def _expand_heads(value, shape):
    """A local key or value projection (kernel ``(dim, H_kv, d)``, bias
    ``(H_kv, d)``) repeated to the ``H`` heads of a global projection of
    ``shape``: head ``h`` of the result is key/value head ``h // (H / H_kv)``,
    the grouping of grouped-query attention (``expand_key_value_heads``:
    each key/value head serves its group of consecutive query heads), so
    that the global rows start as the local attention they extend. Any
    other mismatch is left for the caller's shape check."""
    if value.ndim != len(shape) or tuple(value.shape) == tuple(shape):
        return value
    axis = value.ndim - 2  # the heads: (dim, H, d) kernels, (H, d) biases
    others = [i for i in range(value.ndim) if i != axis]
    if (
        any(value.shape[i] != shape[i] for i in others)
        or shape[axis] % value.shape[axis]
    ):
        return value
    return np.repeat(value, shape[axis] // value.shape[axis], axis=axis)


def _copy_weights(source, target):
    """Assigns every variable of ``target`` from the variable of ``source``
    with the same path (the converted attention layers keep the names of
    keras-hub's projections), position tables extended
    (:func:`extend_positions`). A variable of one of our attention layers
    without a counterpart is the layer's own state: Longformer's global
    projections (``query_global`` ...) start as copies of the local ones,
    as in the Longformer paper (with grouped-query attention, the key and
    value projections repeated to every query head of their group,
    :func:`_expand_heads`); others (Linformer's projections, Routing's
    centroids, Performer's features, ...) keep their initialization. Any
    other variable without a counterpart of the same shape, or a variable
    of ``source`` left over, is a RuntimeError. Returns the paths of the
    variables that kept their initialization."""
    sources = {v.path: v for v in source.weights}
    if len(sources) != len(source.weights):  # pragma: no cover - Keras paths are unique
        raise RuntimeError(f"Variable paths of {source.name!r} are not unique")
    tables = {
        id(layer.position_embeddings)
        for layer in target._flatten_layers()
        if isinstance(layer, PositionEmbedding)
    }
    attention_paths = tuple(
        block._self_attention_layer.path + "/" for block in target.transformer_layers)
    used, initialized = set(), []
    for variable in target.weights:
        path = variable.path
        old = sources.get(path)
        if old is None and path.startswith(attention_paths):
            head, _, tail = path.rpartition("/")
            prefix, _, projection = head.rpartition("/")
            local = projection[: -len("_global")] if projection.endswith("_global") else None
            old = sources.get(f"{prefix}/{local}/{tail}") if local else None
            if old is None:
                initialized.append(path)
                continue
        if old is None:
            raise RuntimeError(
                f"No weight of {source.name!r} for {path!r} of the converted backbone")
        value = ops.convert_to_numpy(old)
        if id(variable) in tables:
            value = extend_positions(value, variable.shape[0])
        elif old.path != path:  # a global projection from a local one
            value = _expand_heads(value, tuple(variable.shape))
        if tuple(value.shape) != tuple(variable.shape):
            raise RuntimeError(
                f"{path!r}: shape {tuple(value.shape)} in the backbone, "
                f"{tuple(variable.shape)} in the converted one")
        variable.assign(value)
        used.add(old.path)
    left = sorted(set(sources) - used)
    if left:
        raise RuntimeError(f"Weights of {source.name!r} not carried over: {left}")
    return initialized
