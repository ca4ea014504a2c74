"""The one resolver from a layer spec to a Keras layer.

The benchmark (``keras-longattn bench``), the LRA-style suite
(``keras-longattn lra``) and the model builders (:mod:`keras_longattn.models`)
all turn a layer config (see :mod:`keras_longattn.specs.layer_spec`) into a
layer here:

* :func:`resolve_class` finds the class: ``"package.module:Class"``,
  ``"package>Class"`` (a Keras-registered name), a ``module`` and/or
  ``registered_name`` entry as written by
  ``keras.saving.serialize_keras_object``, or a bare class name looked up in
  ``keras_longattn.layers``, then ``keras.layers``, then among the
  Keras-registered objects;
* :func:`check_config` refuses a config key that the class's constructor
  does not accept, naming it and the accepted ones;
* :func:`build_layer` does both and constructs the layer with
  ``keras.saving.deserialize_keras_object``;
* :func:`check_capabilities` refuses a layer that could never run where it
  is put: no causal mode in a causal stack, no bidirectional mode in a
  bidirectional one, a ``max_length`` below the sequence length.

Resolving a class may import the module that the config names (configs
given to the benchmark and the suite are code, from a trusted source); with
``import_modules=False``, as the model builders resolve (their configs may
come from a saved model file), only modules already imported are used.

Keras and the layer's module are imported inside the functions, so that
importing this module imports no backend.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import sys
from typing import Any, Iterable, Mapping

from .layer_spec import LayerConfigError, LayerSpec, LayerUnavailableError, as_layer_config

__all__ = [
    "resolve_class",
    "accepted_options",
    "check_config",
    "build_layer",
    "check_specs",
    "library_layers",
    "describe_spec",
    "check_capabilities",
]

#: Keyword arguments of ``keras.layers.Layer`` that every Keras layer accepts.
_BASE_LAYER_KWARGS = frozenset({"name", "dtype", "trainable", "autocast",
                                "activity_regularizer"})


def _import(module_name: str, what: str, import_modules: bool = True):
    """The module ``module_name``; imported when ``import_modules``, else
    only taken from the modules imported already."""
    if not import_modules:
        module = sys.modules.get(module_name)
        if module is None:
            raise LayerUnavailableError(
                f"module {module_name!r} of {what} is not imported, and this config is "
                "resolved without importing modules (import_modules=False, as the model "
                "builders do: a saved model could name any module); import it first"
            )
        return module
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise LayerUnavailableError(f"cannot import module {module_name!r} of {what}: {exc}") \
            from exc


def _registered(name: str, import_modules: bool = True):
    """The class registered with Keras as ``name`` (``"package>Class"``)."""
    import keras

    found = keras.saving.get_registered_object(name)
    if found is None:
        # Registration happens on import: the project's layers, then (when
        # importing is allowed) the module named like the package part.
        importlib.import_module("keras_longattn.layers")
        package = name.partition(">")[0]
        if import_modules and package and package != "keras_longattn":
            try:
                importlib.import_module(package)
            except ImportError:
                pass
        found = keras.saving.get_registered_object(name)
    if found is None:
        raise LayerUnavailableError(
            f"no class is registered with Keras as {name!r}: decorate it with "
            "keras.saving.register_keras_serializable and make its module importable, "
            "or give it as 'package.module:Class'"
        )
    return found


def library_layers() -> dict[str, type]:
    """``{class name: class}`` of the layers in ``keras_longattn.layers``."""
    import keras

    project = importlib.import_module("keras_longattn.layers")
    return {
        name: obj
        for name, obj in vars(project).items()
        if inspect.isclass(obj) and issubclass(obj, keras.layers.Layer)
    }


def resolve_class(spec: LayerSpec | Mapping[str, Any], *,
                  import_modules: bool = True) -> type:
    """The layer class of a spec (imports Keras, and the class's module).

    ``"package.module:Class"`` is imported; ``"package>Class"`` and a
    ``registered_name`` are looked up among the Keras-registered objects
    (importing ``keras_longattn.layers``, and ``package`` when the name is
    not registered yet); a ``module`` with a bare ``class_name`` is imported;
    a bare class name is looked up in ``keras_longattn.layers``, then
    ``keras.layers``, then among the registered objects.

    Args:
        spec: a :class:`~keras_longattn.specs.layer_spec.LayerSpec` or a
            layer config dict.
        import_modules: import the modules that the config names. With
            ``False`` only modules imported already are used (the class of
            ``"package.module:Class"`` is found once ``package.module`` is
            imported), and a registered name is looked up without importing
            its package. Defaults to ``True``.

    Raises:
        LayerUnavailableError: the class cannot be imported or found.
        LayerConfigError: ``spec`` is not a layer config, or the object
            found is not a Keras layer class.
    """
    import keras

    data = as_layer_config(spec)
    class_name = data["class_name"]
    module = data.get("module")
    registered = data.get("registered_name")
    what = f"layer class {class_name!r}"
    if ":" in class_name:
        module_name, _, attribute = class_name.partition(":")
        obj: Any = _import(module_name, what, import_modules)
        for part in attribute.split("."):
            if not hasattr(obj, part):
                raise LayerUnavailableError(
                    f"layer class {class_name!r} not found: {module_name!r} has no "
                    f"attribute {attribute!r}"
                )
            obj = getattr(obj, part)
    elif ">" in class_name:
        obj = _registered(class_name, import_modules)
    else:
        imported = None
        if module and (import_modules or not registered):
            # Without imports, a registered name does not need its module.
            imported = _import(module, what, import_modules)
        if registered:
            obj = _registered(registered, import_modules)
        elif module:
            obj = getattr(imported, class_name, None)
            if obj is None:
                raise LayerUnavailableError(
                    f"layer class {class_name!r} not found in module {module!r}"
                )
        else:
            project = importlib.import_module("keras_longattn.layers")
            obj = getattr(project, class_name, None) or getattr(keras.layers, class_name, None)
            if obj is None:
                obj = keras.saving.get_registered_object(class_name)
            if obj is None:
                raise LayerUnavailableError(
                    f"unknown layer class {class_name!r}: not in keras_longattn.layers nor "
                    "keras.layers; give it as 'package.module:Class' or as a "
                    "Keras-registered name 'package>Class'"
                )
    if not (isinstance(obj, type) and issubclass(obj, keras.layers.Layer)):
        raise LayerConfigError(f"{class_name!r} is {obj!r}, not a Keras layer class")
    return obj


def accepted_options(cls: type) -> set[str]:
    """Keyword arguments that ``cls(...)`` accepts by name.

    Follows ``**kwargs`` up the class hierarchy: the named parameters of every
    ``__init__`` reached through ``**kwargs`` count (for example ``dropout``
    of a base class), and so do those of ``keras.layers.Layer`` (``name``,
    ``dtype``, ``trainable``...).
    """
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            break
        var_keyword = False
        for param in parameters:
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                var_keyword = True
            elif param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                inspect.Parameter.KEYWORD_ONLY):
                names.add(param.name)
        if not var_keyword:
            break
    names.discard("self")
    return names | _BASE_LAYER_KWARGS


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_config(cls: type, config: Mapping[str, Any], label: str | None = None) -> None:
    """Raise if ``config`` has a key that the constructor of ``cls`` does not accept.

    Raises:
        LayerConfigError: names the unknown options, the layer and the
            accepted names (``unknown_options`` lists them).
    """
    accepted = accepted_options(cls)
    unknown = [key for key in config if key not in accepted]
    if unknown:
        who = f"layer {label!r} ({_class_path(cls)})" if label else _class_path(cls)
        plural = "s" if len(unknown) > 1 else ""
        raise LayerConfigError(
            f"{who} does not accept the option{plural} "
            f"{', '.join(map(repr, unknown))}; accepted options: "
            f"{', '.join(sorted(accepted))}",
            layer=label,
            unknown_options=unknown,
        )


def _uses_keras_from_config(cls: type) -> bool:
    """Whether ``cls.from_config`` is Keras's ``Layer.from_config``, which
    passes every config key to the constructor."""
    import keras

    own = getattr(cls.from_config, "__func__", None)
    return own is not None and own is getattr(keras.layers.Layer.from_config, "__func__", None)


def build_layer(spec: LayerSpec | Mapping[str, Any], label: str | None = None, *,
                import_modules: bool = True):
    """Build the layer of a resolved spec (see
    :func:`~keras_longattn.specs.layer_spec.resolve_spec`).

    Resolves the class (:func:`resolve_class`), checks the config against
    its constructor (:func:`check_config`; a class with its own
    ``from_config``, which may take keys that are not constructor
    arguments, decides for itself) and deserialises it with
    ``keras.saving.deserialize_keras_object``, which calls
    ``cls.from_config(config)``. The layer is not built (no weights).

    Args:
        spec: a layer config dict or a
            :class:`~keras_longattn.specs.layer_spec.LayerSpec`, without
            placeholders.
        label: the layer's label, for messages. Defaults to the spec's label.
        import_modules: see :func:`resolve_class`. Defaults to ``True``.

    Returns:
        The new layer.

    Raises:
        LayerConfigError: an invalid config, or an option that the
            constructor does not accept.
        LayerUnavailableError: the class cannot be imported or found.
        Exception: what the class's ``from_config`` raises (wrapped by
            Keras).
    """
    import keras

    if label is None and isinstance(spec, LayerSpec):
        label = spec.label
    data = as_layer_config(spec)
    cls = resolve_class(data, import_modules=import_modules)
    if _uses_keras_from_config(cls):
        check_config(cls, data["config"], label)
    return keras.saving.deserialize_keras_object(
        {"class_name": cls.__name__, "config": dict(data["config"])},
        custom_objects={cls.__name__: cls},
    )


def check_specs(items: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Resolve, check and construct resolved layer configs, reporting errors.

    The benchmark and the suite call this before running (in their own
    process when Keras is imported there already, else in a worker
    subprocess), so that an unknown class or option is an argument error up
    front.

    Args:
        items: dicts ``{"label": ..., "layer_spec": {...}}``.

    Returns:
        One dict per item: ``label``, ``layer_class`` (``"module.Class"``, or
        ``None``), ``error`` (the message, or ``None``) and
        ``unknown_options``.
    """
    results = []
    for item in items:
        label = item.get("label")
        result: dict[str, Any] = {"label": label, "layer_class": None, "error": None,
                                  "unknown_options": []}
        try:
            data = as_layer_config(item["layer_spec"])
            result["layer_class"] = _class_path(resolve_class(data))
            build_layer(data, label)
        except LayerConfigError as exc:
            result["error"] = str(exc)
            result["unknown_options"] = exc.unknown_options
        except Exception as exc:  # noqa: BLE001 - reported as the layer's error
            text = str(exc)
            # Keras' from_config puts the cause after the whole config.
            text = text.rpartition("Exception encountered:")[2]
            first = (text.strip().splitlines() or [""])[0]
            result["error"] = f"layer {label!r}: {type(exc).__name__}: {first}"
        results.append(result)
    return results


# ---------------------------------------------------------------------------
# Capabilities
# ---------------------------------------------------------------------------


def describe_spec(spec: Any) -> str:
    """How a message repeats a layer argument: ``<LocalAttention
    'local_attention'>`` for a layer, else ``repr(spec)``."""
    import keras

    if isinstance(spec, keras.layers.Layer):
        return f"<{type(spec).__name__} {spec.name!r}>"
    return repr(spec)


def check_capabilities(layer, name: str, spec: Any, *, causal: bool | None = None,
                       sequence_length: int | None = None,
                       context: str | None = None) -> None:
    """Refuses an attention layer that could never run where it is put, from
    the capabilities its class declares.

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
        causal: whether the layer is called with ``use_causal_mask=True``;
            None skips the mode checks.
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
    received = f"Received: {name}={describe_spec(spec)}" + (
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
