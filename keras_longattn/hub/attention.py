"""The attention config a converted backbone holds, and how its blocks build and call our layer."""

import json

import keras
from keras import ops

from keras_longattn.hub._keras_hub import Backbone

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

    def _build_decoder_graph(self, dtype, **kwargs):
        """The functional graph of keras-hub's Llama and Mistral backbones,
        from ``self.token_embedding``, ``self.transformer_layers`` and
        ``self.layer_norm``: token ids and padding mask in, every block
        called with the padding mask, the final norm out."""
        token_id_input = keras.Input(shape=(None,), dtype="int32", name="token_ids")
        padding_mask_input = keras.Input(shape=(None,), dtype="int32", name="padding_mask")
        x = self.token_embedding(token_id_input)
        for transformer_layer in self.transformer_layers:
            x = transformer_layer(x, decoder_padding_mask=padding_mask_input)
        Backbone.__init__(
            self,
            inputs={"token_ids": token_id_input, "padding_mask": padding_mask_input},
            outputs=self.layer_norm(x), dtype=dtype, **kwargs)


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
