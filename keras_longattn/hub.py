"""Take a keras-hub model long: its attention swapped for ours, its weights kept.

:func:`longify` converts a keras-hub backbone (GPT-2, Llama, Mistral, BERT,
RoBERTa; built from its config or loaded from a preset) into the same
network in which every self-attention layer is one of this package's layers,
given as a Keras layer config such as
``{"class_name": "LocalAttention", "config": {"window": 128}}``. Our layer is
built with the backbone's heads, head size, key/value heads (grouped-query
attention) and rotary wavelength, and holds the trained query, key, value
and output projections. Norms, feed-forward networks and embeddings keep
their weights; a learned position table (GPT-2, BERT, RoBERTa) is extended to
``max_sequence_length`` by repeating the trained table, as the Longformer
paper (Beltagy et al. 2020) made RoBERTa long.

The result is a new backbone of a subclass of the original class
(:class:`LongGPT2Backbone`, :class:`LongLlamaBackbone`,
:class:`LongMistralBackbone`, :class:`LongBertBackbone`,
:class:`LongRobertaBackbone`): keras-hub's functional graph rebuilt with
blocks that subclass keras-hub's (:class:`LongTransformerDecoder`,
:class:`LongLlamaTransformerDecoder`, :class:`LongMistralTransformerDecoder`,
:class:`LongTransformerEncoder`). A new model rather than the original
edited in place, because a Keras functional graph cannot swap a layer once
it has been called, and because a subclass keeps every attribute keras-hub's
tasks read (``GPT2CausalLM(backbone=...)``,
``BertTextClassifier(backbone=...)``) and saves and loads as ``.keras`` from
its config. keras-hub's blocks build a dense ``(B, T, T)`` mask (causal AND
padding, and Mistral's band) for their attention; the blocks here pass the
``(B, T)`` padding mask (``value_mask``) and the causal flag instead, so no
O(T^2) tensor reaches an efficient layer, and refuse a dense mask.

For generation, :class:`LongGPT2CausalLM`, :class:`LongLlamaCausalLM` and
:class:`LongMistralCausalLM` (keras-hub's tasks on a converted backbone) run
keras-hub's ``generate`` and samplers through our layers' own caches.

Needs keras-hub (``pip install keras-longattn[hub]``).
"""

import json
import math
import numbers

import keras
import numpy as np
from keras import ops

try:
    from keras_hub.src.layers.modeling.position_embedding import PositionEmbedding
    from keras_hub.src.layers.modeling.transformer_decoder import TransformerDecoder
    from keras_hub.src.layers.modeling.transformer_encoder import TransformerEncoder
    from keras_hub.src.layers.modeling.token_and_position_embedding import (
        TokenAndPositionEmbedding,
    )
    from keras_hub.src.models.backbone import Backbone
    from keras_hub.src.models.bert.bert_backbone import BertBackbone
    from keras_hub.src.models.bert.bert_backbone import bert_kernel_initializer
    from keras_hub.src.models.gpt2.gpt2_backbone import GPT2Backbone
    from keras_hub.src.models.gpt2.gpt2_backbone import _gpt_2_kernel_initializer
    from keras_hub.src.models.gpt2.gpt2_causal_lm import GPT2CausalLM
    from keras_hub.src.models.llama.llama_backbone import LlamaBackbone
    from keras_hub.src.models.llama.llama_backbone import _llama_kernel_initializer
    from keras_hub.src.models.llama.llama_causal_lm import LlamaCausalLM
    from keras_hub.src.models.llama.llama_decoder import LlamaTransformerDecoder
    from keras_hub.src.models.llama.llama_layernorm import LlamaLayerNorm
    from keras_hub.src.models.mistral.mistral_backbone import MistralBackbone
    from keras_hub.src.models.mistral.mistral_backbone import _mistral_kernel_initializer
    from keras_hub.src.models.mistral.mistral_causal_lm import MistralCausalLM
    from keras_hub.src.models.mistral.mistral_layer_norm import MistralLayerNormalization
    from keras_hub.src.models.mistral.mistral_transformer_decoder import (
        MistralTransformerDecoder,
    )
    from keras_hub.src.models.roberta.roberta_backbone import RobertaBackbone
    from keras_hub.src.models.roberta.roberta_backbone import roberta_kernel_initializer
    from keras_hub.src.utils.keras_utils import clone_initializer
    from keras_hub.src.utils.keras_utils import gelu_approximate
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "keras_longattn.hub converts keras-hub models and needs keras-hub: "
        "pip install keras-longattn[hub]"
    ) from error

from keras_longattn import ops as la_ops
from keras_longattn.models import generation as la_generation

#: Constructor arguments of our layers that the converter takes from the
#: backbone (an attention config may not set them).
_FROM_BACKBONE = (
    "num_heads",
    "key_dim",
    "value_dim",
    "num_key_value_heads",
    "use_bias",
    "output_shape",
    "rotary_max_wavelength",
    "name",
    "dtype",
)

#: Positions at which a backbone's rotary embedding is compared with
#: ``keras_longattn.ops.apply_rotary`` before a conversion.
_ROTARY_PROBE_LENGTH = 256


# ---------------------------------------------------------------- attention
def _attention_class(class_name):
    """The attention class of ``keras_longattn.layers`` named ``class_name``,
    or a ValueError naming it."""
    from keras_longattn import layers

    cls = getattr(layers, class_name, None) if isinstance(class_name, str) else None
    if not (
        isinstance(cls, type)
        and issubclass(cls, layers.BaseAttention)
        and cls is not layers.BaseAttention
    ):
        names = sorted(
            n for n in dir(layers)
            if isinstance(getattr(layers, n), type)
            and issubclass(getattr(layers, n), layers.BaseAttention)
            and getattr(layers, n) is not layers.BaseAttention
        )
        raise ValueError(
            "`attention['class_name']` must name an attention layer of "
            f"keras_longattn.layers (one of {names}). "
            f"Received: attention['class_name']={class_name!r}"
        )
    return cls


