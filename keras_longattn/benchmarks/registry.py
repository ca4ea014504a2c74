"""Registry of the layers the benchmark can measure.

Each entry maps a short name (``"full"``, ``"local"``, ``"mha"``, ...) to a
*factory*: a callable ``factory(num_heads, key_dim, seq_len, options)`` that
returns a Keras layer with the call signature of
``keras.layers.MultiHeadAttention`` (``layer(query, value, key=None,
use_causal_mask=False, training=None)``).

Every configuration is measured in a fresh subprocess, so a factory must be
importable there: it is stored as an import path ``"package.module:name"``
and resolved only in the worker. Registering a module-level function by
object works too (its import path is derived from it); a lambda or a nested
function cannot be found by the worker and is refused.

A new layer needs one entry, either below in :data:`_BUILTIN` or at run time::

    from keras_longattn.benchmarks import register
    register("sparse", "my_package.bench:make_sparse_attention")

This module does not import Keras or a backend itself (the factories do, in
the worker). Layer classes are looked up lazily, inside the factories, so a
layer that does not exist yet only fails its own entry, with a clear message.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = [
    "LayerFactory",
    "LayerUnavailableError",
    "RegistryEntry",
    "register",
    "is_valid_name",
    "unregister",
    "get_entry",
    "available_layers",
    "resolve_factory",
    "build_layer",
    "layer_options",
    "construct_layer",
    "ignored_options",
    "reset_ignored_options",
    "full_attention",
    "local_attention",
    "sparse_strided_attention",
    "sparse_fixed_attention",
    "routing_attention",
    "keras_multi_head_attention",
]

#: ``factory(num_heads, key_dim, seq_len, options) -> keras.layers.Layer``
LayerFactory = Callable[[int, int, int, dict], Any]

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")

#: Keyword arguments of ``keras.layers.Layer.__init__`` that any Keras layer
#: accepts.
_BASE_LAYER_KWARGS = frozenset({"name", "dtype", "trainable"})


class LayerUnavailableError(RuntimeError):
    """A registered layer cannot be built: its class or factory is missing."""


@dataclass(frozen=True)
class RegistryEntry:
    """One benchmarkable layer.

    Attributes:
        name: the short name used on the command line.
        factory: import path ``"package.module:attribute"`` of the factory.
        description: one line shown by ``--list-layers``.
    """

    name: str
    factory: str
    description: str = ""


_REGISTRY: dict[str, RegistryEntry] = {}

#: Options that :func:`construct_layer` could not pass to the last layer it
#: built (the worker measures one layer per process and reports these).
_IGNORED: list[str] = []


def _factory_path(factory: LayerFactory | str) -> str:
    """The ``"module:attribute"`` import path of ``factory``."""
    if isinstance(factory, str):
        module, sep, attr = factory.partition(":")
        if not sep or not module or not attr:
            raise ValueError(
                f"factory path {factory!r} must look like 'package.module:function'"
            )
        return factory
    if not callable(factory):
        raise TypeError(f"factory must be callable or an import path, got {factory!r}")
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        raise ValueError(
            f"factory {factory!r} cannot be imported by the benchmark worker "
            "subprocess: register a module-level function of an importable "
            "module, or pass its import path as 'package.module:function'"
        )
    return f"{module}:{qualname}"


def is_valid_name(name: Any) -> bool:
    """Whether ``name`` can be a layer name (letters, digits, ``_``, ``-``)."""
    return isinstance(name, str) and bool(_NAME_RE.match(name))


def register(
    name: str,
    factory: LayerFactory | str,
    description: str = "",
    overwrite: bool = False,
) -> RegistryEntry:
    """Register a layer factory under a short name.

    Args:
        name: short name for ``--layers`` (letters, digits, ``_`` and ``-``,
            starting with a letter).
        factory: a module-level callable ``(num_heads, key_dim, seq_len,
            options) -> layer`` or its import path ``"package.module:name"``.
            The worker subprocess imports it, so it must be importable there.
        description: one line shown by ``keras-longattn bench --list-layers``.
        overwrite: replace an existing entry of the same name instead of
            raising.

    Returns:
        The new :class:`RegistryEntry`.
    """
    if not is_valid_name(name):
        raise ValueError(
            f"invalid layer name {name!r}: use letters, digits, '_' or '-', "
            "starting with a letter"
        )
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"layer {name!r} is already registered (pass overwrite=True)")
    entry = RegistryEntry(name=name, factory=_factory_path(factory), description=description)
    _REGISTRY[name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a registered layer (no error if it is not registered)."""
    _REGISTRY.pop(name, None)


