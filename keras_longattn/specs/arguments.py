"""The layer arguments of the benchmark and the suite: ``--layers`` and
``--option``, their errors, and their argparse conversion.

``keras-longattn bench`` and ``keras-longattn lra`` (and their Python entry
points :func:`keras_longattn.benchmarks.run_benchmark` and
:func:`keras_longattn.lra.run_suite`) take layers and options alike:

* layers (:func:`parse_layers`): registered short names
  (:mod:`keras_longattn.specs.registry`), class references
  (``"package>Class"``, ``"package.module:Class"``), Keras layer configs as
  dicts, JSON or ``@file.json`` (see :mod:`keras_longattn.specs.layer_spec`);
* options (:func:`parse_option`): ``name=value`` constructor arguments set in
  every layer's config, or ``label.name=value`` in one layer's
  (:func:`layer_options`).

An invalid value raises :class:`ArgumentError`, which names the argument;
:func:`argument_type` turns a parser into an argparse ``type``.

Nothing here imports Keras.
"""

from __future__ import annotations

import argparse
import ast
import json
from typing import Any, Callable, Iterable, Mapping, Sequence

from . import registry
from .layer_spec import (
    LayerConfigError,
    LayerSpec,
    is_class_reference,
    spec_from_dict,
    spec_from_reference,
)

__all__ = [
    "ArgumentError",
    "argument_type",
    "split_items",
    "parse_layers",
    "layer_options",
    "parse_value",
    "parse_option",
    "parse_options",
]


class ArgumentError(ValueError):
    """An invalid argument of the benchmark or the suite.

    Attributes:
        argument: the argument's name as in the Python entry point
            (``"lengths"``); the command line shows it as ``--lengths``.
        detail: what is wrong with it.
    """

    def __init__(self, argument: str, detail: str):
        self.argument = argument
        self.detail = detail
        super().__init__(f"invalid {argument!s}: {detail}")

    @property
    def flag(self) -> str:
        """The command-line flag of the argument (``--head-dim``)."""
        return "--" + self.argument.replace("_", "-")


