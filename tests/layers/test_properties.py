"""The Hypothesis property suite (keras_longattn.testing.properties) on
every layer of the library.

Each property ran against the bugs of issues 12 and 36 before they were
fixed and failed on them (the regression tests of
tests/layers/test_reliability.py and the layers' own reliability files pin
each one down). The contract checks of
``AttentionLayerProperties.always_in_ci`` (padding inert on every path and
mask kind, empty inputs, prefix consistency, seeding, argument checks,
mixed precision) run in CI for one configuration of each of the thirteen
layers; a secondary configuration of a layer runs the ones its options
change (``SECONDARY``).
"""

import keras

from keras_longattn.layers import AdaMRAAttention
from keras_longattn.layers import FullAttention
from keras_longattn.layers import LinearAttention
from keras_longattn.layers import LinformerAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import BigBirdAttention
from keras_longattn.layers import LongformerAttention
from keras_longattn.layers import LSHAttention
from keras_longattn.layers import NystromAttention
from keras_longattn.layers import PerformerAttention
from keras_longattn.layers import RoutingAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.layers import SynthesizerAttention
from keras_longattn.testing.properties import AttentionLayerProperties

FIXTURES = ("test_prop_fixture_outputs", "test_prop_keras_file_from_backend")
#: Examples of the secondary configurations (the CI budget).
FEWER = {"reference": 2, "invariance": 1, "nonfinite": 1, "large": 2}

BACKEND = keras.backend.backend()
#: The contract checks a secondary configuration of a layer runs in CI
#: (construction-time checks and seeding run once per layer class).
SECONDARY = ("test_prop_padding_inert_every_path", "test_prop_empty_inputs")
#: Bad values of the epsilon of the kernelized layers.
BAD_EPSILON = (float("inf"), float("nan"), -1.0, "1e-6")


class TestFullAttentionProperties(AttentionLayerProperties):
    layer_cls = FullAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8}
    # Dynamic length: the suite's model is causal with padding, the case of
    # FullAttention that item 2 breaks.
    fixture_cases = ("full_causal_padded",)


class TestLocalAttentionProperties(AttentionLayerProperties):
    layer_cls = LocalAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 5}
    fixture_cases = ("local_cross",)
    invalid_arguments = {"window": (0, -1, 2.5, "a"), "block_size": (0, -4, 1.5)}


class TestSparseStridedDefaultProperties(AttentionLayerProperties):
    """Default block length (derived from the call's length)."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "strided"}
    invalid_arguments = {"pattern": ("diagonal",), "block_length": (0, -1, 1.5),
                         "combination": ("both",)}


class TestSparseStridedProperties(AttentionLayerProperties):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "strided", "block_length": 4}
    fixture_cases = ("sparse_strided_causal",)
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding") + FIXTURES
    property_examples = FEWER
    always_in_ci = SECONDARY


class TestSparseFixedDefaultProperties(AttentionLayerProperties):
    """Default block length and summary width, merged heads."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed",
                   "combination": "merged"}
    fixture_cases = ("sparse_fixed_default",)
    ci_properties = ("test_prop_matches_reference", "test_prop_batch_composition") + FIXTURES
    property_examples = FEWER
    # The fixed pattern's block length and summary width derived at build.
    always_in_ci = SECONDARY + ("test_prop_prefix_consistency",)


class TestSparseFixedProperties(AttentionLayerProperties):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed",
                   "block_length": 5, "summary_width": 2}
    ci_properties = ("test_prop_matches_reference", "test_prop_large_inputs_finite",
                     "test_prop_projection_shapes")
    property_examples = FEWER
    always_in_ci = SECONDARY


class TestRoutingAttentionProperties(AttentionLayerProperties):
    """One local and one routing head: balanced routing in bidirectional
    calls, token routing in causal ones."""

    layer_cls = RoutingAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "num_clusters": 3, "local_heads": 1}
    min_length = 3  # balanced routing: num_clusters <= the padded length
    # Routing places tokens by their clusters (balanced clusters of equal
    # size, sorted chunks): a position padded only through value_mask is a
    # real query and takes a place (docs/guides/routing_attention.md).
    couples_queries = True
    # Balanced routing is discrete: bfloat16 projections move tokens across
    # clusters (relative error ~0.6 against float32), so bfloat16 is checked
    # for dtype and finiteness only.
    precision_rtol = {"float16": 2e-2, "bfloat16": None}
    fixture_cases = ("routing_balanced_repeated", "routing_token_causal", "routing_ties")
    invalid_arguments = {"num_clusters": (0, 1.5), "ema_decay": (1.5, -0.1, float("nan")),
                         "local_heads": (-1, 3), "causal_routing": ("x",)}


