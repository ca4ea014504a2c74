"""Benchmark settings: parsing and validation shared by the CLI and the API.

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

__all__ = [
    "BACKENDS",
    "MODES",
    "BenchmarkArgumentError",
    "BenchmarkConfig",
    "default_backend",
    "parse_layers",
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


def parse_layers(value: str | Iterable[str]) -> list[str]:
    """Registered layer names from ``"full,local"`` or a list."""
    names = _dedupe(_split(value, "layers"))
    known = registry.available_layers()
    for name in names:
        if name not in known:
            raise BenchmarkArgumentError(
                "layers", f"unknown layer {name!r}; known layers: {', '.join(known)}"
            )
    return names


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
    """``name`` or ``layer.name`` with ``name`` a Python identifier."""
    if not isinstance(name, str):
        return False
    prefix, dot, rest = name.rpartition(".")
    if dot and not registry.is_valid_name(prefix):
        return False
    return rest.isidentifier()


def parse_option(text: str) -> tuple[str, Any]:
    """``"name=value"`` into ``(name, value)``; the value is parsed as a literal.

    ``name`` may be prefixed with a layer name (``local.block_size=128``) to
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

    @classmethod
    def create(
        cls,
        layers: str | Iterable[str],
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
        baseline: str | None = "full",
        seed: int = 0,
    ) -> "BenchmarkConfig":
        """Parse and validate; the baseline layer is put first in ``layers``."""
        layer_names = parse_layers(layers)
        if baseline is not None:
            if baseline not in registry.available_layers():
                raise BenchmarkArgumentError(
                    "baseline",
                    f"unknown layer {baseline!r}; known layers: "
                    f"{', '.join(registry.available_layers())}",
                )
            layer_names = [baseline] + [name for name in layer_names if name != baseline]
        return cls(
            layers=layer_names,
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
            baseline=baseline,
            seed=_positive_int("seed", seed, minimum=0),
        )

    def layer_options(self) -> dict[str, Any]:
        """All layer options: ``window`` plus the ``--option`` values (which win)."""
        return {"window": self.window, **self.options}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy."""
        return asdict(self)
