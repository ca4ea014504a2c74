"""Tiles that need no element mask: ``AttentionPattern.tile_all_allowed``
against every pair of the tile, and the Pallas kernel skipping the mask of
such tiles (``Tiling.skip_full_tiles``) against dense attention, with
query rows past the sequence's end and padded keys. A pattern that claims
too much is caught."""

import keras
import numpy as np
import pytest

from keras_longattn.ops import layouts as la_layouts
from keras_longattn.ops import patterns as la_patterns
from tests.kernels.test_pallas_attention import _compare
from tests.kernels.test_pallas_attention import _random_qkv

ON_JAX = keras.backend.backend() == "jax"
jax_only = pytest.mark.skipif(not ON_JAX, reason="the Pallas kernel is JAX only")

PATTERNS = [
    la_patterns.FullPattern(),
    la_patterns.CausalPattern(),
    la_patterns.LocalPattern(7, 0),
    la_patterns.LocalPattern(5, 3),
    la_patterns.DilatedPattern(6, 2, dilation=1),
    la_patterns.LocalPattern(9, 9) & la_patterns.CausalPattern(),
]


@pytest.mark.parametrize("pattern", PATTERNS, ids=repr)
def test_tile_all_allowed_is_every_pair_of_the_tile(pattern):
    rng = np.random.default_rng(0)
    answered_true = answered_false = 0
    for _ in range(120):
        q0, k0 = rng.integers(0, 40, size=2)
        tq, tk = rng.integers(1, 9, size=2)
        got = pattern.tile_all_allowed(q0, q0 + tq - 1, k0, k0 + tk - 1)
        q = np.arange(q0, q0 + tq)[:, None]
        k = np.arange(k0, k0 + tk)[None, :]
        want = bool(np.all(keras.ops.convert_to_numpy(pattern.allowed(q, k))))
        assert bool(got) == want, (q0, tq, k0, tk)
        answered_true += want
        answered_false += not want
    assert answered_true and (answered_false or isinstance(pattern, la_patterns.FullPattern))


def test_patterns_that_cannot_tell_answer_none():
    assert la_patterns.DilatedPattern(4, 0, dilation=2).tile_all_allowed(0, 3, 0, 3) is None
    assert la_patterns.GlobalPattern([0]).tile_all_allowed(0, 3, 0, 3) is None
    mixed = la_patterns.LocalPattern(4, 0) & la_patterns.GlobalPattern([0])
    assert mixed.tile_all_allowed(0, 3, 0, 3) is None


class _ClaimsTooMuch(la_patterns.LocalPattern):
    """A band whose tiles all claim to be full (a planted bug)."""

    def tile_all_allowed(self, q_first, q_last, k_first, k_last):
        return k_first >= 0


def _band_case(pattern, skip, valid_keys):
    import jax.numpy as jnp

    from keras_longattn.kernels.jax import pallas_attention as pa

    # 100 tokens: query blocks of 16 run 12 rows past the end; a window of
    # 40 makes most band tiles full.
    B, n, H, d, b = 2, 100, 2, 8, 16
    q, k, v = _random_qkv(B, n, n, H, d, d, 3)
    look_back, look_ahead = pattern.look_back, pattern.look_ahead
    valid = np.ones((B, n), bool)
    if valid_keys:
        valid[1, 50:53] = False
    mask = np.asarray(la_patterns.LocalPattern(look_back, look_ahead).dense_mask(n, n))
    mask = mask[None, None] & valid[:, None, None, :]
    layout = la_layouts.band_layout(n, n, b, b, look_back, look_ahead)
    tiling = pa.Tiling(q_split=2, bwd_k_split=2, skip_full_tiles=skip)

    def kernel(q, k, v):
        return pa.block_sparse_attention(q, k, v, layout, predicate=pattern,
                                         k_valid=jnp.asarray(valid), tiling=tiling)

    return kernel, (q, k, v, mask, 1 / np.sqrt(d))


@jax_only
@pytest.mark.parametrize("look_ahead", [0, 24])
@pytest.mark.parametrize("skip", [True, False])
def test_skipping_full_tiles_equals_dense(skip, look_ahead):
    kernel, args = _band_case(la_patterns.LocalPattern(40, look_ahead), skip, True)
    _compare(kernel, *args)


@jax_only
def test_a_pattern_claiming_full_tiles_wrongly_is_caught():
    kernel, args = _band_case(_ClaimsTooMuch(40, 0), True, False)
    with pytest.raises(AssertionError, match="relative error"):
        _compare(kernel, *args)
    # The same pattern with the skip off is right: the claim is what broke.
    kernel, args = _band_case(_ClaimsTooMuch(40, 0), False, False)
    _compare(kernel, *args)


@jax_only
def test_the_kernel_branches_only_where_a_tile_can_be_full():
    import jax

    from keras_longattn.kernels.jax import pallas_attention as pa

    q, k, v = _random_qkv(1, 64, 64, 1, 8, 8, 0)
    layout = la_layouts.band_layout(64, 64, 16, 16, 20, 0)

    def program(pattern, **kw):
        fn = lambda q, k, v: pa.block_sparse_attention(q, k, v, layout, predicate=pattern,
                                                       **kw)[0]
        return str(jax.make_jaxpr(fn)(q, k, v))

    assert "cond[" in program(la_patterns.LocalPattern(20, 0))
    assert "cond[" not in program(la_patterns.LocalPattern(20, 0),
                                  tiling=pa.Tiling(skip_full_tiles=False))
    # Tokens at other positions than their indices: tiles are always masked.
    assert "cond[" not in program(la_patterns.LocalPattern(20, 0), q_pos=np.arange(64))
    assert "cond[" not in program(la_patterns.DilatedPattern(10, 0, dilation=2))


@jax_only
def test_skip_full_tiles_is_checked():
    from keras_longattn.kernels.jax import pallas_attention as pa

    with pytest.raises(ValueError, match="skip_full_tiles"):
        pa.Tiling(skip_full_tiles=1)