def available_layers() -> list[str]:
    """The registered layer names, in registration order."""
    return list(_REGISTRY)


def get_entry(name: str) -> RegistryEntry:
    """The entry registered under ``name``.

    Raises:
        KeyError: unknown name; the message lists the known ones.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(available_layers()) or "(none)"
        raise KeyError(f"unknown layer {name!r}; known layers: {known}") from None


def resolve_factory(path: str) -> LayerFactory:
    """Import the factory named by ``"package.module:attribute"``."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LayerUnavailableError(
            f"cannot import module {module_name!r} of factory {path!r}: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LayerUnavailableError(
                f"factory {path!r} not found: {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


def layer_options(name: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options meant for layer ``name``.

    Unprefixed options (``window=256``) apply to every layer that accepts
    them; an option prefixed with a layer name (``local.block_size=128``)
    applies to that layer only and wins over an unprefixed one.
    """
    generic: dict[str, Any] = {}
    specific: dict[str, Any] = {}
    for key, value in (options or {}).items():
        prefix, dot, rest = key.partition(".")
        if not dot:
            generic[key] = value
        elif prefix == name:
            specific[rest] = value
    generic.update(specific)
    return generic


def build_layer(
    name: str,
    num_heads: int,
    key_dim: int,
    seq_len: int,
    options: Mapping[str, Any] | None = None,
    factory: str | None = None,
):
    """Build the layer registered under ``name`` (imports Keras).

    Args:
        name: registered layer name.
        num_heads: number of heads.
        key_dim: size of each head.
        seq_len: the sequence length the layer will see.
        options: all benchmark options (see :func:`layer_options`).
        factory: import path overriding the registry (the runner passes the
            path it looked up, so that a factory registered in the runner
            process is found in the worker process too).
    """
    path = factory if factory is not None else get_entry(name).factory
    fn = resolve_factory(path)
    reset_ignored_options()
    return fn(num_heads, key_dim, seq_len, layer_options(name, options))


def ignored_options() -> list[str]:
    """Options that the last :func:`construct_layer` call could not pass."""
    return list(_IGNORED)


def reset_ignored_options() -> None:
    """Forget the ignored options (before building the next layer)."""
    _IGNORED.clear()


def _accepted_parameters(cls: type) -> set[str]:
    """Keyword arguments that ``cls(...)`` accepts by name.

    Follows ``**kwargs`` up the class hierarchy: the named parameters of every
    ``__init__`` reached through ``**kwargs`` forwarding count (for example
    ``dropout`` of a base class, or ``name`` and ``dtype`` of
    ``keras.layers.Layer``).
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
            elif param.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY,
            ):
                names.add(param.name)
        if not var_keyword:
            break
    names.discard("self")
    return names


def construct_layer(cls: type, num_heads: int, key_dim: int, options: Mapping[str, Any], **fixed):
    """Instantiate ``cls(num_heads=..., key_dim=..., **options)``.

    Only the options that ``cls`` accepts by name (its ``__init__`` and,
    through ``**kwargs``, those of its base classes) are passed, so that one
    ``--option`` can target several layers; the others are recorded (see
    :func:`ignored_options`) and reported by the worker. ``fixed`` keyword
    arguments are always passed.
    """
    accepted = _accepted_parameters(cls) | _BASE_LAYER_KWARGS
    kwargs = {}
    _IGNORED.clear()
    for key, value in options.items():
        if key in fixed or key in ("num_heads", "key_dim"):
            continue
        if key in accepted:
            kwargs[key] = value
        else:
            _IGNORED.append(key)
    kwargs.update(fixed)
    return cls(num_heads=num_heads, key_dim=key_dim, **kwargs)


