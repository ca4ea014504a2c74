"""Benchmark settings: parsing and validation shared by the CLI and the API.

Layers are given as short names, class references or Keras layer configs
(see :func:`parse_layers` and :mod:`keras_longattn.benchmarks.layer_config`);
a validated :class:`BenchmarkConfig` holds each layer's config under its
label and resolves it per sequence length (:meth:`BenchmarkConfig.layer_spec`).

Nothing here imports Keras or a backend.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from . import registry
from .layer_config import (
    LayerConfigError,
    LayerSpec,
    is_class_reference,
    resolve_spec,
    spec_from_dict,
    spec_from_reference,
)

__all__ = [
    "BACKENDS",
    "MODES",
    "BenchmarkArgumentError",
    "BenchmarkConfig",
    "default_backend",
    "parse_layers",
    "layer_options",
    "parse_lengths",
    "parse_backends",
    "parse_modes",
    "parse_option",
    "parse_options",
]

#: Backends the benchmark can run (the Keras NumPy backend has no gradients).
BACKENDS = ("jax", "tensorflow", "torch")

#: ``fwd``: forward only; ``fwdbwd``: forward and backward (gradients of the
#: mean output w.r.t. the input and all trainable weights). Listed in order of
#: cost, which the skip-ahead rule of the runner relies on.
MODES = ("fwd", "fwdbwd")

_BACKEND_MODULES = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}


class BenchmarkArgumentError(ValueError):
    """An invalid benchmark setting.

    Attributes:
        argument: the setting's name as in :func:`run_benchmark`
            (``"lengths"``); the CLI shows it as ``--lengths``.
        detail: what is wrong with it.
    """

    def __init__(self, argument: str, detail: str):
        self.argument = argument
        self.detail = detail
        super().__init__(f"invalid {argument!s}: {detail}")

    @property
    def flag(self) -> str:
        """The command-line flag of the setting (``--head-dim``)."""
        return "--" + self.argument.replace("_", "-")


def _split(value: str | Iterable[Any], argument: str) -> list[str]:
    """Items of a comma-separated string or of an iterable, stripped."""
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
    else:
        try:
            items = [str(item).strip() for item in value]
        except TypeError:
            raise BenchmarkArgumentError(
                argument, f"expected a comma-separated string or a list, got {value!r}"
            ) from None
    items = [item for item in items if item]
    if not items:
        raise BenchmarkArgumentError(argument, "no value given")
    return items


def _dedupe(items: Iterable[Any]) -> list[Any]:
    seen: dict[Any, None] = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)


def default_backend() -> str:
    """``$KERAS_BACKEND`` when it is a supported backend, else ``"jax"``."""
    backend = os.environ.get("KERAS_BACKEND", "").strip().lower()
    return backend if backend in BACKENDS else "jax"


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
        raise BenchmarkArgumentError(argument, str(exc)) from None
    raise BenchmarkArgumentError(argument, f"unknown layer {name!r}; {_known_layers_hint()}")


def _load_json(text: str, argument: str) -> Any:
    """JSON text, or ``@path`` to a JSON file."""
    if text.startswith("@"):
        path = text[1:]
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise BenchmarkArgumentError(
                argument, f"cannot read layer config file {path!r}: {exc.strerror}"
            ) from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise BenchmarkArgumentError(
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
            raise BenchmarkArgumentError(argument, str(exc)) from None
    if not isinstance(item, str):
        raise BenchmarkArgumentError(
            argument,
            f"expected a layer name, a class reference or a layer config dict (for a "
            f"layer object, its keras.saving.serialize_keras_object); received {item!r}",
        )
    text = item.strip()
    if text[:1] in ("{", "[", "@"):
        data = _load_json(text, argument)
        items = data if isinstance(data, list) else [data]
        if any(isinstance(entry, list) for entry in items):
            raise BenchmarkArgumentError(argument, f"nested lists of layers in {text!r}")
        return [spec for entry in items for spec in _parse_layer_item(entry, argument)]
    return [_spec_from_name(name, argument) for name in _split(text, argument)]


def parse_layers(value: Any, argument: str = "layers") -> list[LayerSpec]:
    """Layer specs from the ``--layers`` value or the ``layers`` argument.

    Accepts a comma-separated string of registered short names
    (``"full,local"``) and class references (``"keras_longattn>LocalAttention"``,
    ``"my_package.layers:MyAttention"``); a JSON layer config or a JSON list
    of names and configs (``'{"class_name": "LocalAttention", "config":
    {"window": 128}}'``); ``"@path"`` to a JSON file holding either; a config
    dict; a :class:`~keras_longattn.benchmarks.layer_config.LayerSpec`; or a
    list of any of these.

    Args:
        value: the layers.
        argument: the argument named in errors. Defaults to ``"layers"``.

    Returns:
        The specs in order, with repeats of the same layer dropped.

    Raises:
        BenchmarkArgumentError: an unknown name, invalid JSON or config, or
            two different layers with the same label.
    """
    if isinstance(value, (str, Mapping, LayerSpec)):
        items: list[Any] = [value]
    else:
        try:
            items = list(value)
        except TypeError:
            raise BenchmarkArgumentError(
                argument, f"expected layer names or layer configs, got {value!r}"
            ) from None
    specs: dict[str, LayerSpec] = {}
    for item in items:
        for spec in _parse_layer_item(item, argument):
            previous = specs.get(spec.label)
            if previous is not None and previous != spec:
                raise BenchmarkArgumentError(
                    argument,
                    f"two different layers are labelled {spec.label!r} "
                    f"({previous.to_dict()} and {spec.to_dict()}); give each config a "
                    "distinct \"name\"",
                )
            specs[spec.label] = spec
    if not specs:
        raise BenchmarkArgumentError(argument, "no value given")
    return list(specs.values())


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


def parse_lengths(value: str | int | Iterable[Any]) -> list[int]:
    """Sorted distinct positive sequence lengths from ``"1024,4096"`` or a list.

    ``k`` suffixes are accepted (``"16k"`` is 16384).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    lengths = []
    for item in _split(value, "lengths"):
        text = item.lower().replace("_", "")
        factor = 1
        if text.endswith("k"):
            text, factor = text[:-1], 1024
        try:
            length = int(text) * factor
        except ValueError:
            raise BenchmarkArgumentError(
                "lengths", f"{item!r} is not an integer sequence length"
            ) from None
        if length < 1:
            raise BenchmarkArgumentError(
                "lengths", f"sequence lengths must be >= 1, got {length}"
            )
        lengths.append(length)
    return sorted(set(lengths))


