"""Layer specs: a layer given as a Keras layer config, parsed and resolved per run.

A *layer spec* names one attention layer for the benchmark
(``keras-longattn bench``), the LRA-style suite (``keras-longattn lra``) and
the model builders (:mod:`keras_longattn.models`). It is one of:

* a Keras layer config, ``{"class_name": "LocalAttention", "config":
  {"window": 256}}``, including the full form written by
  ``keras.saving.serialize_keras_object`` (with ``"module"`` and
  ``"registered_name"``; its ``"build_config"``, ``"compile_config"`` and
  ``"shared_object_id"`` are left out, since the layer is built for its own
  input shapes);
* a class reference without a config: ``"keras_longattn>LocalAttention"``
  (a Keras-registered name) or ``"my_package.layers:MyAttention"`` (an import
  path, for layers outside this package);
* a short name registered in :mod:`keras_longattn.specs.registry`
  (``"local"``), which stands for a layer config (parsed by
  :func:`keras_longattn.specs.arguments.parse_layers`).

``class_name`` may itself be one of the two class references. A bare class
name is looked up in ``keras_longattn.layers``, then in ``keras.layers``, then
among the Keras-registered objects (:func:`keras_longattn.specs.resolver.resolve_class`).

Length-dependent values: a config value that is a string ``"${...}"`` is an
arithmetic expression evaluated for each configuration, with the variables
``seq_len``, ``batch``, ``num_heads``, ``key_dim`` (also ``head_dim``) and
``window`` (the benchmark's ``--window``), the operators ``+ - * / // % **``
and the functions ``sqrt``, ``log2``, ``ceil``, ``floor``, ``round``, ``int``,
``float``, ``min``, ``max``, ``abs``. For example the registered ``routing``
layer sets ``"num_clusters": "${max(1, round(sqrt(seq_len)))}"``. Every
integer of an expression (intermediate results included) must stay within
±2**64 and every float finite: ``"${(2**64)**64}"`` is refused before it is
computed.

A layer config is code: resolving the class of a spec whose ``class_name``
is ``"package.module:Class"``, or that has a ``"module"`` entry, imports that
module, and a registered name ``"package>Class"`` not yet registered imports
``package``; importing a module runs whatever it contains. Load config files
only from sources you trust. (The model builders resolve configs without
importing: see :func:`keras_longattn.specs.resolver.resolve_class`.)

``num_heads`` and ``key_dim`` come from the benchmark (``--heads``,
``--head-dim``) where the config does not set them; a config that sets them
to other values is an error, since the inputs are ``(batch, seq_len,
num_heads * key_dim)`` (:func:`resolve_spec`).

Everything here is plain Python: nothing imports Keras.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = [
    "LayerConfigError",
    "LayerUnavailableError",
    "LayerSpec",
    "PLACEHOLDER_VARIABLES",
    "MAX_PLACEHOLDER_INT",
    "as_layer_config",
    "spec_from_dict",
    "spec_from_reference",
    "is_class_reference",
    "evaluate_placeholder",
    "substitute_placeholders",
    "check_placeholders",
    "resolve_spec",
]

#: Variables of ``"${...}"`` placeholders.
PLACEHOLDER_VARIABLES = ("seq_len", "batch", "num_heads", "key_dim", "head_dim", "window")

#: Values of the variables used to check a placeholder when it is registered.
_SAMPLE_VARIABLES = {"seq_len": 1024, "batch": 1, "num_heads": 4, "key_dim": 64,
                     "head_dim": 64, "window": 256}

#: Top-level keys of a layer config; ``build_config``, ``compile_config`` and
#: ``shared_object_id`` (written by ``serialize_keras_object``) are accepted
#: and left out.
_SPEC_KEYS = ("class_name", "config", "module", "registered_name")
_DROPPED_KEYS = ("build_config", "compile_config", "shared_object_id")

#: The keys that the benchmark fills from ``--heads`` and ``--head-dim``.
_SHAPE_KEYS = (("num_heads", "--heads"), ("key_dim", "--head-dim"))


class LayerConfigError(ValueError):
    """An invalid layer spec or layer config.

    Attributes:
        layer: the label of the layer (as in the result rows), or ``None``.
        unknown_options: config keys that the layer's constructor does not
            accept (empty for other errors).
    """

    def __init__(self, message: str, layer: str | None = None,
                 unknown_options: Iterable[str] = ()):
        super().__init__(message)
        self.layer = layer
        self.unknown_options = list(unknown_options)


class LayerUnavailableError(RuntimeError):
    """The class of a layer spec cannot be imported or found."""


@dataclass(frozen=True)
class LayerSpec:
    """One layer to benchmark: a Keras layer config and its label.

    Attributes:
        label: the layer's name in the results (``row["layer"]``), in the
            table and in ``--option LABEL.NAME=VALUE``.
        class_name: ``"LocalAttention"``, ``"keras_longattn>LocalAttention"``
            or ``"package.module:Class"``.
        config: constructor keyword arguments; values may be ``"${...}"``
            placeholders.
        module: the module of the class, as written by
            ``keras.saving.serialize_keras_object``. Defaults to ``None``.
        registered_name: the Keras-registered name of the class. Defaults
            to ``None``.
    """

    label: str
    class_name: str
    config: dict = field(default_factory=dict)
    module: str | None = None
    registered_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The layer config as a JSON-serialisable dict (no label)."""
        data: dict[str, Any] = {"class_name": self.class_name, "config": dict(self.config)}
        if self.module is not None:
            data["module"] = self.module
        if self.registered_name is not None:
            data["registered_name"] = self.registered_name
        return data


