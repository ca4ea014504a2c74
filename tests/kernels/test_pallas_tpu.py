"""The TPU variant of the block-sparse Pallas kernel (``variant="prefetch"``,
:mod:`keras_longattn.kernels.jax.pallas_tpu`), checked on the CPU.

In Pallas interpret mode it equals dense attention and the default
``"slice"`` variant, values and gradients, on the kernel cases of
``test_pallas_attention.py``; the layers' ``implementation="pallas"`` paths
equal their reference with every kernel call built as for a TPU. Lowered
for a TPU (Mosaic), each kernel's blocks are ``(block, d)`` tiles, never a
whole sequence. What needs a TPU (Mosaic's compilation, VMEM use, speed,
values on the device) is not checked here, except the compilation where
``TPU_LIBRARY_PATH`` names a libtpu (ahead-of-time, for a TPU v5e).

JAX only.
"""

import contextlib
import os

import keras
import numpy as np
import pytest

from keras_longattn.layers import BigBirdAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import LongformerAttention
from keras_longattn.layers import RoutingAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.ops import block_sparse as la_block_sparse
from keras_longattn.ops import layouts as la_layouts
from keras_longattn.ops import patterns as la_patterns
from keras_longattn.ops import sparse as la_sparse
from keras_longattn.testing import rel_error
from tests.kernels import test_pallas_attention as base

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="the Pallas kernel is JAX only")

#: Largest relative difference between the two kernel variants.
VARIANT_TOL = 1e-6


def _pa():
    from keras_longattn.kernels.jax import pallas_attention

    return pallas_attention


@contextlib.contextmanager
def _built_for_tpu():
    """Every kernel call made inside picks its default variant as for a TPU
    (``"prefetch"``) and still runs in interpret mode."""
    pa = _pa()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pa, "target_platform", lambda: "tpu")
        mp.setattr(pa, "default_interpret", lambda: True)
        yield


def _pallas_calls(jaxpr, found=None):
    """The ``pallas_call`` equations of a jaxpr and of its sub-jaxprs."""
    import jax.extend as jex

    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jex.core.ClosedJaxpr):
                    _pallas_calls(sub.jaxpr, found)
                elif isinstance(sub, jex.core.Jaxpr):
                    _pallas_calls(sub, found)
    return found


def _call_name(eqn):
    name = eqn.params["name"]
    return getattr(name, "name", name)


def _kernel_names(fn, *args):
    """Names of the Pallas kernels that ``fn(*args)`` and its gradient run."""
    import jax
    import jax.numpy as jnp

    def loss(*a):
        out, lse = fn(*a)
        return jnp.sum(out) + jnp.sum(jnp.where(lse > -1e29, lse, 0.0))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    return sorted({_call_name(e) for e in _pallas_calls(jaxpr.jaxpr)})


TPU_KERNELS = ["block_sparse_attention_dkv_tpu", "block_sparse_attention_dq_tpu",
               "block_sparse_attention_forward_tpu"]


def _check_variants(make, q, k, v, mask, scale):
    """``make(variant)`` (a function of q, k, v) with ``"prefetch"`` equals
    dense attention and the ``"slice"`` variant: output, lse and the
    gradients; it runs the TPU kernels."""
    prefetch, seen = base._compare(make("prefetch"), q, k, v, mask, scale)
    sliced = base._values_and_grads(make("slice"), q, k, v, seen)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), prefetch, sliced):
        if name == "lse":
            a, b = a[seen], b[seen]
        assert rel_error(a, b) < VARIANT_TOL, f"{name}: relative error {rel_error(a, b):.3g}"
    assert _kernel_names(make("prefetch"), q, k, v) == TPU_KERNELS
    return prefetch, seen


