"""The benchmark's layer specs: the names of :mod:`keras_longattn.specs` under
the benchmark's module path.

A layer spec (a Keras layer config, a class reference or a registered short
name), its ``"${...}"`` placeholders and the config one configuration builds
are described in :mod:`keras_longattn.specs.layer_spec`; the resolver from a
config to a layer (:func:`build_layer`, shared with the LRA-style suite and
the model builders) in :mod:`keras_longattn.specs.resolver`. The functions
here are those, the same objects.
"""

from __future__ import annotations

from keras_longattn.specs.layer_spec import (
    MAX_PLACEHOLDER_INT,
    PLACEHOLDER_VARIABLES,
    LayerConfigError,
    LayerSpec,
    LayerUnavailableError,
    check_placeholders,
    evaluate_placeholder,
    is_class_reference,
    resolve_spec,
    spec_from_dict,
    spec_from_reference,
    substitute_placeholders,
)
from keras_longattn.specs.resolver import (
    accepted_options,
    build_layer,
    check_config,
    check_specs,
    resolve_class,
)

__all__ = [
    "LayerConfigError",
    "LayerUnavailableError",
    "LayerSpec",
    "PLACEHOLDER_VARIABLES",
    "MAX_PLACEHOLDER_INT",
    "spec_from_dict",
    "spec_from_reference",
    "is_class_reference",
    "evaluate_placeholder",
    "substitute_placeholders",
    "check_placeholders",
    "resolve_spec",
    "resolve_class",
    "accepted_options",
    "check_config",
    "build_layer",
    "check_specs",
]