def attention_spec(attention):
    """``attention`` as ``{"class_name": ..., "config": {...}}``, checked.

    Args:
        attention: a Keras layer config of one of our attention layers: a
            dict with ``"class_name"`` (e.g. ``"LocalAttention"``) and an
            optional ``"config"`` of constructor arguments (e.g.
            ``{"window": 128}``). The heads, head size, key/value heads,
            biases and rotary wavelength come from the backbone and may not
            be set; ``dropout`` and the initializers default to the
            backbone's.

    Returns:
        A new dict ``{"class_name": str, "config": dict}``.
    """
    if not isinstance(attention, dict) or "class_name" not in attention:
        raise ValueError(
            "`attention` must be a Keras layer config: a dict with 'class_name' "
            "(an attention layer of keras_longattn.layers) and an optional "
            "'config', e.g. {'class_name': 'LocalAttention', 'config': "
            f"{{'window': 128}}}}. Received: attention={attention!r}"
        )
    cls = _attention_class(attention["class_name"])
    config = attention.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(
            "`attention['config']` must be a dict of constructor arguments. "
            f"Received: attention['config']={config!r}"
        )
    fixed = sorted(k for k in config if k in _FROM_BACKBONE)
    if fixed:
        raise ValueError(
            "`attention['config']` may not set "
            f"{', '.join(fixed)}: the converter takes them from the backbone "
            "(its heads, head size, key/value heads, biases and rotary "
            f"wavelength). Received: attention['config']={config!r}"
        )
    spec = {"class_name": cls.__name__, "config": dict(config)}
    try:  # JSON-serializable: it goes into the backbone's config.
        return json.loads(json.dumps(spec))
    except TypeError:
        raise ValueError(
            "`attention['config']` must hold JSON-serializable values (it is "
            f"saved in the backbone's config). Received: attention={attention!r}"
        ) from None


def _make_attention(spec, name, dtype, **backbone_args):
    """Our attention layer of ``spec`` with the backbone's structural
    arguments (``backbone_args``: heads, key_dim, biases, rotary, dropout,
    initializers; ``dropout`` and the initializers yield to ``spec``)."""
    cls = _attention_class(spec["class_name"])
    args = {
        k: backbone_args.pop(k)
        for k in ("dropout", "kernel_initializer", "bias_initializer")
        if k in backbone_args
    }
    args.update(spec["config"])
    args.update(backbone_args)
    return cls(name=name, dtype=dtype, **args)


def _replace_attention(block, new):
    """Puts ``new`` in place of ``block._self_attention_layer`` (built by
    keras-hub's ``build``), so that the replaced layer and its weights are
    no longer part of ``block``."""
    old = block._self_attention_layer
    # Keras tracks sublayers when they are set; reassigning the attribute
    # alone would keep the replaced one (and its weights) in the block.
    block._tracker.untrack(old)
    block._self_attention_layer = new
    if any(layer is old for layer in block._flatten_layers(include_self=False)):
        raise RuntimeError(  # pragma: no cover - a Keras internals change
            f"Could not remove the attention layer {old.name!r} of block "
            f"{block.name!r}")


class _AttentionSpecMixin:
    """Keeps the attention config of a block (or of every block of a
    backbone) as JSON, so that Keras does not wrap it in a tracked dict, and
    reads it back as a plain dict."""

    def _set_attention(self, attention):
        self._attention_json = json.dumps(attention_spec(attention))

    @property
    def attention(self):
        """The attention config ``{"class_name": ..., "config": {...}}``."""
        return json.loads(self._attention_json)

    def get_config(self):
        config = super().get_config()
        config["attention"] = self.attention
        return config


def _padding(mask):
    return None if mask is None else ops.cast(mask, "bool")


def _refuse_dense_mask(block, name, mask):
    if mask is not None:
        raise ValueError(
            f"{type(block).__name__} passes padding and causality to its "
            "attention structurally and takes no dense attention mask (it would "
            "build the O(T^2) tensor the efficient layers avoid). Pass the "
            f"padding mask instead. Received: {name} with shape "
            f"{tuple(mask.shape)}"
        )


