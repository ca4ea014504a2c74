"""Short names for layer configs: ``--layers full,local``.

Each entry maps a short name (``"full"``, ``"local"``, ``"mha"``, ...) to a
Keras layer config, ``{"class_name": ..., "config": {...}}`` (see
:mod:`keras_longattn.specs.layer_spec`). The benchmark
(``keras-longattn bench``) and the LRA-style suite (``keras-longattn lra``)
take the same names. A name is only a shorthand: any layer can be
benchmarked from its config, with no entry here::

    keras-longattn bench --layers '{"class_name": "LocalAttention",
                                    "config": {"window": 128}}'

Values that depend on the configuration are ``"${...}"`` placeholders,
evaluated for each configuration: ``local`` takes ``"${window}"`` (the
benchmark's ``--window``), ``routing`` takes ``"${max(1,
round(sqrt(seq_len)))}"`` clusters. ``num_heads`` and ``key_dim`` come from
``--heads`` and ``--head-dim``.

Entries can be added at run time::

    from keras_longattn.benchmarks import register
    register("local128", {"class_name": "LocalAttention", "config": {"window": 128}})

This module does not import Keras or a backend.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from .layer_spec import LayerConfigError, LayerSpec, spec_from_dict, spec_from_reference

__all__ = [
    "RegistryEntry",
    "register",
    "is_valid_name",
    "unregister",
    "get_entry",
    "get_spec",
    "available_layers",
]

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]*$")


@dataclass(frozen=True)
class RegistryEntry:
    """One short layer name.

    Attributes:
        name: the short name used on the command line.
        config: the Keras layer config it stands for,
            ``{"class_name": ..., "config": {...}}``.
        description: one line shown by ``--list-layers``.
    """

    name: str
    config: dict
    description: str = ""


_REGISTRY: dict[str, RegistryEntry] = {}


def is_valid_name(name: Any) -> bool:
    """Whether ``name`` can be a layer name (letters, digits, ``_``, ``-``)."""
    return isinstance(name, str) and bool(_NAME_RE.match(name))


def register(
    name: str,
    config: Mapping[str, Any] | str,
    description: str = "",
    overwrite: bool = False,
) -> RegistryEntry:
    """Register a short name for a layer config.

    Args:
        name: short name for ``--layers`` (letters, digits, ``_`` and ``-``,
            starting with a letter).
        config: a Keras layer config ``{"class_name": ..., "config": {...}}``
            (values may be ``"${...}"`` placeholders), or a class reference
            ``"package>Class"`` / ``"package.module:Class"`` for the class
            with the benchmark's defaults only. It is sent to the worker
            subprocess as JSON, so it must be JSON-serialisable.
        description: one line shown by ``keras-longattn bench --list-layers``.
            Defaults to the config.
        overwrite: replace an existing entry of the same name instead of
            raising. Defaults to ``False``.

    Returns:
        The new :class:`RegistryEntry`.

    Raises:
        ValueError: an invalid name, a name already registered, or an
            invalid config (:class:`LayerConfigError`).
    """
    if not is_valid_name(name):
        raise ValueError(
            f"invalid layer name {name!r}: use letters, digits, '_' or '-', "
            "starting with a letter"
        )
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"layer {name!r} is already registered (pass overwrite=True)")
    if isinstance(config, str):
        spec = spec_from_reference(config)
    elif isinstance(config, Mapping):
        spec = spec_from_dict(config, label=name)
    else:
        raise LayerConfigError(
            f"config of layer {name!r} must be a Keras layer config dict "
            "({'class_name': ..., 'config': {...}}) or a class reference "
            f"'package.module:Class'; received {config!r}"
        )
    entry = RegistryEntry(name=name, config=spec.to_dict(), description=description)
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


def get_spec(name: str) -> LayerSpec:
    """The :class:`~keras_longattn.specs.layer_spec.LayerSpec` of a
    registered name, labelled ``name``."""
    return spec_from_dict(get_entry(name).config, label=name)


#: The built-in short names. The measured configurations are those of the
#: factories that preceded them (``docs/benchmarks/results.json``): ``local``
#: uses ``--window``, the sparse layers ``block_length`` 128, ``routing``
#: about sqrt(n) clusters and its own default window (n / clusters);
#: ``longformer`` the paper's window 512 with 16 global positions;
#: ``adamra`` the layer's default rates, ``1 / 2**(h + 1)`` for head ``h``
#: (the paper's ``(1/2, 1/4, 1/8, 1/16)`` for four heads); ``linformer``
#: k = 256 slots (the paper's Table 3) with ``max_length`` the benchmark's
#: length; ``synthesizer`` the paper's best translation mixture, random +
#: vanilla, with tables of the benchmark's length; ``bigbird`` the paper's
#: blocks of 64 with 3 window, 2 global and 3 random blocks (seed 0);
#: ``nystrom`` the paper's 64 landmarks; ``lsh`` the Reformer's buckets of
#: 64 with 4 hashing rounds; ``entmax`` the exact 1.5-entmax of the
#: paper's fixed-α runs; ``adaptive-span*`` ``max_span`` = ``--window``
#: with the paper's ramp of 32 and the spans at 0, 1/8 or all of
#: ``max_span``.
_BUILTIN = (
    ("full", {"class_name": "FullAttention", "config": {}},
     "keras_longattn FullAttention (exact; the ratio baseline)"),
    ("local", {"class_name": "LocalAttention", "config": {"window": "${window}"}},
     "keras_longattn LocalAttention, window --window"),
    ("sparse-strided",
     {"class_name": "SparseAttention", "config": {"pattern": "strided", "block_length": 128}},
     "keras_longattn SparseAttention, strided pattern, block_length 128"),
    ("sparse-fixed",
     {"class_name": "SparseAttention", "config": {"pattern": "fixed", "block_length": 128}},
     "keras_longattn SparseAttention, fixed pattern, block_length 128"),
    ("routing",
     {"class_name": "RoutingAttention",
      "config": {"num_clusters": "${max(1, round(sqrt(seq_len)))}"}},
     "keras_longattn RoutingAttention, num_clusters round(sqrt(n))"),
    ("longformer",
     {"class_name": "LongformerAttention", "config": {"window": 512, "global_tokens": 16}},
     "keras_longattn LongformerAttention, window 512, the first 16 positions global"),
    ("adamra", {"class_name": "AdaMRAAttention", "config": {}},
     "keras_longattn AdaMRAAttention, compression rates 1/2, 1/4, ... (one per "
     "head), kernelized ReLU attention, learned routing"),
    ("linformer",
     {"class_name": "LinformerAttention",
      "config": {"k": "${min(256, seq_len)}", "max_length": "${seq_len}"}},
     "keras_longattn LinformerAttention, k = 256 projected slots (n when "
     "shorter), headwise sharing, bidirectional only"),
    ("synthesizer",
     {"class_name": "SynthesizerAttention",
      "config": {"kind": "random+vanilla", "max_length": "${seq_len}"}},
     "keras_longattn SynthesizerAttention, random + vanilla logits mixed by "
     "learned weights"),
    ("bigbird",
     {"class_name": "BigBirdAttention",
      "config": {"block_size": 64, "window_blocks": 3, "global_blocks": 2,
                 "random_blocks": 3, "seed": 0}},
     "keras_longattn BigBirdAttention, blocks of 64: 3 window, 2 global and "
     "3 random blocks per query block"),
    ("nystrom", {"class_name": "NystromAttention", "config": {"num_landmarks": 64}},
     "keras_longattn NystromAttention, 64 landmarks (the paper's), 6 pseudo-inverse "
     "iterations, bidirectional only"),
    ("lsh",
     {"class_name": "LSHAttention",
      "config": {"bucket_size": 64, "num_hashes": 4, "hash_seed": 0}},
     "keras_longattn LSHAttention, buckets of 64, 4 hashing rounds (seed 0)"),
    ("linear", {"class_name": "LinearAttention", "config": {}},
     "keras_longattn LinearAttention, elu+1 features, causal by chunked prefix "
     "sums (chunks of 64)"),
    ("performer",
     {"class_name": "PerformerAttention", "config": {"num_features": 256, "seed": 0}},
     "keras_longattn PerformerAttention (FAVOR+), 256 fixed orthogonal random "
     "features (seed 0), causal by chunked prefix sums"),
    ("entmax", {"class_name": "EntmaxAttention", "config": {"alpha": 1.5}},
     "keras_longattn EntmaxAttention, exact 1.5-entmax (sort-based) in place of "
     "softmax over every key"),
    ("entmax-learned", {"class_name": "EntmaxAttention", "config": {"alpha": "learned"}},
     "keras_longattn EntmaxAttention, a learned alpha per head (from 1.5), "
     "bisection"),
    ("adaptive-span",
     {"class_name": "AdaptiveSpanAttention", "config": {"max_span": "${window}"}},
     "keras_longattn AdaptiveSpanAttention, max_span --window, ramp 32, every "
     "span at its initial 0 (the band is the ramp)"),
    ("adaptive-span-max",
     {"class_name": "AdaptiveSpanAttention",
      "config": {"max_span": "${window}", "span_init": 1.0}},
     "keras_longattn AdaptiveSpanAttention, max_span --window, ramp 32, every "
     "span at max_span"),
    ("adaptive-span-8th",
     {"class_name": "AdaptiveSpanAttention",
      "config": {"max_span": "${window}", "span_init": 0.125}},
     "keras_longattn AdaptiveSpanAttention, max_span --window, ramp 32, every "
     "span at max_span / 8 (the band follows the spans in eager calls: "
     "torch)"),
    ("mha", {"class_name": "MultiHeadAttention", "config": {}},
     "keras.layers.MultiHeadAttention (Keras baseline)"),
)

for _name, _config, _description in _BUILTIN:
    register(_name, _config, _description)
del _name, _config, _description
