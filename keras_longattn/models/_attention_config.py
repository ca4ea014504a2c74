"""Turns the ``attention`` argument of the blocks and builders into layers.

Accepted forms of one attention specification:

* a Keras layer instance with the call signature of
  ``keras.layers.MultiHeadAttention`` (a template: builders clone it
  through its config; blocks use it as is);
* a config dict ``{"class_name": ..., "config": {...}}`` as produced by
  ``keras.saving.serialize_keras_object(layer)`` or
  ``keras.layers.serialize(layer)``. The short form without ``module`` /
  ``registered_name`` is accepted for the layers of
  ``keras_longattn.layers`` and ``keras.layers``, and ``class_name`` may be a
  Keras-registered name ``"package>Class"`` or ``"package.module:Class"``;
* a class name string, e.g. ``"FullAttention"`` (same as
  ``{"class_name": "FullAttention", "config": {}}``).

Configs are turned into layers by the resolver that the benchmark and the
LRA-style suite use too (:func:`keras_longattn.specs.resolver.build_layer`),
without importing modules (``import_modules=False``): a config, which may
come from a saved model file, names a class among the modules imported
already. The capability checks (:func:`check_capabilities`) are the
resolver's too.
"""

import copy

import keras

from keras_longattn.specs.resolver import build_layer
from keras_longattn.specs.resolver import check_capabilities
from keras_longattn.specs.resolver import describe_spec as _describe
from keras_longattn.specs.resolver import library_layers

__all__ = [
    "DEFAULT_ATTENTION",
    "adopt",
    "build_layer",
    "check_capabilities",
    "deserialize_attention",
    "library_layers",
    "make_attention_layers",
    "to_config",
]

DEFAULT_ATTENTION = {"class_name": "LocalAttention", "config": {"window": 128}}

_OWNER_ATTR = "_keras_longattn_owner"


def to_config(spec, name="attention"):
    """One attention specification as a (deep-copied) config dict."""
    if isinstance(spec, keras.layers.Layer):
        config = keras.saving.serialize_keras_object(spec)
    elif isinstance(spec, str):
        config = {"class_name": spec, "config": {}}
    elif isinstance(spec, dict) and isinstance(spec.get("class_name"), str):
        config = copy.deepcopy(spec)
        config.setdefault("config", {})
        if not isinstance(config["config"], dict):
            raise ValueError(
                f"The 'config' entry of `{name}` must be a dict. "
                f"Received: {name}={spec!r}"
            )
    else:
        raise ValueError(
            f"`{name}` must be an attention layer instance, a config dict "
            "{'class_name': ..., 'config': {...}} (as produced by "
            "`keras.saving.serialize_keras_object(layer)`) or a class name "
            "string; callables (factories) are not accepted because a saved "
            f"model must be rebuilt from its config. Received: {name}="
            f"{_describe(spec)}"
        )
    config.pop("build_config", None)
    config.pop("compile_config", None)
    return config


def deserialize_attention(spec, name="attention"):
    """An attention layer from an instance (returned as is), a config dict
    or a class name string, through :func:`build_layer` (the resolver of the
    benchmark and the suite) without importing modules.

    Raises:
        ValueError: ``spec`` is no specification, or its layer cannot be
            made (unknown class, an option its constructor does not accept,
            a value the constructor refuses); the message names ``name``
            and repeats ``spec``.
    """
    if isinstance(spec, keras.layers.Layer):
        return spec
    config = to_config(spec, name)
    try:
        return build_layer(config, import_modules=False)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise ValueError(
            f"`{name}` could not be turned into a layer "
            f"({type(error).__name__}: {error}). Received: {name}={spec!r}"
        ) from error


def adopt(layer, owner):
    """Records that ``owner`` (a sublayer) uses ``layer``; refuses a layer
    that another sublayer already took, since the two would silently share
    their weights."""
    previous = getattr(layer, _OWNER_ATTR, None)
    if previous is not None and previous[0] != id(owner):
        raise ValueError(
            f"The attention layer {layer.name!r} ({type(layer).__name__}) is "
            f"already used by the sublayer {previous[1]!r}; two sublayers "
            "sharing one instance would share their weights silently. Pass a "
            "config (`keras.saving.serialize_keras_object(layer)`) or a fresh "
            f"instance for each sublayer. Received: attention={_describe(layer)}"
        )
    # Plain attribute (no Keras tracking): (id, name) of the owner.
    object.__setattr__(layer, _OWNER_ATTR, (id(owner), owner.name))
    return layer