# ------------------------------------------------------------------- blocks
@keras.saving.register_keras_serializable(package="keras_longattn")
class LongTransformerDecoder(_AttentionSpecMixin, TransformerDecoder):
    """keras-hub's ``TransformerDecoder`` (decoder-only: no cross-attention)
    whose self-attention is one of our layers.

    The feed-forward network, norms and dropout are keras-hub's. The
    attention gets the padding mask as ``value_mask`` and causality as
    ``use_causal_mask``; with ``self_attention_cache`` and
    ``self_attention_cache_update_index`` it decodes through the layer's own
    cache (``layer.init_cache``), as keras-hub's ``CausalLM.call_with_cache``
    calls its blocks.

    Args:
        intermediate_dim: the feed-forward network's hidden size.
        num_heads: the number of attention heads (head size:
            ``hidden_dim // num_heads``).
        attention: the attention layer's config (see :func:`attention_spec`).
        **kwargs: the other arguments of keras-hub's ``TransformerDecoder``.
    """

    def __init__(self, intermediate_dim, num_heads, attention, **kwargs):
        shape = kwargs.pop("decoder_sequence_shape", None)
        if kwargs.pop("encoder_sequence_shape", None):
            raise ValueError(
                "LongTransformerDecoder has no cross-attention. Received: "
                "encoder_sequence_shape")
        super().__init__(intermediate_dim, num_heads, **kwargs)
        self._set_attention(attention)
        if shape:
            self.build(shape)

    def build(self, decoder_sequence_shape, encoder_sequence_shape=None):
        if encoder_sequence_shape:
            raise ValueError(
                "LongTransformerDecoder has no cross-attention. Received: "
                f"encoder_sequence_shape={encoder_sequence_shape}")
        super().build(decoder_sequence_shape)
        hidden_dim = decoder_sequence_shape[-1]
        layer = _make_attention(
            self.attention,
            name="self_attention",
            dtype=self.dtype_policy,
            num_heads=self.num_heads,
            key_dim=hidden_dim // self.num_heads,
            use_bias=True,
            dropout=self.dropout,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
        )
        layer.build(decoder_sequence_shape, decoder_sequence_shape)
        _replace_attention(self, layer)

    def call(
        self,
        decoder_sequence,
        encoder_sequence=None,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        encoder_padding_mask=None,
        encoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        cross_attention_cache=None,
        cross_attention_cache_update_index=None,
        use_causal_mask=True,
        training=None,
    ):
        if encoder_sequence is not None:
            raise ValueError(
                "LongTransformerDecoder has no cross-attention. Received: "
                "encoder_sequence")
        _refuse_dense_mask(self, "decoder_attention_mask", decoder_attention_mask)
        x = decoder_sequence
        residual = x
        if self.normalize_first:
            x = self._self_attention_layer_norm(x)
        if self_attention_cache is not None:
            x, self_attention_cache = self._self_attention_layer(
                x, x, use_causal_mask=True, cache=self_attention_cache,
                cache_update_index=self_attention_cache_update_index,
                training=training)
        else:
            x = self._self_attention_layer(
                x, x, value_mask=_padding(decoder_padding_mask),
                use_causal_mask=use_causal_mask, training=training)
        x = self._self_attention_dropout(x, training=training)
        x = x + residual
        if not self.normalize_first:
            x = self._self_attention_layer_norm(x)
        residual = x
        if self.normalize_first:
            x = self._feedforward_layer_norm(x)
        x = self._feedforward_intermediate_dense(x)
        x = self._feedforward_output_dense(x)
        x = self._feedforward_dropout(x, training=training)
        x = x + residual
        if not self.normalize_first:
            x = self._feedforward_layer_norm(x)
        if self_attention_cache is not None:
            return x, self_attention_cache
        return x

    def get_config(self):
        config = super().get_config()
        config.pop("encoder_sequence_shape", None)
        config["attention"] = self.attention
        return config


def _gated_decoder_call(
    block,
    decoder_sequence,
    decoder_padding_mask,
    decoder_attention_mask,
    self_attention_cache,
    self_attention_cache_update_index,
    training,
):
    """The call of keras-hub's Llama and Mistral decoder blocks (pre-norm,
    gated feed-forward network) with our attention: padding as
    ``value_mask``, causal, decoding through the layer's cache."""
    _refuse_dense_mask(block, "decoder_attention_mask", decoder_attention_mask)
    residual = decoder_sequence
    x = block._self_attention_layernorm(decoder_sequence)
    if self_attention_cache is not None:
        x, self_attention_cache = block._self_attention_layer(
            x, x, use_causal_mask=True, cache=self_attention_cache,
            cache_update_index=self_attention_cache_update_index,
            training=training)
    else:
        x = block._self_attention_layer(
            x, x, value_mask=_padding(decoder_padding_mask),
            use_causal_mask=True, training=training)
    x = block._self_attention_dropout(x, training=training)
    x = x + residual
    residual = x
    x = block._feedforward_layernorm(x)
    gate_output = block._feedforward_gate_dense(x)
    gate_output = ops.cast(gate_output, "float32")
    gate_output = block.activation(gate_output)
    gate_output = ops.cast(gate_output, block.compute_dtype)
    x = block._feedforward_intermediate_dense(x)
    x = block._feedforward_output_dense(ops.multiply(x, gate_output))
    x = x + residual
    if self_attention_cache is not None:
        return x, self_attention_cache
    return x


