"""Kernelized attention (ops/kernelized.py), contiguous segment means
(ops/segments.py) and AdaMRA's landmark counts (ops/adamra.py), against
plain NumPy loops."""

import keras
import numpy as np
import pytest
from keras import ops
from keras.ops import convert_to_numpy as to_np

from keras_longattn import ops as la_ops
from keras_longattn.ops import adamra as adamra_ops
from keras_longattn.ops import kernelized
from keras_longattn.testing import input_gradient
from keras_longattn.testing import rel_error


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _loop(qf, kf, v, mask, eps):
    B, T, H, _ = qf.shape
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            keep = mask[b] if mask.ndim == 2 else mask[b, :, h]
            for t in range(T):
                w = kf[b, keep, h] @ qf[b, t, h]
                out[b, t, h] = (w @ v[b, keep, h]) / max(w.sum(), eps)
    return out


# ----------------------------------------------------------- kernelized
@pytest.mark.parametrize("name", kernelized.FEATURE_MAPS)
@pytest.mark.parametrize("mask_rank", [2, 3])
def test_associative_form_equals_quadratic_form_and_loop(name, mask_rank):
    B, T, S, H, F, dv = 2, 7, 11, 3, 4, 5
    qf = to_np(kernelized.feature_map(_rand(B, T, H, F), name))
    kf = to_np(kernelized.feature_map(_rand(B, S, H, F, seed=1), name))
    v = _rand(B, S, H, dv, seed=2)
    mask = np.random.default_rng(3).random((B, S) if mask_rank == 2 else (B, S, H)) < 0.7
    mask[..., 0] = True
    # Masked keys may hold anything, NaN included.
    kf_bad = np.where(mask[..., None] if mask_rank == 3 else mask[:, :, None, None], kf, np.nan)
    out = to_np(kernelized.kernel_attention(qf, kf_bad, v, key_mask=mask))
    ref, weights = kernelized.kernel_attention_reference(
        qf, kf_bad, v, key_mask=mask, return_weights=True
    )
    loop = _loop(qf, kf, v, mask, kernelized.DEFAULT_EPSILON)
    assert rel_error(out, loop) < 1e-5
    assert rel_error(to_np(ref), loop) < 1e-5
    sums = to_np(weights).sum(-1)  # 1, or 0 for a query with no positive feature
    assert np.all((np.abs(sums - 1) < 1e-5) | (sums == 0))
    if name == "elu+1":
        np.testing.assert_allclose(sums, 1.0, rtol=1e-5)


def test_feature_maps():
    x = np.array([-2.0, 0.0, 3.0], "float32")
    np.testing.assert_allclose(to_np(kernelized.feature_map(x, "relu")), [0, 0, 3])
    np.testing.assert_allclose(
        to_np(kernelized.feature_map(x, "elu+1")), [np.exp(-2.0), 1, 4], rtol=1e-6
    )
    with pytest.raises(ValueError, match="feature_map='exp'"):
        kernelized.feature_map(x, "exp")


def test_zero_features_give_zero_output_and_finite_gradients():
    """All-zero query features (ReLU of a negative query): normaliser 0,
    output exactly 0 on both forms, finite gradients."""
    B, T, S, H, F = 1, 3, 5, 2, 4
    q = -np.abs(_rand(B, T, H, F)) - 0.1  # no positive coordinate
    kf = np.abs(_rand(B, S, H, F, seed=1))
    v = _rand(B, S, H, F, seed=2)
    for fn in (kernelized.kernel_attention, kernelized.kernel_attention_reference):
        out = to_np(fn(kernelized.feature_map(q, "relu"), kf, v))
        np.testing.assert_array_equal(out, 0.0)
        g = input_gradient(lambda x, fn=fn: fn(kernelized.feature_map(x, "relu"), kf, v), q)
        assert np.all(np.isfinite(g))
        # Features exactly 0 (not just negative inputs): still finite.
        g0 = input_gradient(lambda x, fn=fn: fn(x, kf, v), np.zeros_like(q))
        assert np.all(np.isfinite(g0))


def test_tiny_normaliser_is_floored_at_epsilon():
    qf = np.full((1, 1, 1, 1), 1e-8, "float32")
    kf = np.ones((1, 2, 1, 1), "float32")
    v = np.full((1, 2, 1, 1), 3.0, "float32")
    out = to_np(kernelized.kernel_attention(qf, kf, v, epsilon=1e-6))
    np.testing.assert_allclose(out, 3.0 * 2e-8 / 1e-6, rtol=1e-5)
    np.testing.assert_allclose(to_np(kernelized.kernel_attention(qf, kf, v, epsilon=1e-9)), 3.0,
                               rtol=1e-5)