class TestRoutingAttentionSharedQKProperties(AttentionLayerProperties):
    layer_cls = RoutingAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "num_clusters": 3, "shared_qk": True}
    supports_cross_attention = False
    min_length = 3
    couples_queries = True  # as above
    precision_rtol = {"float16": 2e-2, "bfloat16": None}
    fixture_cases = ("routing_shared_qk",)
    ci_properties = ("test_prop_matches_reference", "test_prop_batch_composition",
                     "test_prop_nonfinite_padding") + FIXTURES
    property_examples = FEWER
    always_in_ci = SECONDARY


class TestLinformerProperties(AttentionLayerProperties):
    """Headwise sharing; lengths up to the layer's max_length (64)."""

    layer_cls = LinformerAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "k": 8, "max_length": 64}
    supports_causal = False
    max_length = 64
    # Right padding is checked against the example alone in
    # tests/layers/test_linformer_attention.py; here: unknown lengths while
    # tracing (E sliced by a tensor length).
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding",
                     "test_prop_dynamic_length")
    property_examples = FEWER
    invalid_arguments = {"k": (0, -2, 1.5), "max_length": (0, 2.5), "sharing": ("x",)}


class TestSynthesizerProperties(AttentionLayerProperties):
    """A mixture of every kind of logits but the factorized ones (those run
    in tests/layers/test_synthesizer_attention.py)."""

    layer_cls = SynthesizerAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "max_length": 64,
                   "kind": "dense+random+vanilla"}
    max_length = 64
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding",
                     "test_prop_batch_composition")
class TestLongformerAttentionProperties(AttentionLayerProperties):
    """A leading global token and heads dilated 1 and 2 (cross-attention
    included: the first position of the queries and of the keys is
    global)."""

    layer_cls = LongformerAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 4, "dilation": [1, 2],
                   "global_tokens": 1}
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding")
    property_examples = FEWER
    invalid_arguments = {"kind": ("x",), "max_length": (0, -1), "rank": (0, 1.5)}
    invalid_arguments = {"window": (-1, 2.5), "dilation": (0, -1), "global_tokens": (-1,),
                         "max_global": (0,)}


class TestBigBirdAttentionProperties(AttentionLayerProperties):
    """Blocks of 4, one global block, two random blocks (cross-attention
    included); an example alone and padded in a batch is checked in
    tests/layers/test_bigbird_attention.py."""

    layer_cls = BigBirdAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "block_size": 4, "global_blocks": 1,
                   "random_blocks": 2, "seed": 5}
    # Lengths unknown while tracing: the random blocks are computed in the graph.
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding",
                     "test_prop_dynamic_length")
    property_examples = FEWER
    # 16 blocks: the random blocks are not all covered by window and globals.
    seed_length = 64
    invalid_arguments = {"block_size": (0, 1.5), "random_blocks": (-1,),
                         "global_blocks": (-1,)}


class TestNystromProperties(AttentionLayerProperties):
    """Eight landmarks; lengths below 8 use one landmark per token. The
    efficient path is checked against the explicit form of the same
    approximation (not against softmax attention)."""

    layer_cls = NystromAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "num_landmarks": 8}
    supports_causal = False
    # Right to left (F (A^+ (B V))) against the explicit (T, S) matrix: the
    # pseudo-inverse amplifies float32 rounding a little.
    reference_rtol = 1e-4
    invariance_rtol = 1e-4
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding",
                     "test_prop_batch_composition", "test_prop_dynamic_length")
    property_examples = FEWER
    # Landmarks are means of queries: a position padded only through
    # value_mask is a real query (docs/guides/nystrom_attention.md).
    couples_queries = True
    invalid_arguments = {"num_landmarks": (0, -1, 1.5), "pinv_iterations": (-1, 1.5)}