def is_class_reference(text: Any) -> bool:
    """Whether ``text`` is ``"package>Class"`` or ``"package.module:Class"``."""
    return isinstance(text, str) and (">" in text or ":" in text)


def _short_class_name(class_name: str) -> str:
    """``"LocalAttention"`` of ``"keras_longattn>LocalAttention"`` or ``"a.b:LocalAttention"``."""
    name = class_name.rpartition(">")[2].rpartition(":")[2]
    return name.rpartition(".")[2] or class_name


def _check_reference(class_name: str) -> None:
    if ":" in class_name:
        module, _, attribute = class_name.partition(":")
        if not module or not attribute:
            raise LayerConfigError(
                f"class reference {class_name!r} must look like 'package.module:Class'"
            )
    elif ">" in class_name:
        package, _, name = class_name.partition(">")
        if not package or not name:
            raise LayerConfigError(
                f"registered class name {class_name!r} must look like 'package>Class'"
            )


def _json_copy(value: Any, what: str) -> Any:
    """A deep copy of ``value`` through JSON, with a clear error if impossible."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise LayerConfigError(
            f"{what} must be JSON-serialisable (it is sent to the worker "
            f"subprocess): {exc}; received {value!r}"
        ) from None



def as_layer_config(spec: LayerSpec | Mapping[str, Any]) -> dict[str, Any]:
    """The layer config of a :class:`LayerSpec` or of a config dict, its
    structure checked.

    Args:
        spec: a :class:`LayerSpec`, or ``{"class_name": ..., "config":
            {...}}`` optionally with ``"module"`` and ``"registered_name"``
            (``"build_config"``, ``"compile_config"`` and
            ``"shared_object_id"`` are left out).

    Returns:
        ``{"class_name": ..., "config": {...}}`` (plus ``module`` and
        ``registered_name`` when set), with the class name stripped and a
        shallow copy of the config; the values are not copied nor checked.

    Raises:
        LayerConfigError: ``spec`` is not a layer config.
    """
    if isinstance(spec, LayerSpec):
        return spec.to_dict()
    return _mapping_parts(spec)


def _mapping_parts(data: Any) -> dict[str, Any]:
    """:func:`as_layer_config` of a dict (anything else is refused)."""
    if not isinstance(data, Mapping):
        raise LayerConfigError(
            f"a layer config must be a dict with 'class_name' and 'config'; received {data!r}"
        )
    unknown = sorted(set(data) - set(_SPEC_KEYS) - set(_DROPPED_KEYS))
    if unknown:
        raise LayerConfigError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in layer config {dict(data)!r}; "
            f"expected {', '.join(_SPEC_KEYS)}"
        )
    class_name = data.get("class_name")
    if not isinstance(class_name, str) or not class_name.strip():
        raise LayerConfigError(
            f"a layer config needs a 'class_name' string; received {dict(data)!r}"
        )
    class_name = class_name.strip()
    _check_reference(class_name)
    config = data.get("config", {})
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise LayerConfigError(
            f"'config' of layer config {class_name!r} must be a dict; received {config!r}"
        )
    result: dict[str, Any] = {"class_name": class_name, "config": dict(config)}
    for key in ("module", "registered_name"):
        value = data.get(key)
        if value is not None and not isinstance(value, str):
            raise LayerConfigError(
                f"'{key}' of layer config {class_name!r} must be a string; "
                f"received {value!r}"
            )
        if value is not None:
            result[key] = value
    return result


def spec_from_dict(data: Mapping[str, Any], label: str | None = None) -> LayerSpec:
    """A :class:`LayerSpec` from a Keras layer config.

    Args:
        data: ``{"class_name": ..., "config": {...}}``, optionally with
            ``"module"`` and ``"registered_name"`` (see
            :func:`as_layer_config`).
        label: the layer's label. Defaults to the config's ``"name"`` when it
            is a string, else the class name without its package or module.

    Returns:
        The spec, with a JSON copy of the config.

    Raises:
        LayerConfigError: ``data`` is not a layer config, its config is not
            JSON-serialisable, or one of its placeholders is invalid.
    """
    parts = _mapping_parts(data)
    class_name = parts["class_name"]
    config = _json_copy(parts["config"], f"the config of {class_name!r}")
    check_placeholders(config, class_name)
    if label is None:
        name = config.get("name")
        label = name if isinstance(name, str) and name and "${" not in name \
            else _short_class_name(class_name)
    return LayerSpec(label=label, class_name=class_name, config=config,
                     module=parts.get("module"), registered_name=parts.get("registered_name"))


def spec_from_reference(text: str) -> LayerSpec:
    """A :class:`LayerSpec` with an empty config from ``"package>Class"`` or
    ``"package.module:Class"``; its label is ``Class``."""
    if not is_class_reference(text):
        raise LayerConfigError(
            f"expected 'package>Class' or 'package.module:Class'; received {text!r}"
        )
    return spec_from_dict({"class_name": text.strip(), "config": {}})


# ---------------------------------------------------------------------------
# Placeholders
# ---------------------------------------------------------------------------

_FUNCTIONS = {
    "sqrt": math.sqrt,
    "log2": math.log2,
    "ceil": math.ceil,
    "floor": math.floor,
    "round": round,
    "int": int,
    "float": float,
    "min": min,
    "max": max,
    "abs": abs,
}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}

_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}

#: Largest magnitude of an integer anywhere in a placeholder (a constant, a
#: variable, an intermediate or final result). Powers are checked before
#: they are computed, so that no expression builds a huge integer.
MAX_PLACEHOLDER_INT = 2**64

#: Largest ``|exponent|`` of ``**`` in a placeholder.
_MAX_EXPONENT = 64


def _placeholder_expression(value: Any) -> str | None:
    """The expression of a ``"${...}"`` string, else ``None``."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("${") and text.endswith("}"):
            return text[2:-1].strip()
    return None