def make_attention_layers(
    attention,
    num_attention,
    *,
    dim,
    num_heads,
    rotary_max_wavelength=None,
    sequence_length=None,
    causal=None,
    context=None,
):
    """One fresh attention layer per ``"s"`` of a layer pattern.

    Args:
        attention: None (the default ``LocalAttention(window=128)``), one
            specification used for every ``"s"``, or a list/tuple with one
            specification per ``"s"``. Instances are templates: each
            ``"s"`` gets a clone built from the instance's config (the
            instance's weights are not copied).
        num_attention: the number of ``"s"`` in the pattern.
        dim: model width; ``key_dim`` defaults to ``dim // num_heads``.
        num_heads: fills ``num_heads`` where a config lacks it.
        rotary_max_wavelength: when set, written into every config.
        sequence_length: when known, passed to the layers'
            ``check_sequence_length(n)`` hook (if they define one) and
            checked against their ``max_length`` (see
            :func:`check_capabilities`).
        causal: whether the layers will be called with
            ``use_causal_mask=True``; when not None, checked against their
            ``supports_causal`` / ``supports_bidirectional``.
        context: the arguments behind ``causal`` and ``sequence_length``,
            as text for the error messages (see :func:`check_capabilities`).

    Returns:
        A list of ``num_attention`` unbuilt layers.
    """
    if attention is None:
        specs = [DEFAULT_ATTENTION] * num_attention
        names = ["attention"] * num_attention
    elif isinstance(attention, (list, tuple)):
        if len(attention) != num_attention:
            raise ValueError(
                "A list of attention specifications needs one entry per 's' "
                f"of `layer_pattern` ({num_attention}). Received: "
                f"attention with {len(attention)} entries: "
                f"{[_describe(a) for a in attention]}"
            )
        seen = {}
        for i, spec in enumerate(attention):
            if isinstance(spec, keras.layers.Layer):
                if id(spec) in seen:
                    raise ValueError(
                        f"attention[{seen[id(spec)]}] and attention[{i}] are "
                        f"the same layer instance {_describe(spec)}; sublayers "
                        "never share an attention layer (its weights would be "
                        "shared silently). Pass distinct instances or configs. "
                        f"Received: attention={[_describe(a) for a in attention]}"
                    )
                seen[id(spec)] = i
        specs = list(attention)
        names = [f"attention[{i}]" for i in range(num_attention)]
    else:
        specs = [attention] * num_attention
        names = ["attention"] * num_attention

    layers = []
    for spec, name in zip(specs, names):
        config = to_config(spec, name)
        inner = config["config"]
        # Several sublayers may come from one spec: let Keras name each one.
        inner.pop("name", None)
        if "num_heads" not in inner:
            inner["num_heads"] = num_heads
        if "key_dim" not in inner and isinstance(inner["num_heads"], int):
            if dim % inner["num_heads"]:
                raise ValueError(
                    f"`dim` must be divisible by `num_heads` to give "
                    f"{name} a key_dim. Received: dim={dim}, "
                    f"num_heads={inner['num_heads']}"
                )
            inner["key_dim"] = dim // inner["num_heads"]
        if rotary_max_wavelength is not None:
            plain = deserialize_attention(config, name)
            inner["rotary_max_wavelength"] = rotary_max_wavelength
            try:
                layer = build_layer(config, import_modules=False)
            except Exception as error:  # noqa: BLE001
                raise ValueError(
                    "positions='rotary' sets `rotary_max_wavelength` on every "
                    f"attention layer, but {name} ({type(plain).__name__}) "
                    f"cannot take it ({type(error).__name__}: {error}). Use "
                    "positions='learned' or None, or an attention that "
                    "accepts rotary positions (even key_dim). "
                    f"Received: positions='rotary', {name}={_describe(spec)}"
                ) from error
        else:
            layer = deserialize_attention(config, name)
        if sequence_length is not None:
            check = getattr(layer, "check_sequence_length", None)
            if callable(check):
                check(sequence_length)
        check_capabilities(layer, name, spec, causal=causal,
                           sequence_length=sequence_length, context=context)
        layers.append(layer)
    return layers