def parse_backends(value: str | Iterable[str] | None, check_installed: bool = True) -> list[str]:
    """Backends from ``"jax,torch"`` or a list; ``None`` is :func:`default_backend`."""
    if value is None:
        return [default_backend()]
    backends = _dedupe(item.lower() for item in _split(value, "backends"))
    for backend in backends:
        if backend not in BACKENDS:
            raise BenchmarkArgumentError(
                "backends",
                f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}",
            )
        if check_installed and importlib.util.find_spec(_BACKEND_MODULES[backend]) is None:
            raise BenchmarkArgumentError(
                "backends",
                f"backend {backend!r} is not installed "
                f"(no module {_BACKEND_MODULES[backend]!r} in this Python)",
            )
    return backends


def parse_modes(value: str | Iterable[str]) -> list[str]:
    """Modes from ``"fwd,fwdbwd"`` or a list, in cost order."""
    modes = _dedupe(item.lower() for item in _split(value, "modes"))
    for mode in modes:
        if mode not in MODES:
            raise BenchmarkArgumentError(
                "modes", f"unknown mode {mode!r}; choose from {', '.join(MODES)}"
            )
    return [mode for mode in MODES if mode in modes]


def _parse_value(text: str) -> Any:
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
    """``"name=value"`` into ``(name, value)``; the value is parsed as a literal.

    ``name`` may be prefixed with a layer label (``local.window=128``) to
    apply to that layer only.
    """
    name, sep, raw = str(text).partition("=")
    name = name.strip()
    if not sep or not name:
        raise BenchmarkArgumentError("option", f"expected name=value, got {text!r}")
    if not _valid_option_name(name):
        raise BenchmarkArgumentError("option", f"invalid option name {name!r} in {text!r}")
    return name, _parse_value(raw.strip())