# ------------------------------------------------- the kernel, interpreted
def test_causal_band_with_padding_and_empty_rows():
    """Causal band, T = S = 70 (not a multiple of the block), key padding:
    example 0 misses its first 12 keys (rows 0..11 see nothing), example 1
    has no real key at all (zeros, MASKED_LOGIT, zero gradients)."""
    import jax.numpy as jnp

    pa = _pa()
    B, n, H, d = 2, 70, 2, 8
    q, k, v = base._random_qkv(B, n, n, H, d, d, 0)
    pattern = la_patterns.LocalPattern(9, 0)
    valid = np.ones((B, n), bool)
    valid[0, :12] = False
    valid[1, :] = False
    layout = la_layouts.band_layout(n, n, 16, 16, 9, 0)
    mask = np.asarray(pattern.dense_mask(n, n))[None, None] & valid[:, None, None, :]

    def make(variant):
        def kernel(q, k, v):
            return pa.block_sparse_attention(q, k, v, layout, predicate=pattern,
                                             k_valid=jnp.asarray(valid), scale=0.3,
                                             variant=variant)
        return kernel

    (out, lse, dq, dk, dv), seen = _check_variants(make, q, k, v, mask, 0.3)
    assert not seen[0, :12].any() and seen[0, 12:].all()
    np.testing.assert_array_equal(out[0, :12], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(lse[1], np.float32(pa.MASKED_LOGIT))
    for g in (dq[1], dk[1], dv[1], dk[0, :12], dv[0, :12]):
        np.testing.assert_array_equal(g, 0.0)


def test_cross_attention_unequal_blocks_shifted_positions():
    """T != S, query blocks of 16 and key blocks of 32, a two-sided band
    with queries at positions 20..59 against keys at 0..74, value head size
    unlike the key's."""
    pa = _pa()
    B, T, S, H = 1, 40, 75, 3
    q, k, v = base._random_qkv(B, T, S, H, 8, 12, 1)
    pattern = la_patterns.LocalPattern(10, 6)
    q_pos = np.arange(20, 20 + T, dtype=np.int32)
    layout = la_layouts.band_layout(T, S, 16, 32, 10, 6, q_start=20)
    mask = np.asarray(pattern.allowed(q_pos[:, None], np.arange(S)[None, :]))[None, None]

    def make(variant):
        def kernel(q, k, v):
            return pa.block_sparse_attention(q, k, v, layout, predicate=pattern, q_pos=q_pos,
                                             variant=variant)
        return kernel

    _check_variants(make, q, k, v, mask, 1 / np.sqrt(8))


def test_per_example_layout_from_the_graph():
    """A layout made in the graph from a boolean block mask per example,
    with a query block that visits nothing, no predicate."""
    import jax.numpy as jnp

    pa = _pa()
    B, n, H, b = 2, 64, 2, 16
    q, k, v = base._random_qkv(B, n, n, H, 8, 8, 3)
    blocks = base._example_block_masks(n // b, n // b, B, 3)
    layout = la_layouts.BlockLayout.from_block_mask(jnp.asarray(blocks), b, b)
    mask = np.repeat(np.repeat(blocks, b, axis=1), b, axis=2)[:, None]

    def make(variant):
        def kernel(q, k, v):
            return pa.block_sparse_attention(q, k, v, layout, variant=variant)
        return kernel

    (out, *_), _ = _check_variants(make, q, k, v, mask, 1 / np.sqrt(8))
    np.testing.assert_array_equal(out[0, b:2 * b], 0.0)


def test_reordered_tokens_keep_positions():
    """Strided B (``(i - j) mod l == 0``, causal) on tokens sorted by column,
    through the layers' arrangement (which picks the default variant: the
    TPU one when built for a TPU)."""
    import jax.numpy as jnp

    pa = _pa()

    B, n, H, l = 2, 50, 1, 6
    q, k, v = base._random_qkv(B, n, n, H, 8, 8, 2)
    pattern = la_sparse.StridedPattern(l) & la_patterns.CausalPattern()
    valid = np.ones((B, n), bool)
    valid[1, 31:] = False
    arranged = la_layouts.arrangement("columns", n, n, l, None, True, 16)
    mask = np.asarray(pattern.dense_mask(n, n))[None, None] & valid[:, None, None, :]

    def make(variant):
        def kernel(q, k, v):
            return la_block_sparse.arranged_attention(q, k, v, arranged, pattern,
                                                    key_mask=jnp.asarray(valid))

        if variant == "slice":
            return kernel

        def on_tpu(q, k, v):
            with _built_for_tpu():
                return kernel(q, k, v)
        return on_tpu

    _check_variants(make, q, k, v, mask, 1 / np.sqrt(8))
    assert pa.target_platform() == "cpu"


def test_variant_argument_is_checked():
    pa = _pa()
    q, k, v = base._random_qkv(1, 32, 32, 1, 8, 8, 9)
    layout = la_layouts.band_layout(32, 32, 16, 16, 4, 4)
    with pytest.raises(ValueError, match="variant"):
        pa.block_sparse_attention(q, k, v, layout, variant="tpu")


# ------------------------------------------------------ lowered for a TPU
N, D, BLOCK = 2048, 128, 128


def _band_loss():
    import jax.numpy as jnp

    pa = _pa()
    pattern = la_patterns.LocalPattern(2 * BLOCK - 1, 0)
    layout = la_layouts.band_layout(N, N, BLOCK, BLOCK, 2 * BLOCK - 1, 0)

    def loss(q, k, v):
        out, lse = pa.block_sparse_attention(q, k, v, layout, predicate=pattern)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    return loss


def test_lowers_for_tpu_with_block_tiles():
    """Forward and gradient, bfloat16, n = 2048, d = 128, blocks of 128,
    lower through Mosaic (three TPU kernels); every block of every kernel
    is one ``(128, 128)`` tile (``(8, 128)`` for key positions), on a grid
    that walks the 3 entries of each layout row."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas import core as pallas_core

    pa = _pa()
    x = jax.ShapeDtypeStruct((1, N, 2, D), jnp.bfloat16)
    with pa.building_for("tpu"):
        traced = jax.jit(jax.value_and_grad(_band_loss(), argnums=(0, 1, 2))).trace(x, x, x)
        text = traced.lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3
    calls = _pallas_calls(traced.jaxpr.jaxpr)
    assert sorted(_call_name(e) for e in calls) == TPU_KERNELS
    for eqn in calls:
        grid = eqn.params["grid_mapping"]
        assert grid.grid == (1, 2, N // BLOCK, 3)
        assert grid.num_index_operands == 1  # the prefetched layout table
        for bm in grid.block_mappings:
            shape = tuple(bm.array_aval.shape)
            block = pallas_core._get_block_shape(bm.block_shape)
            if len(shape) == 4:  # q, k, v, dO, outputs, per-query vectors
                assert shape[2] == N and block == (1, 1, BLOCK, 128), (shape, block)
            else:  # key positions and validity, per key block
                assert shape[2:] == (N // BLOCK, 8, BLOCK), shape
                assert block == (1, 1, 1, 8, BLOCK), (shape, block)


@pytest.mark.skipif(not os.path.isfile(os.environ.get("TPU_LIBRARY_PATH", "")),
                    reason="compiling for a TPU needs libtpu (TPU_LIBRARY_PATH)")
def test_compiles_for_tpu_ahead_of_time():
    """Mosaic compiles the three kernels for a TPU v5e (ahead of time, on
    the CPU, with the libtpu that ``TPU_LIBRARY_PATH`` names)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    pa = _pa()
    device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
    x = jax.ShapeDtypeStruct((1, N, 2, D), jnp.bfloat16,
                             sharding=jax.sharding.SingleDeviceSharding(device))
    with pa.building_for("tpu"):
        lowered = jax.jit(jax.value_and_grad(_band_loss(), argnums=(0, 1, 2))).trace(
            x, x, x).lower()
        assert lowered.as_text().count("tpu_custom_call") == 3
        lowered.compile()


# ------------------------------------------------------------------ layers
LAYER_CASES = [
    (LocalAttention, {"window": 9}, 70, True),
    (SparseAttention, {"pattern": "strided", "block_length": 7}, 60, True),
    (BigBirdAttention, {"block_size": 16, "window_blocks": 3, "global_blocks": 1,
                        "random_blocks": 1, "seed": 3}, 100, True),
    (LongformerAttention, {"window": 6, "dilation": (1, 2), "max_global": 3}, 50, True),
    (RoutingAttention, {"num_clusters": 4, "local_heads": 1, "causal_routing": "balanced"},
     60, True),
]


@pytest.mark.parametrize(
    "layer_cls, kwargs, n, causal", LAYER_CASES,
    ids=[c.__name__ for c, _, _, _ in LAYER_CASES],
)
def test_layer_pallas_on_tpu_kernels_equals_reference(layer_cls, kwargs, n, causal):
    """The layer's ``implementation="pallas"`` equals ``"reference"`` when
    every kernel call is built as for a TPU (the prefetch kernels, counted
    as they are traced): the check of ``test_pallas_attention.py``, with
    padded queries and keys, outputs and input gradients."""
    pa = _pa()
    from keras_longattn.kernels.jax import pallas_tpu

    traced = []
    forward = pallas_tpu.forward

    def counting_forward(*args):
        traced.append(args[0].block_q)
        return forward(*args)

    pa._attention_fn.cache_clear()  # rebuilt with the counting forward
    try:
        with _built_for_tpu(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(pallas_tpu, "forward", counting_forward)
            base.test_layer_pallas_equals_reference(layer_cls, kwargs, n, causal)
    finally:
        pa._attention_fn.cache_clear()
    assert traced, "the TPU kernels did not run"
