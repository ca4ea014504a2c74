"""Layer specs shared by the benchmark, the LRA-style suite and the model builders.

One place for what ``keras-longattn bench`` (:mod:`keras_longattn.benchmarks`),
``keras-longattn lra`` (:mod:`keras_longattn.lra`) and the model builders
(:mod:`keras_longattn.models`) do alike with an attention layer given as a
spec:

* :mod:`~keras_longattn.specs.layer_spec`: a spec as a Keras layer config
  (:class:`LayerSpec`), its ``"${...}"`` placeholders and their bounds, and
  the config one run builds (:func:`resolve_spec`);
* :mod:`~keras_longattn.specs.arguments`: ``--layers`` and ``--option``
  values (:func:`parse_layers`, :func:`parse_option`), their
  :class:`ArgumentError`, their argparse conversion (:func:`argument_type`);
* :mod:`~keras_longattn.specs.registry`: the short layer names
  (``"full"``, ``"local"``, ...);
* :mod:`~keras_longattn.specs.resolver`: the one resolver from a spec to a
  layer (:func:`resolve_class`, :func:`build_layer`), with the capability
  checks of a layer against where it runs (:func:`check_capabilities`);
* :mod:`~keras_longattn.specs.progress`: the progress display of a run.

Importing this package imports neither Keras nor a backend; the resolver
imports Keras when it is called.
"""

from .arguments import (
    ArgumentError,
    argument_type,
    layer_options,
    parse_layers,
    parse_option,
    parse_options,
    parse_value,
    split_items,
)
from .layer_spec import (
    MAX_PLACEHOLDER_INT,
    PLACEHOLDER_VARIABLES,
    LayerConfigError,
    LayerSpec,
    LayerUnavailableError,
    as_layer_config,
    check_placeholders,
    evaluate_placeholder,
    is_class_reference,
    resolve_spec,
    spec_from_dict,
    spec_from_reference,
    substitute_placeholders,
)
from .progress import PlainProgress, Progress, RichProgress, SilentProgress, make_progress
from .registry import RegistryEntry, available_layers, get_entry, get_spec, register, unregister
from .resolver import (
    accepted_options,
    build_layer,
    check_capabilities,
    check_config,
    check_specs,
    describe_spec,
    library_layers,
    resolve_class,
)

__all__ = [
    "ArgumentError",
    "LayerConfigError",
    "LayerSpec",
    "LayerUnavailableError",
    "MAX_PLACEHOLDER_INT",
    "PLACEHOLDER_VARIABLES",
    "PlainProgress",
    "Progress",
    "RegistryEntry",
    "RichProgress",
    "SilentProgress",
    "accepted_options",
    "argument_type",
    "as_layer_config",
    "available_layers",
    "build_layer",
    "check_capabilities",
    "check_config",
    "check_placeholders",
    "check_specs",
    "describe_spec",
    "evaluate_placeholder",
    "get_entry",
    "get_spec",
    "is_class_reference",
    "layer_options",
    "library_layers",
    "make_progress",
    "parse_layers",
    "parse_option",
    "parse_options",
    "parse_value",
    "register",
    "resolve_class",
    "resolve_spec",
    "spec_from_dict",
    "spec_from_reference",
    "split_items",
    "substitute_placeholders",
    "unregister",
]
