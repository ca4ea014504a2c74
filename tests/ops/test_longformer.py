"""ops of Longformer: the dilated band against dense attention under
DilatedPattern, key subsets at per-example positions, the global slots and
the argument checks."""

import numpy as np
import pytest
from keras import ops
from keras.ops import convert_to_numpy as to_np

from keras_longattn import ops as la_ops
from keras_longattn.ops import longformer as lf
from keras_longattn.testing import rel_error


def _qkv(B=2, T=29, H=2, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, T, H, d)).astype("float32") for _ in range(3)]


@pytest.mark.parametrize(
    "look_back, look_ahead, dilation, block_size",
    [
        (3, 3, 2, None),
        (4, 0, 3, None),
        pytest.param(2, 2, 1, 3, marks=pytest.mark.grid),
        pytest.param(5, 1, 4, 2, marks=pytest.mark.grid),
        pytest.param(3, 3, 40, None, marks=pytest.mark.grid),  # dilation > length
    ],
)
def test_dilated_band_equals_dense(look_back, look_ahead, dilation, block_size):
    q, k, v = _qkv()
    key_mask = np.ones((2, 29), bool)
    key_mask[0, 20:] = False
    key_mask[1, [0, 3, 7]] = False
    out, lse = la_ops.dilated_band_attention(
        q, k, v, look_back, look_ahead, dilation, block_size=block_size,
        key_mask=key_mask,
    )
    pattern = la_ops.DilatedPattern(look_back, look_ahead, dilation)
    mask = np.logical_and(to_np(pattern.dense_mask(29, 29))[None], key_mask[:, None, :])
    expected = to_np(la_ops.reference_attention(q, k, v, mask=mask))
    assert rel_error(to_np(out), expected) < 1e-5
    # The log-sum-exp of the visible logits.
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / 2.0
    logits = np.where(mask[:, None], logits, -np.inf)
    top = np.max(logits, axis=-1, keepdims=True)
    seen = np.isfinite(top[..., 0])
    top = np.where(np.isfinite(top), top, 0.0)  # rows that see no key
    with np.errstate(divide="ignore"):  # log(0) on rows that see no key
        expected_lse = top[..., 0] + np.log(np.sum(np.exp(logits - top), axis=-1))
    expected_lse = np.transpose(expected_lse, (0, 2, 1))
    lse = to_np(lse)
    np.testing.assert_allclose(lse[np.transpose(seen, (0, 2, 1))],
                               expected_lse[np.transpose(seen, (0, 2, 1))], rtol=1e-5, atol=1e-5)


def test_key_subset_at_per_example_positions():
    """Key positions ``(B, K)``: the pattern is evaluated per example."""
    q, k, v = _qkv()
    positions = np.array([[2, 9, 0], [5, 6, 28]], "int32")
    valid = np.array([[True, True, False], [True, True, True]])
    keys = np.stack([k[b, positions[b]] for b in range(2)])
    values = np.stack([v[b, positions[b]] for b in range(2)])
    out, _ = la_ops.key_subset_attention(
        q, keys, values, ops.convert_to_tensor(positions), valid, la_ops.CausalPattern()
    )
    mask = np.zeros((2, 29, 29), bool)
    for b in range(2):
        for slot, p in enumerate(positions[b]):
            if valid[b, slot]:
                mask[b, :, p] = True
    mask &= np.tril(np.ones((29, 29), bool))[None]
    expected = to_np(la_ops.reference_attention(q, k, v, mask=mask))
    assert rel_error(to_np(out), expected) < 1e-5


def test_global_slots_keep_the_first_positions():
    mask = np.zeros((2, 10), bool)
    mask[0, [7, 2, 4]] = True
    mask[1, 9] = True
    slots = lf.global_slots(10, 10, mask, max_global=2)
    np.testing.assert_array_equal(to_np(slots.positions), [[2, 4], [9, 0]])
    np.testing.assert_array_equal(to_np(slots.query_valid), [[True, True], [True, False]])
    first = lf.global_slots(6, 4, global_tokens=5)
    np.testing.assert_array_equal(to_np(first.query_valid), [[True] * 5])
    np.testing.assert_array_equal(to_np(first.key_valid), [[True] * 4 + [False]])
    assert lf.global_slots(6, 6) is None


def test_argument_checks_name_the_argument():
    assert lf.check_dilation(2, 3) == (2, 2, 2)
    assert lf.check_dilation([1, 2], 2) == (1, 2)
    assert lf.window_extents(6, causal=False) == (3, 3)
    assert lf.window_extents(6, causal=True) == (6, 0)
    for bad in (0, 3, -2, True, "4"):
        with pytest.raises(ValueError, match="window="):
            lf.check_window(bad)
    for bad in (0, [1], [1, 2, 3], [1, 0], "2", 1.5):
        with pytest.raises(ValueError, match="dilation="):
            lf.check_dilation(bad, 2)
    with pytest.raises(ValueError, match="dilation=0"):
        la_ops.DilatedPattern(1, 1, 0)