class _GatedDecoderMixin(_AttentionSpecMixin):
    """The build and call shared by the Llama and Mistral blocks: our layer
    with the block's query and key/value heads, no biases and its rotary
    wavelength, in place of keras-hub's attention."""

    def __init__(self, intermediate_dim, num_query_heads, num_key_value_heads, attention,
                 **kwargs):
        super().__init__(intermediate_dim, num_query_heads, num_key_value_heads, **kwargs)
        self._set_attention(attention)

    def _head_size(self, hidden_dim):
        return hidden_dim // self.num_query_heads

    def build(self, decoder_sequence_shape):
        super().build(decoder_sequence_shape)
        hidden_dim = decoder_sequence_shape[-1]
        layer = _make_attention(
            self.attention,
            name="self_attention",
            dtype=self.dtype_policy,
            num_heads=self.num_query_heads,
            key_dim=self._head_size(hidden_dim),
            num_key_value_heads=self.num_key_value_heads,
            use_bias=False,
            rotary_max_wavelength=self.rope_max_wavelength,
            dropout=self.dropout,
            kernel_initializer=clone_initializer(self.kernel_initializer),
        )
        layer.build(decoder_sequence_shape, decoder_sequence_shape)
        _replace_attention(self, layer)

    def call(
        self,
        decoder_sequence,
        decoder_padding_mask=None,
        decoder_attention_mask=None,
        self_attention_cache=None,
        self_attention_cache_update_index=None,
        training=None,
    ):
        return _gated_decoder_call(
            self, decoder_sequence, decoder_padding_mask, decoder_attention_mask,
            self_attention_cache, self_attention_cache_update_index, training)


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongLlamaTransformerDecoder(_GatedDecoderMixin, LlamaTransformerDecoder):
    """keras-hub's ``LlamaTransformerDecoder`` whose grouped-query attention
    is one of our layers: ``num_query_heads`` heads of
    ``hidden_dim // num_query_heads``, ``num_key_value_heads`` key/value
    heads, no biases, rotary positions of ``rope_max_wavelength``
    (``rotary_max_wavelength``). Causal; padding goes to the layer as
    ``value_mask``; decodes through the layer's cache. ``dropout`` drops
    attention weights in our layer where keras-hub's ``LlamaAttention``
    drops its attention output (the same at inference).

    Args:
        intermediate_dim: the gated feed-forward network's hidden size.
        num_query_heads: the number of query heads.
        num_key_value_heads: the number of key/value heads.
        attention: the attention layer's config (see :func:`attention_spec`).
        **kwargs: the other arguments of keras-hub's
            ``LlamaTransformerDecoder``.
    """

    def get_config(self):
        # keras-hub 0.32's LlamaTransformerDecoder.get_config reads an
        # attribute it never sets (rope_scaling_factor): the config is
        # written here in full.
        config = keras.layers.Layer.get_config(self)
        config.update({
            "intermediate_dim": self.intermediate_dim,
            "num_query_heads": self.num_query_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "rope_max_wavelength": self.rope_max_wavelength,
            "rope_position_scaling_factor": self.rope_position_scaling_factor,
            "rope_frequency_adjustment_factor": self.rope_frequency_adjustment_factor,
            "rope_low_freq_factor": self.rope_low_freq_factor,
            "rope_high_freq_factor": self.rope_high_freq_factor,
            "rope_pretraining_sequence_length": self.rope_pretraining_sequence_length,
            "activation": keras.activations.serialize(self.activation),
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "dropout": self.dropout,
            "attention": self.attention,
        })
        return config


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongMistralTransformerDecoder(_GatedDecoderMixin, MistralTransformerDecoder):
    """keras-hub's ``MistralTransformerDecoder`` whose attention is one of
    our layers: ``num_query_heads`` heads of ``head_dim`` (default
    ``hidden_dim // num_query_heads``), ``num_key_value_heads`` key/value
    heads, no biases, rotary positions of ``rope_max_wavelength``. The
    pattern is the ``attention`` config's: Mistral's own band, query ``i``
    seeing keys ``i - sliding_window < j <= i``, is
    ``LocalAttention(window=sliding_window)``. ``dropout`` drops attention
    weights, as in :class:`LongLlamaTransformerDecoder`.

    Args:
        intermediate_dim: the gated feed-forward network's hidden size.
        num_query_heads: the number of query heads.
        num_key_value_heads: the number of key/value heads.
        attention: the attention layer's config (see :func:`attention_spec`).
        **kwargs: the other arguments of keras-hub's
            ``MistralTransformerDecoder``.
    """

    def _head_size(self, hidden_dim):
        return self.head_dim or hidden_dim // self.num_query_heads


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongTransformerEncoder(_AttentionSpecMixin, TransformerEncoder):
    """keras-hub's ``TransformerEncoder`` whose self-attention is one of our
    layers (bidirectional; the padding mask goes to it as ``value_mask``,
    so padded keys are hidden from every query and padded queries still
    get an output, as in keras-hub).

    Args:
        intermediate_dim: the feed-forward network's hidden size.
        num_heads: the number of attention heads (head size:
            ``hidden_dim // num_heads``).
        attention: the attention layer's config (see :func:`attention_spec`).
        **kwargs: the other arguments of keras-hub's ``TransformerEncoder``.
    """

    def __init__(self, intermediate_dim, num_heads, attention, **kwargs):
        super().__init__(intermediate_dim, num_heads, **kwargs)
        self._set_attention(attention)

    def build(self, inputs_shape):
        super().build(inputs_shape)
        hidden_dim = inputs_shape[-1]
        layer = _make_attention(
            self.attention,
            name="self_attention_layer",
            dtype=self.dtype_policy,
            num_heads=self.num_heads,
            key_dim=hidden_dim // self.num_heads,
            use_bias=True,
            dropout=self.dropout,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
        )
        layer.build(inputs_shape, inputs_shape)
        _replace_attention(self, layer)

    def call(
        self,
        inputs,
        padding_mask=None,
        attention_mask=None,
        training=None,
        return_attention_scores=False,
    ):
        _refuse_dense_mask(self, "attention_mask", attention_mask)
        x = inputs
        residual = x
        if self.normalize_first:
            x = self._self_attention_layer_norm(x)
        result = self._self_attention_layer(
            x, x, value_mask=_padding(padding_mask),
            return_attention_scores=return_attention_scores, training=training)
        x, scores = result if return_attention_scores else (result, None)
        x = self._self_attention_dropout(x, training=training)
        x = x + residual
        if not self.normalize_first:
            x = self._self_attention_layer_norm(x)
        residual = x
        if self.normalize_first:
            x = self._feedforward_layer_norm(x)
        x = self._feedforward_intermediate_dense(x)
        x = self._feedforward_output_dense(x)
        x = self._feedforward_dropout(x, training=training)
        x = x + residual
        if not self.normalize_first:
            x = self._feedforward_layer_norm(x)
        if return_attention_scores:
            return x, scores
        return x