def evaluate_placeholder(expression: str, variables: Mapping[str, Any]) -> int | float:
    """Evaluate the arithmetic ``expression`` of a ``"${...}"`` placeholder.

    Args:
        expression: e.g. ``"max(1, round(sqrt(seq_len)))"``.
        variables: values of the names it may use
            (:data:`PLACEHOLDER_VARIABLES`).

    Every integer met while evaluating (constants, variables, intermediate
    and final results) must lie within ``±MAX_PLACEHOLDER_INT`` (2**64), an
    exponent of ``**`` within ±64, and every float must be finite; a power
    whose integer result would exceed the bound is refused before it is
    computed.

    Returns:
        The number.

    Raises:
        LayerConfigError: a syntax error, an unknown name or function, an
            operation that is not arithmetic, or a number out of bounds
            (the message names the sub-expression).
    """
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise LayerConfigError(f"invalid placeholder '${{{expression}}}': {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise LayerConfigError(
            f"invalid placeholder '${{{expression}}}': the expression is nested too deeply"
        ) from None

    def fail(detail: str):
        raise LayerConfigError(f"invalid placeholder '${{{expression}}}': {detail}")

    def text(node: ast.AST) -> str:
        return ast.unparse(node)

    def bounded(number, node: ast.AST):
        """``number`` if within the bounds, else a clear error."""
        if isinstance(number, bool):
            return number
        if isinstance(number, int):
            if abs(number) > MAX_PLACEHOLDER_INT:
                fail(f"{text(node)!r} gives an integer too large "
                     f"(beyond ±2**64, {number.bit_length()} bits)")
        elif isinstance(number, float) and not math.isfinite(number):
            fail(f"{text(node)!r} gives {number!r}, not a finite number")
        return number

    def check_power(left, right, node: ast.BinOp):
        """Refuses ``left ** right`` before it is computed when its result
        would be too large."""
        if abs(right) > _MAX_EXPONENT:
            fail(f"exponent {right!r} is too large (at most {_MAX_EXPONENT}) "
                 f"in {text(node)!r}")
        if isinstance(left, int) and isinstance(right, int) and right > 0:
            # |left| >= 2**(bits - 1), so |left ** right| >= 2**((bits - 1) * right).
            if (abs(left).bit_length() - 1) * right > 64:
                fail(f"{text(node)!r} gives an integer too large (beyond ±2**64)")

    def value(node: ast.AST):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
                return bounded(node.value, node)
            fail(f"only numbers are allowed, got {node.value!r}")
        if isinstance(node, ast.Name):
            if node.id not in variables:
                fail(f"unknown name {node.id!r}; use {', '.join(sorted(variables))}")
            return bounded(variables[node.id], node)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow):
                check_power(left, right, node)
            try:
                result = _BINARY[type(node.op)](left, right)
            except (ArithmeticError, ValueError) as exc:
                fail(f"{exc} in {text(node)!r}")
            if isinstance(result, complex):
                fail(f"{text(node)!r} is not a real number")
            return bounded(result, node)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return bounded(_UNARY[type(node.op)](value(node.operand)), node)
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
                fail(f"unknown function; use {', '.join(_FUNCTIONS)}")
            if node.keywords:
                fail("keyword arguments are not allowed")
            args = [value(arg) for arg in node.args]
            try:
                result = _FUNCTIONS[node.func.id](*args)
            except (ArithmeticError, ValueError, TypeError) as exc:
                fail(f"{exc} in {text(node)!r}")
            return bounded(result, node)
        fail(f"{type(node).__name__} is not allowed (numbers, names, arithmetic, functions)")

    try:
        return value(tree)
    except RecursionError:
        fail("the expression is nested too deeply")


