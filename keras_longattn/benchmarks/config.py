"""Benchmark settings: parsing and validation shared by the CLI and the API.

Layers are given as short names, class references or Keras layer configs
(parsed by :func:`keras_longattn.specs.arguments.parse_layers`, described in
:mod:`keras_longattn.specs.layer_spec`);
a validated :class:`BenchmarkConfig` holds each layer's config under its
label and resolves it per sequence length (:meth:`BenchmarkConfig.layer_spec`).

Nothing here imports Keras or a backend.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from keras_longattn.specs.arguments import (
    ArgumentError,
    layer_options,
    parse_layers,
    parse_option,
    parse_options,
    split_items,
)
from keras_longattn.specs.layer_spec import LayerConfigError, resolve_spec

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


#: An invalid benchmark setting: the argument error of
#: :mod:`keras_longattn.specs.arguments`, which the layer and option parsers
#: shared with the suite raise. ``argument`` is the setting's name as in
#: :func:`~keras_longattn.benchmarks.run_benchmark` (``"lengths"``), ``flag``
#: its command-line flag (``--lengths``) and ``detail`` what is wrong with it.
BenchmarkArgumentError = ArgumentError


def _dedupe(items: Iterable[Any]) -> list[Any]:
    seen: dict[Any, None] = {}
    for item in items:
        seen.setdefault(item, None)
    return list(seen)


def default_backend() -> str:
    """``$KERAS_BACKEND`` when it is a supported backend, else ``"jax"``."""
    backend = os.environ.get("KERAS_BACKEND", "").strip().lower()
    return backend if backend in BACKENDS else "jax"


def parse_lengths(value: str | int | Iterable[Any]) -> list[int]:
    """Sorted distinct positive sequence lengths from ``"1024,4096"`` or a list.

    ``k`` suffixes are accepted (``"16k"`` is 16384).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    lengths = []
    for item in split_items(value, "lengths"):
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
    backends = _dedupe(item.lower() for item in split_items(value, "backends"))
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
    modes = _dedupe(item.lower() for item in split_items(value, "modes"))
    for mode in modes:
        if mode not in MODES:
            raise BenchmarkArgumentError(
                "modes", f"unknown mode {mode!r}; choose from {', '.join(MODES)}"
            )
    return [mode for mode in MODES if mode in modes]


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
            layers: see :func:`keras_longattn.specs.arguments.parse_layers`.
            baseline: the label of one of ``layers``, or a layer as
                ``parse_layers`` takes it (added first when missing);
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
        :func:`keras_longattn.specs.arguments.layer_options`)."""
        return layer_options(label, self.options)

    def layer_spec(self, label: str, seq_len: int) -> dict[str, Any]:
        """The layer config that layer ``label`` is built from at ``seq_len``.

        Returns:
            ``{"class_name": ..., "config": {...}}`` with the options merged,
            the placeholders evaluated, and ``num_heads`` and ``key_dim`` set.

        Raises:
            LayerConfigError: see
                :func:`keras_longattn.specs.layer_spec.resolve_spec`.
        """
        return resolve_spec(
            self.layer_specs[label], seq_len=seq_len, num_heads=self.num_heads,
            key_dim=self.head_dim, batch=self.batch, window=self.window,
            options=self.layer_options(label), label=label,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy."""
        return asdict(self)