# ---------------------------------------------------------------- backbones
@keras.saving.register_keras_serializable(package="keras_longattn")
class LongGPT2Backbone(_AttentionSpecMixin, GPT2Backbone):
    """keras-hub's ``GPT2Backbone`` with our attention in every block
    (:class:`LongTransformerDecoder`); :func:`longify` makes one from a
    trained ``GPT2Backbone``.

    The arguments are those of keras-hub's ``GPT2Backbone``, plus one.

    Args:
        attention: the attention layer's config (see :func:`attention_spec`).
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        attention,
        dropout=0.1,
        max_sequence_length=1024,
        dtype=None,
        **kwargs,
    ):
        # The graph of GPT2Backbone.__init__, with our blocks.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            input_dim=vocabulary_size, output_dim=hidden_dim,
            embeddings_initializer=_gpt_2_kernel_initializer(0.01), dtype=dtype,
            name="token_embedding")
        self.position_embedding = PositionEmbedding(
            initializer=_gpt_2_kernel_initializer(0.02),
            sequence_length=max_sequence_length,
            dtype=dtype, name="position_embedding")
        self.embeddings_add = keras.layers.Add(dtype=dtype, name="embeddings_add")
        self.embeddings_dropout = keras.layers.Dropout(
            dropout, dtype=dtype, name="embeddings_dropout")
        self.transformer_layers = [
            LongTransformerDecoder(
                intermediate_dim=intermediate_dim, num_heads=num_heads,
                attention=attention, dropout=dropout, layer_norm_epsilon=1e-05,
                activation=gelu_approximate,
                kernel_initializer=_gpt_2_kernel_initializer(0.02),
                normalize_first=True, dtype=dtype, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.layer_norm = keras.layers.LayerNormalization(
            axis=-1, epsilon=1e-05, dtype=dtype, name="layer_norm")
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        tokens = self.token_embedding(token_id_input)
        positions = self.position_embedding(tokens)
        x = self.embeddings_add((tokens, positions))
        x = self.embeddings_dropout(x)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, decoder_padding_mask=padding_mask_input)
        sequence_output = self.layer_norm(x)
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "padding_mask": padding_mask_input},
            outputs=sequence_output, dtype=dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self._set_attention(attention)


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongLlamaBackbone(_AttentionSpecMixin, LlamaBackbone):
    """keras-hub's ``LlamaBackbone`` with our attention in every block
    (:class:`LongLlamaTransformerDecoder`: grouped-query heads, rotary
    positions of ``rope_max_wavelength``); :func:`longify` makes one from a
    trained ``LlamaBackbone``.

    The arguments are those of keras-hub's ``LlamaBackbone``, plus one.

    Args:
        attention: the attention layer's config (see :func:`attention_spec`).
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_query_heads,
        hidden_dim,
        intermediate_dim,
        num_key_value_heads,
        attention,
        rope_max_wavelength=10000,
        rope_position_scaling_factor=1.0,
        rope_frequency_adjustment_factor=None,
        rope_low_freq_factor=None,
        rope_high_freq_factor=None,
        rope_pretraining_sequence_length=None,
        layer_norm_epsilon=1e-6,
        dropout=0,
        dtype=None,
        tie_word_embeddings=False,
        **kwargs,
    ):
        # The graph of LlamaBackbone.__init__, with our blocks.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            input_dim=vocabulary_size, output_dim=hidden_dim,
            tie_weights=tie_word_embeddings,
            embeddings_initializer=_llama_kernel_initializer(0.01),
            dtype=dtype, name="token_embedding")
        self.transformer_layers = [
            LongLlamaTransformerDecoder(
                intermediate_dim=intermediate_dim, num_query_heads=num_query_heads,
                num_key_value_heads=num_key_value_heads, attention=attention,
                rope_max_wavelength=rope_max_wavelength,
                rope_position_scaling_factor=rope_position_scaling_factor,
                rope_frequency_adjustment_factor=rope_frequency_adjustment_factor,
                rope_low_freq_factor=rope_low_freq_factor,
                rope_high_freq_factor=rope_high_freq_factor,
                rope_pretraining_sequence_length=rope_pretraining_sequence_length,
                layer_norm_epsilon=layer_norm_epsilon, activation=ops.silu,
                kernel_initializer=_llama_kernel_initializer(0.02), dropout=dropout, dtype=dtype,
                name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.layer_norm = LlamaLayerNorm(
            epsilon=layer_norm_epsilon, dtype=dtype, name="sequence_output_layernorm")
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        x = self.token_embedding(token_id_input)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, decoder_padding_mask=padding_mask_input)
        sequence_output = self.layer_norm(x)
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "padding_mask": padding_mask_input},
            outputs=sequence_output, dtype=dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_query_heads = num_query_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.num_key_value_heads = num_key_value_heads
        self.rope_max_wavelength = rope_max_wavelength
        self.rope_position_scaling_factor = rope_position_scaling_factor
        self.rope_frequency_adjustment_factor = rope_frequency_adjustment_factor
        self.rope_low_freq_factor = rope_low_freq_factor
        self.rope_high_freq_factor = rope_high_freq_factor
        self.rope_pretraining_sequence_length = rope_pretraining_sequence_length
        self.layer_norm_epsilon = layer_norm_epsilon
        self.dropout = dropout
        self.tie_word_embeddings = tie_word_embeddings
        self._set_attention(attention)

    def get_config(self):
        config = super().get_config()
        config["tie_word_embeddings"] = self.tie_word_embeddings
        config["attention"] = self.attention
        return config


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongMistralBackbone(_AttentionSpecMixin, MistralBackbone):
    """keras-hub's ``MistralBackbone`` with our attention in every block
    (:class:`LongMistralTransformerDecoder`); :func:`longify` makes one from
    a trained ``MistralBackbone``. ``LocalAttention`` with
    ``window=sliding_window`` is Mistral's own pattern.

    The arguments are those of keras-hub's ``MistralBackbone``, plus one.

    Args:
        attention: the attention layer's config (see :func:`attention_spec`).
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_query_heads,
        hidden_dim,
        intermediate_dim,
        num_key_value_heads,
        attention,
        rope_max_wavelength=10000,
        rope_scaling_factor=1.0,
        layer_norm_epsilon=1e-6,
        sliding_window=512,
        head_dim=None,
        dropout=0,
        dtype=None,
        **kwargs,
    ):
        # The graph of MistralBackbone.__init__, with our blocks.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            input_dim=vocabulary_size, output_dim=hidden_dim, tie_weights=False,
            embeddings_initializer=_mistral_kernel_initializer(stddev=0.01),
            dtype=dtype, name="token_embedding")
        self.transformer_layers = [
            LongMistralTransformerDecoder(
                intermediate_dim=intermediate_dim, num_query_heads=num_query_heads,
                num_key_value_heads=num_key_value_heads, attention=attention,
                rope_max_wavelength=rope_max_wavelength,
                rope_scaling_factor=rope_scaling_factor,
                layer_norm_epsilon=layer_norm_epsilon, activation=ops.silu,
                kernel_initializer=_mistral_kernel_initializer(stddev=0.02),
                sliding_window=sliding_window, head_dim=head_dim, dropout=dropout,
                dtype=dtype, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.layer_norm = MistralLayerNormalization(
            epsilon=layer_norm_epsilon, dtype=dtype, name="sequence_output_layernorm")
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        x = self.token_embedding(token_id_input)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, decoder_padding_mask=padding_mask_input)
        sequence_output = self.layer_norm(x)
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "padding_mask": padding_mask_input},
            outputs=sequence_output, dtype=dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_query_heads = num_query_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.rope_max_wavelength = rope_max_wavelength
        self.num_key_value_heads = num_key_value_heads
        self.rope_scaling_factor = rope_scaling_factor
        self.sliding_window = sliding_window
        self.head_dim = head_dim
        self.layer_norm_epsilon = layer_norm_epsilon
        self.dropout = dropout
        self._set_attention(attention)


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongBertBackbone(_AttentionSpecMixin, BertBackbone):
    """keras-hub's ``BertBackbone`` with our attention in every block
    (:class:`LongTransformerEncoder`); :func:`longify` makes one from a
    trained ``BertBackbone``.

    The arguments are those of keras-hub's ``BertBackbone``, plus one.

    Args:
        attention: the attention layer's config (see :func:`attention_spec`).
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        attention,
        dropout=0.1,
        max_sequence_length=512,
        num_segments=2,
        dtype=None,
        **kwargs,
    ):
        # The graph of BertBackbone.__init__, with our blocks.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            input_dim=vocabulary_size, output_dim=hidden_dim,
            embeddings_initializer=bert_kernel_initializer(), dtype=dtype,
            name="token_embedding")
        self.position_embedding = PositionEmbedding(
            initializer=bert_kernel_initializer(), sequence_length=max_sequence_length,
            dtype=dtype, name="position_embedding")
        self.segment_embedding = keras.layers.Embedding(
            input_dim=num_segments, output_dim=hidden_dim,
            embeddings_initializer=bert_kernel_initializer(), dtype=dtype,
            name="segment_embedding")
        self.embeddings_add = keras.layers.Add(dtype=dtype, name="embeddings_add")
        self.embeddings_layer_norm = keras.layers.LayerNormalization(
            axis=-1, epsilon=1e-12, dtype=dtype, name="embeddings_layer_norm")
        self.embeddings_dropout = keras.layers.Dropout(
            dropout, dtype=dtype, name="embeddings_dropout")
        self.transformer_layers = [
            LongTransformerEncoder(
                num_heads=num_heads, intermediate_dim=intermediate_dim,
                attention=attention, activation=gelu_approximate, dropout=dropout,
                layer_norm_epsilon=1e-12, kernel_initializer=bert_kernel_initializer(),
                dtype=dtype, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        self.pooled_dense = keras.layers.Dense(
            hidden_dim, kernel_initializer=bert_kernel_initializer(), activation="tanh",
            dtype=dtype, name="pooled_dense")
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        segment_id_input = keras.Input(shape=(None,), dtype="int32", name="segment_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        tokens = self.token_embedding(token_id_input)
        positions = self.position_embedding(tokens)
        segments = self.segment_embedding(segment_id_input)
        x = self.embeddings_add((tokens, positions, segments))
        x = self.embeddings_layer_norm(x)
        x = self.embeddings_dropout(x)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, padding_mask=padding_mask_input)
        sequence_output = x
        cls_token_index = 0
        pooled_output = self.pooled_dense(x[:, cls_token_index, :])
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "segment_ids": segment_id_input,
                    "padding_mask": padding_mask_input},
            outputs={"sequence_output": sequence_output, "pooled_output": pooled_output},
            dtype=dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self.num_segments = num_segments
        self.cls_token_index = cls_token_index
        self._set_attention(attention)


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongRobertaBackbone(_AttentionSpecMixin, RobertaBackbone):
    """keras-hub's ``RobertaBackbone`` with our attention in every block
    (:class:`LongTransformerEncoder`); :func:`longify` makes one from a
    trained ``RobertaBackbone`` (the Longformer paper's starting point).

    The arguments are those of keras-hub's ``RobertaBackbone``, plus one.

    Args:
        attention: the attention layer's config (see :func:`attention_spec`).
    """

    def __init__(
        self,
        vocabulary_size,
        num_layers,
        num_heads,
        hidden_dim,
        intermediate_dim,
        attention,
        dropout=0.1,
        max_sequence_length=512,
        dtype=None,
        **kwargs,
    ):
        # The graph of RobertaBackbone.__init__, with our blocks.
        self.embeddings = TokenAndPositionEmbedding(
            vocabulary_size=vocabulary_size, sequence_length=max_sequence_length,
            embedding_dim=hidden_dim, embeddings_initializer=roberta_kernel_initializer(),
            dtype=dtype, name="embeddings")
        self.token_embedding = self.embeddings.token_embedding
        self.embeddings_layer_norm = keras.layers.LayerNormalization(
            axis=-1, epsilon=1e-5, dtype=dtype, name="embeddings_layer_norm")
        self.embeddings_dropout = keras.layers.Dropout(
            dropout, dtype=dtype, name="embeddings_dropout")
        self.transformer_layers = [
            LongTransformerEncoder(
                num_heads=num_heads, intermediate_dim=intermediate_dim,
                attention=attention, activation="gelu", dropout=dropout,
                layer_norm_epsilon=1e-5, kernel_initializer=roberta_kernel_initializer(),
                dtype=dtype, name=f"transformer_layer_{i}")
            for i in range(num_layers)
        ]
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        x = self.embeddings(token_id_input)
        x = self.embeddings_layer_norm(x)
        x = self.embeddings_dropout(x)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, padding_mask=padding_mask_input)
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "padding_mask": padding_mask_input},
            outputs=x, dtype=dtype, **kwargs)
        self.vocabulary_size = vocabulary_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.dropout = dropout
        self.max_sequence_length = max_sequence_length
        self.start_token_index = 0
        self._set_attention(attention)


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


