"""Block layouts (``keras_longattn.ops.layouts``) and the refusals of the
backend paths (``keras_longattn.ops.paths``), on every backend."""

import keras
import numpy as np
import pytest

from keras_longattn.ops import block_sparse
from keras_longattn.ops import layouts
from keras_longattn.ops import paths


def _random_mask(L, nq, nk, seed):
    mask = np.random.default_rng(seed).random((L, nq, nk)) < 0.4
    mask[0, 1] = False  # a query block that visits nothing
    return mask


@pytest.mark.parametrize("L", [1, 3])
def test_layout_from_a_tensor_mask_lists_the_visited_blocks(L):
    """The ``keras.ops`` tables list each row's visited blocks in
    increasing order, pad with the last one, and transpose exactly."""
    mask = _random_mask(L, 5, 7, seed=L)
    layout = layouts.BlockLayout.from_block_mask(keras.ops.convert_to_tensor(mask), 16, 32)
    rows = keras.ops.convert_to_numpy(layout.rows)
    cols = keras.ops.convert_to_numpy(layout.cols)
    assert rows.dtype == np.int32 and cols.dtype == np.int32
    assert rows.shape == (L, 5, 8) and cols.shape == (L, 7, 8)
    np.testing.assert_array_equal(layout.block_mask(), mask)
    for e in range(L):
        for i in range(5):
            visited = np.flatnonzero(mask[e, i])
            assert rows[e, i, 0] == visited.size
            np.testing.assert_array_equal(rows[e, i, 1:1 + visited.size], visited)
            if visited.size:
                assert np.all(rows[e, i, 1 + visited.size:] == visited[-1])
        for j in range(7):
            np.testing.assert_array_equal(cols[e, j, 1:1 + cols[e, j, 0]],
                                          np.flatnonzero(mask[e, :, j]))


def test_static_and_tensor_layouts_agree():
    mask = _random_mask(1, 6, 6, seed=4)
    static = layouts.BlockLayout.from_block_mask(mask, 16, 16)
    traced = layouts.BlockLayout.from_block_mask(keras.ops.convert_to_tensor(mask), 16, 16)
    np.testing.assert_array_equal(static.block_mask(), traced.block_mask())
    assert isinstance(static.rows, np.ndarray)


def test_band_layout_covers_the_band():
    layout = layouts.band_layout(64, 64, 16, 16, 5, 2)
    want = np.zeros((4, 4), bool)
    for i in range(64):
        for j in range(max(0, i - 5), min(64, i + 3)):
            want[i // 16, j // 16] = True
    np.testing.assert_array_equal(layout.block_mask()[0], want)


def test_default_block_is_a_power_of_two_in_range():
    for n in (1, 17, 100, 1000, 10**6):
        b = layouts.default_block(n)
        assert layouts.MIN_BLOCK <= b <= layouts.MAX_BLOCK and b & (b - 1) == 0
    assert layouts.next_power_of_2(0) == 1 and layouts.next_power_of_2(17) == 32


def test_arrangement_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="`kind` must be"):
        layouts.arrangement("diagonal", 8, 8, 4, None, False, 16)


def test_paths_refuse_by_backend():
    on_jax = keras.backend.backend() == "jax"
    reason = paths.refusal("block_sparse")
    assert (reason is None) == on_jax
    assert block_sparse.refusal() == reason
    if not on_jax:
        assert "needs the JAX backend" in reason
    on_torch = keras.backend.backend() == "torch"
    assert (paths.refusal("routing") is None) == on_torch
    assert (paths.refusal("lsh") is None) == on_torch
    with pytest.raises(ValueError, match="`path` must be one of"):
        paths.refusal("fast")


# ------------------------------------------------------- candidate tiles
def _tiles_with_an_allowed_pair(pattern, q_positions, k_positions, block):
    q = np.asarray(q_positions)[:, None]
    k = np.asarray(k_positions)[None, :]
    allowed = np.asarray(keras.ops.convert_to_numpy(pattern.allowed(
        keras.ops.convert_to_tensor(q, "int32"), keras.ops.convert_to_tensor(k, "int32"))))
    allowed = np.broadcast_to(allowed, (q.shape[0], k.shape[1])) & (q >= 0) & (k >= 0)
    return {(i // block, j // block) for i, j in zip(*np.nonzero(allowed))}


def _candidate_patterns():
    from keras_longattn.ops import patterns as p
    from keras_longattn.ops import sparse as s

    causal = p.CausalPattern()
    return {
        "local": p.LocalPattern(5, 0),
        "local-both": p.LocalPattern(3, 7),
        "causal": causal,
        "full": p.FullPattern(),
        "dilated": p.DilatedPattern(3, 2, 3),
        "strided": s.StridedPattern(4) & causal,
        "blocks": s.BlockPattern(6) & causal,
        "summary": s.SummaryPattern(6, 2) & causal,
        "strided-minus-band": p.Difference(s.StridedPattern(4) & causal, p.LocalPattern(4, 0)),
        "global": p.GlobalPattern([0, 5]) & causal,
        "band-or-global": p.Union(p.LocalPattern(2, 2), p.GlobalPattern([3])),
    }


@pytest.mark.parametrize("name", sorted(_candidate_patterns()))
@pytest.mark.parametrize("arrangement", ["in order", "columns of 4", "columns of 3", "padded"])
def test_candidate_tiles_hold_every_allowed_pair(name, arrangement):
    """A pattern's candidate tiles (listed from its segments, without
    evaluating it on every pair) include every tile that holds an allowed
    pair, in order and in the arrangements the block-sparse paths use."""
    pattern = _candidate_patterns()[name]
    for T, S, block in [(37, 37, 8), (50, 29, 4), (16, 40, 16)]:
        if arrangement == "in order":
            q, k = np.arange(T), np.arange(S)
        elif arrangement == "padded":  # slots that hold no token: -1
            q = np.concatenate([np.arange(T), [-1] * 5])
            k = np.concatenate([[-1] * 3, np.arange(S)])
        else:
            stride = int(arrangement.split()[-1])
            q, k = layouts._column_order(T, stride), layouts._column_order(S, stride)
        qb, kb = pattern.candidate_tiles(q, k, block)
        listed = set(zip(qb.tolist(), kb.tolist()))
        missing = _tiles_with_an_allowed_pair(pattern, q, k, block) - listed
        assert not missing, (name, arrangement, T, S, block, sorted(missing)[:5])


def test_candidate_tiles_grow_with_the_tokens_not_their_square():
    """The band in order and the strided columns (by column) list a number
    of tiles linear in n: the work of a block mask stays O(n * w)."""
    from keras_longattn.ops import patterns as p
    from keras_longattn.ops import sparse as s

    block, n = 128, 1 << 16
    counts = {}
    for name, pattern, order in [
        ("band", p.LocalPattern(256, 0), np.arange(n)),
        ("columns", s.StridedPattern(256) & p.CausalPattern(), layouts._column_order(n, 256)),
    ]:
        qb, _ = pattern.candidate_tiles(order, order, block)
        counts[name] = qb.size
    assert counts["band"] <= 3 * (n // block)
    assert counts["columns"] <= 3 * (n // block)
    # Without segments every tile is listed (the base class's superset).
    qb, _ = layouts.every_tile(n // 64, n // 64, block)
    assert qb.size == (n // 64 // block) ** 2