def test_low_precision_values_accumulate_in_float32():
    """float16 inputs over many keys: no overflow (sums in float32), the
    result in float16."""
    S = 8192
    qf = np.ones((1, 2, 1, 2), "float16")
    kf = np.full((1, S, 1, 2), 4.0, "float16")
    v = np.full((1, S, 1, 3), 8.0, "float16")
    out = kernelized.kernel_attention(qf, kf, v)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    np.testing.assert_allclose(to_np(out).astype("float32"), 8.0)


# ------------------------------------------------------ segment means
def _segment_loop(x, seg_len, M, mask):
    B, n, H, d = x.shape
    means = np.zeros((B, M, H, d))
    counts = np.zeros((B, M, H))
    for b in range(B):
        real = np.flatnonzero(mask[b])
        for h in range(H):
            ell = seg_len[b, h]
            for j in range(M):
                members = real[j * ell : (j + 1) * ell]
                counts[b, j, h] = len(members)
                if len(members):
                    means[b, j, h] = x[b, members, h].mean(0)
    return means, counts


@pytest.mark.parametrize("padding", ["none", "right", "left", "middle", "all"])
def test_contiguous_segment_means_equal_loop_and_matrix(padding):
    B, n, H, d, M = 2, 23, 3, 4, 9
    x = _rand(B, n, H, d)
    mask = np.ones((B, n), bool)
    if padding == "right":
        mask[0, 15:] = False
    elif padding == "left":
        mask[1, :6] = False
    elif padding == "middle":
        mask[0, 8:14] = False
    elif padding == "all":
        mask[1] = False
    seg_len = np.array([[3, 5, 1], [2, 4, 7]], "int32")
    x_bad = np.where(mask[:, :, None, None], x, np.nan).astype("float32")
    means, counts = la_ops.contiguous_segment_means(x_bad, seg_len, M, mask=mask)
    loop_means, loop_counts = _segment_loop(x, seg_len, M, mask)
    np.testing.assert_array_equal(to_np(counts), loop_counts)
    np.testing.assert_allclose(to_np(means), loop_means, rtol=1e-5, atol=1e-6)
    matrix, mcounts = la_ops.contiguous_segment_matrix(seg_len, M, n, mask=mask)
    np.testing.assert_array_equal(to_np(mcounts), loop_counts)
    dense = np.einsum("bmhn,bnhd->bmhd", to_np(matrix), x)
    np.testing.assert_allclose(dense, loop_means, rtol=1e-5, atol=1e-6)


def test_segment_means_without_mask_and_per_query_matrix():
    x = _rand(1, 10, 1, 2)
    means, counts = la_ops.contiguous_segment_means(x, np.array([[4]], "int32"), 3)
    np.testing.assert_array_equal(to_np(counts)[0, :, 0], [4, 4, 2])
    np.testing.assert_allclose(to_np(means)[0, 2, 0], x[0, 8:, 0].mean(0), rtol=1e-6)
    # One segmentation per query row (lead = (B, T)).
    rows = np.ones((1, 2, 10), bool)
    rows[0, 1, :5] = False
    matrix, counts = la_ops.contiguous_segment_matrix(np.array([[[4], [2]]], "int32"), 3, 10,
                                                      mask=rows)
    np.testing.assert_array_equal(to_np(counts)[0, :, :, 0], [[4, 4, 2], [2, 2, 1]])
    np.testing.assert_allclose(to_np(matrix)[0, 1, 0, 0, 5:7], [0.5, 0.5])


def test_segment_means_gradient():
    x = _rand(2, 9, 2, 3)
    seg_len = np.array([[2, 3], [4, 1]], "int32")
    g = input_gradient(lambda v: la_ops.contiguous_segment_means(v, seg_len, 5)[0], x)
    # d(sum of means)/dx = 1 / (size of the token's segment), 0 if dropped.
    assert g[0, 0, 0, 0] == pytest.approx(0.5)
    assert g[0, 8, 1, 0] == pytest.approx(1.0 / 3)
    assert g[1, 8, 0, 0] == pytest.approx(1.0)
    assert g[1, 6, 1, 0] == 0.0  # rank 6 // 1 = segment 6 >= 5 slots


# --------------------------------------------------------- landmarks
@pytest.mark.parametrize(
    "rate, n, expected",
    [(1 / 3, 36, 12), (1 / 3, 37, 13), (0.5, 1, 1), (1 / 128, 4096, 32), (1.0, 7, 7),
     (0.3, 10, 3), (1 / 64, 1_000_003, 15626), (0.001, 5, 1)],
)
def test_num_landmarks_is_exact(rate, n, expected):
    assert adamra_ops.num_landmarks(n, rate) == expected
    assert int(to_np(adamra_ops.num_landmarks(ops.convert_to_tensor(n, "int32"), rate))) == expected


def test_segment_lengths():
    lengths = np.array([37, 4, 0], "int32")
    seg = to_np(adamra_ops.segment_lengths(lengths, (1 / 2, 1 / 3, 1.0)))
    np.testing.assert_array_equal(seg, [[2, 3, 1], [2, 2, 1], [1, 1, 1]])