def argument_type(parse: Callable[[str], Any], flag: str) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type``: an :class:`ArgumentError` it raises
    becomes an ``argparse.ArgumentTypeError`` with the error's detail, which
    argparse reports after the flag.

    Args:
        parse: a parser of one command-line value.
        flag: the flag it parses (``"--layers"``); argparse names the type
            after it in its messages.
    """

    def convert(text: str):
        try:
            return parse(text)
        except ArgumentError as exc:
            raise argparse.ArgumentTypeError(exc.detail) from None

    convert.__name__ = flag.lstrip("-")
    return convert


def split_items(value: str | Iterable[Any], argument: str) -> list[str]:
    """Items of a comma-separated string or of an iterable, stripped, the
    empty ones left out.

    Raises:
        ArgumentError: ``value`` is neither, or holds no item.
    """
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
    else:
        try:
            items = [str(item).strip() for item in value]
        except TypeError:
            raise ArgumentError(
                argument, f"expected a comma-separated string or a list, got {value!r}"
            ) from None
    items = [item for item in items if item]
    if not items:
        raise ArgumentError(argument, "no value given")
    return items


# ---------------------------------------------------------------------------
# --layers
# ---------------------------------------------------------------------------


def _known_layers_hint() -> str:
    return (
        f"known layers: {', '.join(registry.available_layers())}; or a Keras layer config "
        "as JSON ('{\"class_name\": \"LocalAttention\", \"config\": {...}}'), "
        "'package>Class' or 'package.module:Class'"
    )


def _spec_from_name(name: str, argument: str) -> LayerSpec:
    """A registered short name or a class reference."""
    try:
        if name in registry.available_layers():
            return registry.get_spec(name)
        if is_class_reference(name):
            return spec_from_reference(name)
    except LayerConfigError as exc:
        raise ArgumentError(argument, str(exc)) from None
    raise ArgumentError(argument, f"unknown layer {name!r}; {_known_layers_hint()}")


def _load_json(text: str, argument: str) -> Any:
    """JSON text, or ``@path`` to a JSON file."""
    if text.startswith("@"):
        path = text[1:]
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise ArgumentError(
                argument, f"cannot read layer config file {path!r}: {exc.strerror}"
            ) from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ArgumentError(
            argument, f"invalid JSON layer config ({exc}); received {text!r}"
        ) from None


def _parse_layer_item(item: Any, argument: str) -> list[LayerSpec]:
    """Specs from one item: a spec, a config dict, JSON, ``@file``, names."""
    if isinstance(item, LayerSpec):
        return [item]
    if isinstance(item, Mapping):
        try:
            return [spec_from_dict(item)]
        except LayerConfigError as exc:
            raise ArgumentError(argument, str(exc)) from None
    if not isinstance(item, str):
        raise ArgumentError(
            argument,
            f"expected a layer name, a class reference or a layer config dict (for a "
            f"layer object, its keras.saving.serialize_keras_object); received {item!r}",
        )
    text = item.strip()
    if text[:1] in ("{", "[", "@"):
        data = _load_json(text, argument)
        items = data if isinstance(data, list) else [data]
        if any(isinstance(entry, list) for entry in items):
            raise ArgumentError(argument, f"nested lists of layers in {text!r}")
        return [spec for entry in items for spec in _parse_layer_item(entry, argument)]
    return [_spec_from_name(name, argument) for name in split_items(text, argument)]


def parse_layers(value: Any, argument: str = "layers") -> list[LayerSpec]:
    """Layer specs from the ``--layers`` value or the ``layers`` argument.

    Accepts a comma-separated string of registered short names
    (``"full,local"``) and class references (``"keras_longattn>LocalAttention"``,
    ``"my_package.layers:MyAttention"``); a JSON layer config or a JSON list
    of names and configs (``'{"class_name": "LocalAttention", "config":
    {"window": 128}}'``); ``"@path"`` to a JSON file holding either; a config
    dict; a :class:`~keras_longattn.specs.layer_spec.LayerSpec`; or a list of
    any of these.

    Args:
        value: the layers.
        argument: the argument named in errors. Defaults to ``"layers"``.

    Returns:
        The specs in order, with repeats of the same layer dropped.

    Raises:
        ArgumentError: an unknown name, invalid JSON or config, or two
            different layers with the same label.
    """
    if isinstance(value, (str, Mapping, LayerSpec)):
        items: list[Any] = [value]
    else:
        try:
            items = list(value)
        except TypeError:
            raise ArgumentError(
                argument, f"expected layer names or layer configs, got {value!r}"
            ) from None
    specs: dict[str, LayerSpec] = {}
    for item in items:
        for spec in _parse_layer_item(item, argument):
            previous = specs.get(spec.label)
            if previous is not None and previous != spec:
                raise ArgumentError(
                    argument,
                    f"two different layers are labelled {spec.label!r} "
                    f"({previous.to_dict()} and {spec.to_dict()}); give each config a "
                    "distinct \"name\"",
                )
            specs[spec.label] = spec
    if not specs:
        raise ArgumentError(argument, "no value given")
    return list(specs.values())


# ---------------------------------------------------------------------------
# --option
# ---------------------------------------------------------------------------


def layer_options(label: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options meant for layer ``label``.

    Unprefixed options (``dropout=0.1``) apply to every layer of the run; an
    option prefixed with a layer label (``local.window=128``) applies to that
    layer only and wins over an unprefixed one.
    """
    generic: dict[str, Any] = {}
    specific: dict[str, Any] = {}
    for key, value in (options or {}).items():
        prefix, dot, rest = key.rpartition(".")
        if not dot:
            generic[key] = value
        elif prefix == label:
            specific[rest] = value
    generic.update(specific)
    return generic


def parse_value(text: str) -> Any:
    """A JSON or Python literal (``128``, ``0.1``, ``true``, ``None``), else the string."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return text


def _valid_option_name(name: Any) -> bool:
    """``name`` or ``label.name`` with ``name`` a Python identifier."""
    if not isinstance(name, str):
        return False
    prefix, dot, rest = name.rpartition(".")
    if dot and not prefix:
        return False
    return rest.isidentifier()


def parse_option(text: str) -> tuple[str, Any]:
    """``"name=value"`` into ``(name, value)``; the value is parsed as a literal
    (:func:`parse_value`).

    ``name`` may be prefixed with a layer label (``local.window=128``) to
    apply to that layer only.

    Raises:
        ArgumentError: no ``=``, or an invalid name (argument ``option``).
    """
    name, sep, raw = str(text).partition("=")
    name = name.strip()
    if not sep or not name:
        raise ArgumentError("option", f"expected name=value, got {text!r}")
    if not _valid_option_name(name):
        raise ArgumentError("option", f"invalid option name {name!r} in {text!r}")
    return name, parse_value(raw.strip())


def parse_options(value: Mapping[str, Any] | Sequence[str] | None) -> dict[str, Any]:
    """Options from a mapping or from a list of ``"name=value"`` strings.

    Raises:
        ArgumentError: an invalid name (argument ``options``) or string
            (argument ``option``).
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        options = dict(value)
        for name in options:
            if not _valid_option_name(name):
                raise ArgumentError("options", f"invalid option name {name!r}")
        return options
    if isinstance(value, str):
        value = [value]
    return dict(parse_option(item) for item in value)