# ---------------------------------------------------------------- generation
class _LongCausalLMMixin:
    """keras-hub's ``CausalLM.generate`` through our layers' caches.

    keras-hub's tasks stack one full-length key/value cache per block,
    ``(B, num_layers, 2, max_length, heads, head_dim)``, prefill it with the
    whole padded ``max_length`` row and then overwrite positions from the
    shortest prompt on. Our caches are each layer's own
    (``layer.init_cache``: a ring of the window for ``LocalAttention``, a
    recurrent state for ``LinearAttention``), which cannot be rewound past
    what they hold. Here the stacked cache is the layers' empty caches and
    keras-hub's sampler starts at position 1: every prompt token goes
    through ``call_with_cache`` once, in order, inside the compiled sampler
    loop (the sampler keeps prompt tokens where ``padding_mask`` is True),
    so ragged prompts and every cache kind give the tokens of a full
    forward pass. keras-hub's ``call_with_cache`` is unchanged (it calls
    each block with ``self_attention_cache`` and
    ``self_attention_cache_update_index``).

    The prompt costs one step per token (keras-hub's compiled function sees
    the shortest prompt's length as a traced value, so it cannot be
    prefilled in one call of static shape). Greedy and beam search give
    keras-hub's tokens; a seeded random sampler (top-k, top-p, random) also
    draws at the prompt steps, so its numbers, not its distribution, differ
    from the original task's. The ``ContrastiveSampler`` (hidden states of
    every prompt position) is refused.

    Checked, as :class:`keras_longattn.models.CausalLanguageModel` checks
    them: :meth:`call_with_cache` refuses float ids, ids outside the
    vocabulary and (GPT-2) positions past the position table, before
    anything is written to the cache (see there for traced inputs);
    :meth:`init_caches` a bad ``batch_size`` or ``max_length``; a
    generation longer than GPT-2's position table (``max_length`` above the
    backbone's ``max_sequence_length``: keras-hub would clamp the positions
    on JAX) is refused before generating, and prompts given without a
    preprocessor must hold ids of the vocabulary.
    """

    def _attention_layers(self):
        return [block._self_attention_layer for block in self.backbone.transformer_layers]

    def _position_table_size(self):
        """The rows of the backbone's learned position table, or None
        (rotary positions: no table)."""
        if isinstance(self.backbone, _LEARNED_POSITIONS):
            return int(self.backbone.max_sequence_length)
        return None

    def _check_max_length(self, max_length):
        table = self._position_table_size()
        if table is not None and max_length > table:
            raise ValueError(
                "`max_length` must be at most the length of the backbone's learned "
                f"position table ({table}, its max_sequence_length; longify's "
                "max_sequence_length extends it). Received: "
                f"max_length={max_length}")

    def init_caches(self, batch_size, max_length):
        """The stacked empty caches of the blocks' attention layers for
        ``batch_size`` sequences of up to ``max_length`` tokens,
        ``(B, num_layers) + layer.cache_shape(B, max_length)[1:]`` (the
        ``cache`` of :meth:`call_with_cache`).

        Raises:
            ValueError: an attention without a decoding cache, a
                ``batch_size`` or ``max_length`` that is not a positive int,
                a ``max_length`` beyond the learned position table (GPT-2).
        """
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(
                    f"`{name}` must be a positive int. Received: {name}={value!r}")
        self._check_max_length(int(max_length))
        return self._empty_caches(int(batch_size), int(max_length))

    def _empty_caches(self, batch_size, max_length):
        for layer in self._attention_layers():
            reason = layer.decode_refusal()
            if reason is not None:
                raise ValueError(
                    f"{type(self).__name__} cannot generate: the attention of every "
                    f"block is {type(layer).__name__}, which has no decoding cache "
                    f"({reason}). Received: backbone.attention={self.backbone.attention}")
        caches = [layer.init_cache(batch_size, max_length) for layer in self._attention_layers()]
        dtype = caches[0].dtype
        return ops.stack([ops.cast(c, dtype) for c in caches], axis=1)

    def _build_cache(self, token_ids):
        """The empty caches for the padded ``token_ids`` ``(B, max_length)``
        of a generation (its static shape; the position table is checked by
        ``generate_step``)."""
        return self._empty_caches(token_ids.shape[0], token_ids.shape[1])

    def call_with_cache(self, token_ids, cache, cache_update_index):
        """keras-hub's ``call_with_cache`` (one forward pass of new tokens
        through the stacked caches of :meth:`init_caches`), with its inputs
        checked.

        Float (or bool) ``token_ids`` are refused with a ValueError naming the
        dtype; ids outside ``[0, vocabulary_size)`` and, with a learned
        position table (GPT-2), positions past it are refused with a
        ValueError when known at the call, and when the program runs when
        traced (``jax.jit``: ``JaxRuntimeError``; a TensorFlow graph:
        ``InvalidArgumentError``). Under XLA on TensorFlow, which cannot stop
        a program, a refused call returns NaN logits and hidden states and
        the cache it was given, unchanged. ``generate`` feeds checked
        prompts and the sampler's ids without these checks.
        """
        token_ids, bad = la_generation.check_token_ids(
            token_ids, self.backbone.vocabulary_size)
        table = self._position_table_size()
        if table is not None and token_ids.shape[1] is not None:
            cache_update_index, late = la_generation.check_positions(
                cache_update_index, int(token_ids.shape[1]), table,
                "the backbone's max_sequence_length")
            bad = la_generation.any_flag(bad, late)
        logits, hidden_states, new_cache = super().call_with_cache(
            token_ids, cache, cache_update_index)
        return la_generation.refuse_result(bad, logits, hidden_states, new_cache, cache)

    def _decode(self, token_ids, cache, cache_update_index):
        """keras-hub's ``call_with_cache`` without our checks."""
        return super().call_with_cache(token_ids, cache, cache_update_index)

    def generate(self, inputs, max_length=None, stop_token_ids="auto", strip_prompt=False):
        """keras-hub's ``generate``; without a preprocessor, the prompts
        (``{"token_ids", "padding_mask"}`` arrays, padded to the output
        length) are checked first: integer ids in the vocabulary on the
        prompt tokens, and, with a learned position table, an output length
        within it (ValueErrors; the compiled generation checks the length
        too, before generating, whatever the inputs)."""
        if self.preprocessor is None:
            self._check_prompts(inputs)
        return super().generate(inputs, max_length=max_length,
                                stop_token_ids=stop_token_ids, strip_prompt=strip_prompt)

    def _check_prompts(self, inputs):
        if not isinstance(inputs, dict) or "token_ids" not in inputs:
            return  # a dataset, or another structure keras-hub refuses
        try:
            token_ids = np.asarray(ops.convert_to_numpy(inputs["token_ids"]))
            mask = inputs.get("padding_mask")
            mask = None if mask is None else np.asarray(ops.convert_to_numpy(mask))
        except Exception:  # pragma: no cover - not concrete arrays
            return
        if not np.issubdtype(token_ids.dtype, np.integer):
            raise ValueError(
                "`token_ids` of the prompts must be integer token ids. Received: "
                f"token_ids with dtype {token_ids.dtype}")
        if token_ids.ndim:
            self._check_max_length(int(token_ids.shape[-1]))
        real = token_ids if mask is None or mask.shape != token_ids.shape \
            else token_ids[mask.astype(bool)]
        vocabulary = self.backbone.vocabulary_size
        if real.size and (real.min() < 0 or real.max() >= vocabulary):
            value = int(real.min() if real.min() < 0 else real.max())
            raise ValueError(
                f"`token_ids` of the prompts must be token ids in [0, {vocabulary}) "
                f"(the vocabulary size is {vocabulary}). Received: token id {value}")

    def generate_step(self, inputs, stop_token_ids=None):
        """One batch of generation (compiled by keras-hub's
        ``make_generate_function``): ``inputs`` is a dict of ``"token_ids"``
        and ``"padding_mask"`` ``(B, max_length)`` (True on each row's
        prompt, a prefix); returns the same dict with the generated tokens
        and the mask of the tokens up to each row's first new stop token."""
        from keras_hub.src.samplers.contrastive_sampler import ContrastiveSampler
        from keras_hub.src.utils.tensor_utils import any_equal

        if isinstance(self.sampler, ContrastiveSampler):
            raise ValueError(
                f"{type(self).__name__} does not run the ContrastiveSampler (it needs "
                "the hidden states of every prompt position, which a cache fed one "
                "prompt token per step does not give). Received: sampler="
                f"{type(self.sampler).__name__}")
        token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
        if token_ids.shape[1] is not None:  # static: refused before generating
            self._check_max_length(int(token_ids.shape[1]))
        cache = self._build_cache(token_ids)

        def next(prompt, cache, index):
            cache_update_index = index - 1
            batch_size = ops.shape(prompt)[0]
            prompt = ops.slice(prompt, [0, cache_update_index], [batch_size, 1])
            logits, hidden_states, cache = self._decode(prompt, cache, cache_update_index)
            return (ops.squeeze(logits, axis=1), ops.squeeze(hidden_states, axis=1), cache)

        token_ids = self.sampler(
            next=next,
            prompt=token_ids,
            cache=cache,
            index=1,
            mask=padding_mask,
            stop_token_ids=stop_token_ids,
            hidden_states=None,
            model=self,
        )
        if stop_token_ids is not None:
            end_locations = any_equal(token_ids, stop_token_ids, ops.logical_not(padding_mask))
            end_locations = ops.cast(end_locations, "int32")
            cumsum = ops.cast(ops.cumsum(end_locations, axis=-1), "int32")
            overflow = cumsum - end_locations
            padding_mask = ops.logical_not(ops.cast(overflow, "bool"))
        else:
            padding_mask = ops.ones_like(token_ids, dtype="bool")
        return {"token_ids": token_ids, "padding_mask": padding_mask}


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongGPT2CausalLM(_LongCausalLMMixin, GPT2CausalLM):
    """keras-hub's ``GPT2CausalLM`` on a :class:`LongGPT2Backbone`, whose
    ``generate`` decodes through our layers' caches (see
    :class:`_LongCausalLMMixin`). ``max_length`` is at most the backbone's
    ``max_sequence_length`` (its position table)."""

    backbone_cls = LongGPT2Backbone


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongLlamaCausalLM(_LongCausalLMMixin, LlamaCausalLM):
    """keras-hub's ``LlamaCausalLM`` on a :class:`LongLlamaBackbone`, whose
    ``generate`` decodes through our layers' caches (see
    :class:`_LongCausalLMMixin`)."""

    backbone_cls = LongLlamaBackbone


@keras.saving.register_keras_serializable(package="keras_longattn")
class LongMistralCausalLM(_LongCausalLMMixin, MistralCausalLM):
    """keras-hub's ``MistralCausalLM`` on a :class:`LongMistralBackbone`,
    whose ``generate`` decodes through our layers' caches (see
    :class:`_LongCausalLMMixin`)."""

    backbone_cls = LongMistralBackbone