def substitute_placeholders(value: Any, variables: Mapping[str, Any]) -> Any:
    """``value`` with every ``"${...}"`` string (in nested dicts and lists too)
    replaced by its value (see :func:`evaluate_placeholder`)."""
    expression = _placeholder_expression(value)
    if expression is not None:
        return evaluate_placeholder(expression, variables)
    if isinstance(value, str) and "${" in value:
        raise LayerConfigError(
            f"a placeholder must be the whole value, as in \"${{seq_len // 4}}\"; "
            f"received {value!r}"
        )
    if isinstance(value, Mapping):
        return {key: substitute_placeholders(item, variables) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [substitute_placeholders(item, variables) for item in value]
    return value


def check_placeholders(config: Mapping[str, Any], class_name: str = "layer") -> None:
    """Evaluate the placeholders of ``config`` with sample values, to report a
    mistake when the config is given rather than when it is measured."""
    try:
        substitute_placeholders(config, _SAMPLE_VARIABLES)
    except LayerConfigError as exc:
        raise LayerConfigError(f"config of {class_name!r}: {exc}") from None


# ---------------------------------------------------------------------------
# One configuration's layer config (plain Python)
# ---------------------------------------------------------------------------


def _as_dict(spec: LayerSpec | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(spec, LayerSpec):
        return spec.to_dict()
    return spec_from_dict(spec, label="").to_dict()


def resolve_spec(
    spec: LayerSpec | Mapping[str, Any],
    *,
    seq_len: int,
    num_heads: int,
    key_dim: int,
    batch: int = 1,
    window: int = 256,
    options: Mapping[str, Any] | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """The layer config that one configuration builds.

    Merges ``options`` into the config (they win), evaluates the
    placeholders, and fills ``num_heads`` and ``key_dim`` where the config
    does not set them. Idempotent: resolving a resolved config with the same
    arguments returns it unchanged.

    Args:
        spec: a :class:`LayerSpec` or a layer config dict.
        seq_len: the sequence length.
        num_heads: the benchmark's number of heads (``--heads``).
        key_dim: the benchmark's head size (``--head-dim``).
        batch: the batch size. Defaults to 1.
        window: the value of ``${window}``. Defaults to 256.
        options: keyword arguments to set in the config (``--option``).
            Defaults to none.
        label: the layer's label, for messages. Defaults to the spec's label.

    Returns:
        ``{"class_name": ..., "config": {...}}`` (plus ``module`` and
        ``registered_name`` when the spec has them), JSON-serialisable.

    Raises:
        LayerConfigError: a bad placeholder, or ``num_heads`` / ``key_dim``
            set in the config to values other than the benchmark's.
    """
    if label is None:
        label = spec.label if isinstance(spec, LayerSpec) else None
    data = _as_dict(spec)
    who = f"layer {label!r}" if label else f"layer {data['class_name']!r}"
    config = dict(data["config"])
    if options:
        config.update(_json_copy(dict(options), f"the options of {who}"))
    variables = {"seq_len": int(seq_len), "batch": int(batch), "num_heads": int(num_heads),
                 "key_dim": int(key_dim), "head_dim": int(key_dim), "window": int(window)}
    try:
        config = substitute_placeholders(config, variables)
    except LayerConfigError as exc:
        raise LayerConfigError(f"{who}: {exc}", layer=label) from None
    for (key, flag), value in zip(_SHAPE_KEYS, (int(num_heads), int(key_dim))):
        given = config.get(key)
        if given is None:
            config[key] = value
        elif isinstance(given, bool) or given != value:
            argument = "num_heads" if key == "num_heads" else "head_dim"
            raise LayerConfigError(
                f"{who} sets {key}={given!r} in its config, but the benchmark's "
                f"{argument} ({flag}) is {value}: the inputs are (batch, seq_len, "
                f"num_heads * key_dim); drop {key} from the config or pass {flag} {given}",
                layer=label,
            )
    data["config"] = config
    return data