def parse_options(value: Mapping[str, Any] | Sequence[str] | None) -> dict[str, Any]:
    """Options from a mapping or from a list of ``"name=value"`` strings."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        options = dict(value)
        for name in options:
            if not _valid_option_name(name):
                raise BenchmarkArgumentError("options", f"invalid option name {name!r}")
        return options
    if isinstance(value, str):
        value = [value]
    return dict(parse_option(item) for item in value)


def _positive_int(argument: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise BenchmarkArgumentError(argument, f"expected an integer, got {value!r}")
    if value < minimum:
        raise BenchmarkArgumentError(argument, f"must be >= {minimum}, got {value!r}")
    return int(value)


def _positive_float(argument: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BenchmarkArgumentError(argument, f"expected a number, got {value!r}")
    if not value > 0:
        raise BenchmarkArgumentError(argument, f"must be > 0, got {value!r}")
    return float(value)


#: What a configuration times: the whole layer (projections included) or the
#: attention between the projections only (``BaseAttention.attend``).
SCOPES = ("layer", "attention")


def _scope(value: Any) -> str:
    if value not in SCOPES:
        raise BenchmarkArgumentError(
            "scope", f"must be one of {', '.join(SCOPES)}; received {value!r}"
        )
    return value


@dataclass
class BenchmarkConfig:
    """A complete, validated benchmark request (see :func:`run_benchmark`).

    Use :meth:`create` to build one from loosely typed values; it validates
    every field and raises :class:`BenchmarkArgumentError` naming the field.

    Attributes:
        layers: the layer labels, baseline first (``row["layer"]``).
        layer_specs: label -> Keras layer config as given (placeholders
            unevaluated, ``--option`` values not merged); see
            :meth:`layer_spec` for what one configuration builds.
    """

    layers: list[str]
    lengths: list[int]
    backends: list[str]
    modes: list[str] = field(default_factory=lambda: list(MODES))
    batch: int = 1
    num_heads: int = 4
    head_dim: int = 64
    window: int = 256
    causal: bool = True
    scope: str = "layer"
    repeats: int = 5
    warmup: int = 1
    timeout: float = 600.0
    memory_limit_gb: float = 16.0
    options: dict[str, Any] = field(default_factory=dict)
    tf_jit: bool = True
    baseline: str | None = "full"
    seed: int = 0
    layer_specs: dict[str, dict] = field(default_factory=dict)
    #: Time a float32 matmul in every worker: the peak of the efficiency
    #: columns (keras_longattn.benchmarks.efficiency).
    efficiency: bool = False
    #: Settle glibc's malloc in every worker before timing
    #: (keras_longattn.benchmarks.worker.settle_allocator).
    settle_allocator: bool = True

    @classmethod
    def create(
        cls,
        layers: Any,
        lengths: str | int | Iterable[Any],
        backends: str | Iterable[str] | None = None,
        modes: str | Iterable[str] = MODES,
        batch: int = 1,
        num_heads: int = 4,
        head_dim: int = 64,
        window: int = 256,
        causal: bool = True,
        scope: str = "layer",
        repeats: int = 5,
        warmup: int = 1,
        timeout: float = 600.0,
        memory_limit_gb: float = 16.0,
        options: Mapping[str, Any] | Sequence[str] | None = None,
        tf_jit: bool = True,
        baseline: Any = "full",
        seed: int = 0,
        efficiency: bool = False,
        settle_allocator: bool = True,
    ) -> "BenchmarkConfig":
        """Parse and validate; the baseline layer is put first in ``layers``.

        Every layer's config is resolved for every length (placeholders,
        ``--option`` values, ``num_heads`` and ``key_dim``), so that a
        mistake is reported before anything runs. Whether the layer's
        constructor accepts every option needs its class, which the runner
        checks (:func:`keras_longattn.benchmarks.runner.check_layers`).

        Args:
            layers: see :func:`parse_layers`.
            baseline: the label of one of ``layers``, or a layer as
                :func:`parse_layers` takes it (added first when missing);
                ``None`` for no ratios. Defaults to ``"full"``.
            (the others): see :func:`keras_longattn.benchmarks.run_benchmark`.
        """
        specs = parse_layers(layers)
        labels = [spec.label for spec in specs]
        baseline_label = None
        if baseline is not None:
            if isinstance(baseline, str) and baseline.strip() in labels:
                baseline_label = baseline.strip()
            else:
                extra = parse_layers(baseline, argument="baseline")
                if len(extra) != 1:
                    raise BenchmarkArgumentError(
                        "baseline", f"expected one layer, got {len(extra)}: {baseline!r}"
                    )
                baseline_label = extra[0].label
                if baseline_label in labels:
                    index = labels.index(baseline_label)
                    if specs[index] != extra[0]:
                        raise BenchmarkArgumentError(
                            "baseline",
                            f"the baseline is labelled {baseline_label!r} like another "
                            "layer of --layers with a different config; give it a "
                            "distinct \"name\"",
                        )
                else:
                    specs.insert(0, extra[0])
            specs.sort(key=lambda spec: spec.label != baseline_label)
        config = cls(
            layers=[spec.label for spec in specs],
            lengths=parse_lengths(lengths),
            backends=parse_backends(backends),
            modes=parse_modes(modes),
            batch=_positive_int("batch", batch),
            num_heads=_positive_int("num_heads", num_heads),
            head_dim=_positive_int("head_dim", head_dim),
            window=_positive_int("window", window),
            causal=bool(causal),
            scope=_scope(scope),
            repeats=_positive_int("repeats", repeats),
            warmup=_positive_int("warmup", warmup, minimum=0),
            timeout=_positive_float("timeout", timeout),
            memory_limit_gb=_positive_float("memory_limit_gb", memory_limit_gb),
            options=parse_options(options),
            tf_jit=bool(tf_jit),
            baseline=baseline_label,
            seed=_positive_int("seed", seed, minimum=0),
            layer_specs={spec.label: spec.to_dict() for spec in specs},
            efficiency=bool(efficiency),
            settle_allocator=bool(settle_allocator),
        )
        config._check_layer_specs()
        return config

    def _check_layer_specs(self) -> None:
        """Every option targets a layer; every config resolves at every length."""
        for key in self.options:
            prefix, dot, _ = key.rpartition(".")
            if dot and prefix not in self.layers:
                raise BenchmarkArgumentError(
                    "option",
                    f"option {key!r} names no layer of this run; the layers are "
                    f"{', '.join(self.layers)}",
                )
        for label in self.layers:
            options = self.layer_options(label)
            for seq_len in self.lengths:
                try:
                    self.layer_spec(label, seq_len)
                except LayerConfigError as exc:
                    raise BenchmarkArgumentError(
                        "option" if options and self._resolves_without_options(label, seq_len)
                        else "layers",
                        str(exc),
                    ) from None

    def _resolves_without_options(self, label: str, seq_len: int) -> bool:
        try:
            resolve_spec(self.layer_specs[label], seq_len=seq_len, num_heads=self.num_heads,
                         key_dim=self.head_dim, batch=self.batch, window=self.window)
        except LayerConfigError:
            return False
        return True

    def layer_options(self, label: str) -> dict[str, Any]:
        """The ``--option`` values applied to layer ``label`` (see
        :func:`layer_options`)."""
        return layer_options(label, self.options)

    def layer_spec(self, label: str, seq_len: int) -> dict[str, Any]:
        """The layer config that layer ``label`` is built from at ``seq_len``.

        Returns:
            ``{"class_name": ..., "config": {...}}`` with the options merged,
            the placeholders evaluated, and ``num_heads`` and ``key_dim`` set.

        Raises:
            LayerConfigError: see
                :func:`keras_longattn.benchmarks.layer_config.resolve_spec`.
        """
        return resolve_spec(
            self.layer_specs[label], seq_len=seq_len, num_heads=self.num_heads,
            key_dim=self.head_dim, batch=self.batch, window=self.window,
            options=self.layer_options(label), label=label,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy."""
        return asdict(self)