class TestLSHAttentionProperties(AttentionLayerProperties):
    """Buckets of 4 on average at the build length (the count is fixed at
    build), two rounds (self-attention only: shared queries and keys); a
    layer built without a known length needs num_buckets under TensorFlow
    tracing (the fixed-bucket class below)."""

    layer_cls = LSHAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "bucket_size": 4, "num_hashes": 2,
                   "hash_seed": 1}
    supports_cross_attention = False
    supports_dynamic_length = False
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding",
                     "test_prop_batch_composition")
    property_examples = FEWER
    seed_arguments = ("seed", "hash_seed")
    # Buckets are discrete: bfloat16 rounding of the inputs (not of the hash,
    # which runs in float32) flips a bucket for about one weight draw in five
    # (relative error up to ~0.9). The seeded case here keeps its buckets on
    # every backend (measured 0.006 bfloat16, 0.0006 float16), so the
    # tolerance is that of rounded values; test_lsh_reliability.py compares
    # calls whose buckets match float32.
    precision_rtol = {"float16": 3e-3, "bfloat16": 2e-2}
    invalid_arguments = {"bucket_size": (0, -1, 1.5), "num_hashes": (0, 1.5),
                         "num_buckets": (0, 1.5), "hash_seed": (-1, 1.5, "a")}


class TestLSHAttentionFixedBucketsProperties(AttentionLayerProperties):
    """A fixed number of buckets: any length, also unknown while tracing."""

    layer_cls = LSHAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "bucket_size": 4, "num_hashes": 2,
                   "num_buckets": 6, "hash_seed": 2}
    supports_cross_attention = False
    ci_properties = ("test_prop_matches_reference", "test_prop_dynamic_length")
    property_examples = FEWER
    always_in_ci = SECONDARY + ("test_prop_prefix_consistency",)


class TestLinearAttentionProperties(AttentionLayerProperties):
    """elu + 1 features, chunks of 5 (causal calls cross chunk borders;
    cross-attention with T != S included). No full-attention limit: the
    reference is the explicit quadratic form of the same features."""

    layer_cls = LinearAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "chunk_size": 5}
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding",
                     "test_prop_large_inputs_finite", "test_prop_dynamic_length")
    property_examples = FEWER
    invalid_arguments = {"epsilon": BAD_EPSILON, "chunk_size": (0, -1, 1.5),
                         "feature_map": ("x",)}
    # As Performer: float32 state, a few unit roundoffs.
    precision_rtol = {"float16": 2.5e-3, "bfloat16": 2e-2}


class TestPerformerAttentionProperties(AttentionLayerProperties):
    """20 random features (a partial block), chunks of 5."""

    layer_cls = PerformerAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "num_features": 20, "chunk_size": 5,
                   "seed": 7}
    reference_rtol = 1e-4
    ci_properties = ("test_prop_matches_reference", "test_prop_batch_composition",
                     "test_prop_nonfinite_padding", "test_prop_dtype_policy")
    # Prefix sums, normaliser and division run in float32 under mixed
    # policies: the error is a few unit roundoffs of the compute dtype and
    # does not grow with the length (measured <= 7.3e-3 bfloat16, 1.0e-3
    # float16 up to n = 2000); 256 positions cross 51 chunks of 5.
    precision_length = 256
    precision_rtol = {"float16": 2.5e-3, "bfloat16": 2e-2}
    property_examples = FEWER
    invalid_arguments = {"epsilon": BAD_EPSILON, "num_features": (0, -1, 1.5),
                         "chunk_size": (0,), "feature_redraw_interval": (0, 1.5)}


class TestAdaMRAProperties(AttentionLayerProperties):
    """The paper's layer (kernelized attention, learned routing), rates 1/2
    and 1/3, two subheads. The conformance classes of
    tests/layers/test_adamra_attention.py run the other properties."""

    layer_cls = AdaMRAAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "compression_rates": (1 / 2, 1 / 3),
                   "num_subheads": 2}
    exact = False
    supports_causal = False
    # Landmarks, features and sums run in float32, but bfloat16 projections
    # can flip the sign of a near-zero ReLU coordinate or the router's
    # argmax, which moves that query's output by O(1) (measured up to 0.49
    # at n = 2000): bfloat16 is checked for dtype and finiteness only.
    precision_rtol = {"float16": 2e-2, "bfloat16": None}
    # Landmarks are segment means of queries and keys.
    couples_queries = True
    ci_properties = ()
    invalid_arguments = {"epsilon": BAD_EPSILON, "num_subheads": (0, 1.5),
                         "compression_rates": ((0.0,), (1.5,), ()),
                         "feature_map": ("x",), "routing": ("x",), "attention": ("x",)}