def _project_layer(class_name: str, layer_name: str) -> type:
    """``keras_longattn.layers.<class_name>``, with a clear error if missing."""
    try:
        module = importlib.import_module("keras_longattn.layers")
    except ImportError as exc:
        raise LayerUnavailableError(
            f"layer {layer_name!r} needs keras_longattn.layers.{class_name}, but "
            f"keras_longattn.layers cannot be imported: {exc}"
        ) from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise LayerUnavailableError(
            f"layer {layer_name!r} needs keras_longattn.layers.{class_name}, which "
            "does not exist in this version of keras_longattn"
        )
    return cls


# ---------------------------------------------------------------------------
# Built-in factories. Each is a module-level function so that the worker
# subprocess can import it by path.
# ---------------------------------------------------------------------------


def full_attention(num_heads: int, key_dim: int, seq_len: int, options: dict):
    """``keras_longattn.layers.FullAttention``: exact attention, the baseline."""
    cls = _project_layer("FullAttention", "full")
    return construct_layer(cls, num_heads, key_dim, options)


def local_attention(num_heads: int, key_dim: int, seq_len: int, options: dict):
    """``keras_longattn.layers.LocalAttention`` with ``window`` (default 256)."""
    cls = _project_layer("LocalAttention", "local")
    options = dict(options)
    window = int(options.pop("window", 256))
    return construct_layer(cls, num_heads, key_dim, options, window=window)


def _sparse(pattern: str, num_heads: int, key_dim: int, options: dict):
    cls = _project_layer("SparseAttention", f"sparse-{pattern}")
    options = dict(options)
    options.pop("window", None)  # the benchmark's window is for local layers
    options.setdefault("block_length", 128)
    return construct_layer(cls, num_heads, key_dim, options, pattern=pattern)


def sparse_strided_attention(num_heads: int, key_dim: int, seq_len: int, options: dict):
    """``keras_longattn.layers.SparseAttention(pattern="strided")``, ``block_length`` 128."""
    return _sparse("strided", num_heads, key_dim, options)


def sparse_fixed_attention(num_heads: int, key_dim: int, seq_len: int, options: dict):
    """``keras_longattn.layers.SparseAttention(pattern="fixed")``, ``block_length`` 128."""
    return _sparse("fixed", num_heads, key_dim, options)


def routing_attention(num_heads: int, key_dim: int, seq_len: int, options: dict):
    """``keras_longattn.layers.RoutingAttention`` with ``num_clusters`` about sqrt(n).

    The benchmark's ``window`` is meant for local layers and is not passed;
    the routing window defaults to ``n / num_clusters``.
    """
    cls = _project_layer("RoutingAttention", "routing")
    options = dict(options)
    options.pop("window", None)
    if "routing_window" in options:
        options["window"] = options.pop("routing_window")
    options.setdefault("num_clusters", max(1, int(round(seq_len**0.5))))
    return construct_layer(cls, num_heads, key_dim, options)


def keras_multi_head_attention(num_heads: int, key_dim: int, seq_len: int, options: dict):
    """``keras.layers.MultiHeadAttention``: the Keras baseline."""
    import keras

    return construct_layer(keras.layers.MultiHeadAttention, num_heads, key_dim, options)


_BUILTIN = (
    ("full", full_attention, "keras_longattn FullAttention (exact; the ratio baseline)"),
    ("local", local_attention, "keras_longattn LocalAttention (sliding window, --window)"),
    (
        "sparse-strided",
        sparse_strided_attention,
        "keras_longattn SparseAttention, strided pattern (block_length 128)",
    ),
    (
        "sparse-fixed",
        sparse_fixed_attention,
        "keras_longattn SparseAttention, fixed pattern (block_length 128)",
    ),
    (
        "routing",
        routing_attention,
        "keras_longattn RoutingAttention (num_clusters ~ sqrt(n))",
    ),
    ("mha", keras_multi_head_attention, "keras.layers.MultiHeadAttention (Keras baseline)"),
)

for _name, _factory, _description in _BUILTIN:
    register(_name, _factory, _description)
del _name, _factory, _description
