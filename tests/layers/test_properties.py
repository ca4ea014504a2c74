"""The Hypothesis property suite (keras_longattn.testing.properties) on
every layer of the library.

Failures caused by the known bugs of issue 12 are listed in each class's
``known_failures`` (marked ``xfail(strict=True)`` by the root conftest), per
backend and per parametrized case, so that each mark records exactly the
combination that fails today.
"""

import keras

from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import RoutingAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.testing.properties import AttentionLayerProperties

FIXTURES = ("test_prop_fixture_outputs", "test_prop_keras_file_from_backend")
#: Examples of the secondary configurations (the CI budget).
FEWER = {"reference": 2, "invariance": 1, "nonfinite": 1, "large": 2}

BACKEND = keras.backend.backend()


def issue12(item, what, *test_ids, backends=("jax", "tensorflow", "torch")):
    """known_failures entries: ``test_ids`` fail on ``backends`` because of
    issue 12 item ``item``."""
    if BACKEND not in backends:
        return {}
    reason = f"issue 12 item {item}: {what} (fixed on main)"
    return {test_id: reason for test_id in test_ids}


# The known failures, by item.
VALUE_DIM = issue12(
    1, "value_dim != key_dim crashes FullAttention's fused path on JAX",
    "test_prop_projection_shapes[value_dim]",
    "test_prop_projection_shapes[value_dim_output_shape_tuple]",
    backends=("jax",),
)
DYNAMIC = issue12(
    2, "a functional model with Input((None, F)) fails at its second length on "
    "TensorFlow", "test_prop_dynamic_length", backends=("tensorflow",),
)
PADDED_LENGTH = issue12(
    3, "block length / routing window derived from the padded length",
    "test_prop_batch_composition",
)
TIES = issue12(
    4, "balanced routing breaks similarity ties by the highest index on torch",
    "test_prop_fixture_outputs", "test_prop_keras_file_from_backend",
    backends=("torch",),
)
NONFINITE = issue12(
    6, "NaN/inf in padded keys/values reaches real outputs and gradients",
    "test_prop_nonfinite_padding",
)


class TestFullAttentionProperties(AttentionLayerProperties):
    layer_cls = FullAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8}
    # Dynamic length: the suite's model is causal with padding, the case of
    # FullAttention that item 2 breaks.
    known_failures = {**VALUE_DIM, **DYNAMIC, **NONFINITE}
    fixture_cases = ("full_causal_padded",)


class TestLocalAttentionProperties(AttentionLayerProperties):
    layer_cls = LocalAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 5}
    known_failures = {**DYNAMIC, **NONFINITE}
    fixture_cases = ("local_cross",)


class TestSparseStridedDefaultProperties(AttentionLayerProperties):
    """Default block length (derived from the call's length)."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "strided"}
    known_failures = {**DYNAMIC, **PADDED_LENGTH, **NONFINITE}


class TestSparseStridedProperties(AttentionLayerProperties):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "strided", "block_length": 4}
    fixture_cases = ("sparse_strided_causal",)
    known_failures = {**DYNAMIC, **NONFINITE}
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding") + FIXTURES
    property_examples = FEWER


class TestSparseFixedDefaultProperties(AttentionLayerProperties):
    """Default block length and summary width, merged heads."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed",
                   "combination": "merged"}
    fixture_cases = ("sparse_fixed_default",)
    known_failures = {**DYNAMIC, **PADDED_LENGTH, **NONFINITE}
    ci_properties = ("test_prop_matches_reference", "test_prop_batch_composition") + FIXTURES
    property_examples = FEWER


class TestSparseFixedProperties(AttentionLayerProperties):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed",
                   "block_length": 5, "summary_width": 2}
    known_failures = {**DYNAMIC, **NONFINITE}
    ci_properties = ("test_prop_matches_reference", "test_prop_large_inputs_finite",
                     "test_prop_projection_shapes")
    property_examples = FEWER


class TestRoutingAttentionProperties(AttentionLayerProperties):
    """One local and one routing head: balanced routing in bidirectional
    calls, token routing in causal ones."""

    layer_cls = RoutingAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "num_clusters": 3, "local_heads": 1}
    min_length = 3  # balanced routing: num_clusters <= the padded length
    # Balanced routing is discrete: bfloat16 projections move tokens across
    # clusters (relative error ~0.6 against float32), so bfloat16 is checked
    # for dtype and finiteness only.
    precision_rtol = {"float16": 2e-2, "bfloat16": None}
    fixture_cases = ("routing_balanced_repeated", "routing_token_causal", "routing_ties")
    known_failures = {**DYNAMIC, **PADDED_LENGTH, **TIES, **NONFINITE}


class TestRoutingAttentionSharedQKProperties(AttentionLayerProperties):
    layer_cls = RoutingAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "num_clusters": 3, "shared_qk": True}
    supports_cross_attention = False
    min_length = 3
    precision_rtol = {"float16": 2e-2, "bfloat16": None}
    fixture_cases = ("routing_shared_qk",)
    known_failures = {**DYNAMIC, **PADDED_LENGTH, **TIES, **NONFINITE}
    ci_properties = ("test_prop_matches_reference", "test_prop_batch_composition",
                     "test_prop_nonfinite_padding") + FIXTURES
    property_examples = FEWER
