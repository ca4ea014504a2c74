"""Turns the ``attention`` argument of the blocks and builders into layers.

Accepted forms of one attention specification:

* a Keras layer instance with the call signature of
  ``keras.layers.MultiHeadAttention`` (a template: builders clone it
  through its config; blocks use it as is);
* a config dict ``{"class_name": ..., "config": {...}}`` as produced by
  ``keras.saving.serialize_keras_object(layer)`` or
  ``keras.layers.serialize(layer)``. The short form without ``module`` /
  ``registered_name`` is accepted for the layers of
  ``keras_longattn.layers`` and ``keras.layers``;
* a class name string, e.g. ``"FullAttention"`` (same as
  ``{"class_name": "FullAttention", "config": {}}``).
"""

import copy
import inspect
import numbers

import keras

DEFAULT_ATTENTION = {"class_name": "LocalAttention", "config": {"window": 128}}

_OWNER_ATTR = "_keras_longattn_owner"


def library_layers():
    """``{class name: class}`` of the layers in ``keras_longattn.layers``."""
    from keras_longattn import layers as la_layers

    return {
        name: obj
        for name, obj in vars(la_layers).items()
        if inspect.isclass(obj) and issubclass(obj, keras.layers.Layer)
    }


def _describe(spec):
    if isinstance(spec, keras.layers.Layer):
        return f"<{type(spec).__name__} {spec.name!r}>"
    return repr(spec)


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
    or a class name string."""
    if isinstance(spec, keras.layers.Layer):
        return spec
    config = to_config(spec, name)
    custom = library_layers()
    builtin = getattr(keras.layers, config["class_name"], None)
    if (config["class_name"] not in custom and inspect.isclass(builtin)
            and issubclass(builtin, keras.layers.Layer)):
        # The short form of a keras.layers class (no "module" entry), e.g.
        # {"class_name": "MultiHeadAttention", "config": {...}}.
        custom[config["class_name"]] = builtin
    try:
        layer = keras.layers.deserialize(config, custom_objects=custom)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise ValueError(
            f"`{name}` could not be turned into a layer "
            f"({type(error).__name__}: {error}). Received: {name}={spec!r}"
        ) from error
    if not isinstance(layer, keras.layers.Layer):
        raise ValueError(
            f"`{name}` must describe a Keras layer. Received: {name}={spec!r} "
            f"(which gives a {type(layer).__name__})"
        )
    return layer


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


def check_capabilities(layer, name, spec, *, causal=None, sequence_length=None,
                       context=None):
    """Refuses an attention layer that could never run in the stack being
    built, from the capabilities its class declares.

    * ``supports_causal`` False with ``causal`` True (and
      ``supports_bidirectional`` False with ``causal`` False): the layer
      has no such mode (e.g. ``LinformerAttention``, ``NystromAttention``,
      ``AdaMRAAttention`` have no causal mode);
    * an integer ``max_length`` below ``sequence_length``: the layer's
      weights are sized for at most ``max_length`` positions (e.g.
      ``LinformerAttention``, ``SynthesizerAttention``).

    Layers that declare neither (``keras.layers.MultiHeadAttention``) pass.

    Args:
        layer: the attention layer.
        name: the argument it came from (``"attention"``, ``"attention[1]"``).
        spec: what the caller passed for ``name`` (repeated in the message).
        causal: whether the stack calls the layer with
            ``use_causal_mask=True``; None skips the mode checks.
        sequence_length: the number of positions the layer will see; None
            skips the length check.
        context: the arguments that fixed ``causal`` and ``sequence_length``,
            as text for the message (e.g. ``"sequence_length=32, pooling='cls'
            (the class token adds a position)"``). Defaults to
            ``"causal=..., sequence_length=..."``.

    Raises:
        ValueError: naming ``name`` and the value received.
    """
    cls_name = type(layer).__name__
    if context is None:
        parts = []
        if causal is not None:
            parts.append(f"causal={bool(causal)}")
        if sequence_length is not None:
            parts.append(f"sequence_length={sequence_length}")
        context = ", ".join(parts)
    received = f"Received: {name}={_describe(spec)}" + (
        f", {context}" if context else ""
    )
    if causal is not None:
        if causal and getattr(layer, "supports_causal", True) is False:
            raise ValueError(
                f"`{name}` must have a causal mode: every attention layer of a "
                f"causal stack is called with use_causal_mask=True, and "
                f"{cls_name} has none ({cls_name}.supports_causal is False). "
                "Use an attention that supports causal calls (e.g. "
                f"LocalAttention, FullAttention). {received}"
            )
        if not causal and getattr(layer, "supports_bidirectional", True) is False:
            raise ValueError(
                f"`{name}` must support bidirectional calls: every attention "
                "layer of a non-causal stack is called with "
                f"use_causal_mask=False, and {cls_name} only supports causal "
                f"attention ({cls_name}.supports_bidirectional is False). "
                f"{received}"
            )
    max_length = getattr(layer, "max_length", None)
    if (
        sequence_length is not None
        and isinstance(max_length, numbers.Integral)
        and not isinstance(max_length, bool)
        and sequence_length > max_length
    ):
        raise ValueError(
            f"`{name}` takes at most max_length={int(max_length)} positions "
            f"({cls_name} sizes its weights by it), but its sequences have "
            f"{sequence_length} positions. Give the attention a max_length >= "
            f"{sequence_length} or use shorter sequences. {received}"
        )


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
                layer = keras.layers.deserialize(
                    config, custom_objects=library_layers()
                )
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
