"""Routing ops: normalisation, assignment, gather/scatter, statistics and
the two cluster-attention kernels, checked against NumPy and against their
dense counterparts."""

import keras
import numpy as np
import pytest
from keras import ops
from keras.ops import convert_to_numpy as to_np

from keras_longattn.ops import reference_attention
from keras_longattn.ops import chunked as CH
from keras_longattn.ops import kmeans as KM
from keras_longattn.ops import patterns as P
from keras_longattn.ops import routing as R
from keras_longattn.ops import segments as SG
from keras_longattn.testing import rel_error
from keras_longattn.testing import sorted_chunk_mask_loop


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def test_sphere_normalize_is_centered_unit_length_layer_norm():
    x = _rand(3, 5, 2, 8)
    x[0, 0, 0] = 0.0  # a zero (padding) vector stays zero
    y = to_np(KM.sphere_normalize(x))
    c = x - x.mean(-1, keepdims=True)
    expected = c / np.sqrt(c.var(-1, keepdims=True) + 1e-6) / np.sqrt(8)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    norms = np.linalg.norm(y, axis=-1)
    np.testing.assert_allclose(norms[norms > 0.5], 1.0, rtol=1e-4)
    assert np.all(y[0, 0, 0] == 0.0)
    assert to_np(KM.sphere_normalize(x.astype("float16"))).dtype == np.float32


def test_similarity_and_nearest_centroid():
    x_hat = to_np(KM.sphere_normalize(_rand(2, 9, 3, 4)))
    mu = _rand(3, 5, 4, seed=1)
    sim = to_np(KM.centroid_similarity(x_hat, mu))
    mu_hat = mu / np.linalg.norm(mu, axis=-1, keepdims=True)
    expected = np.einsum("bnhd,hkd->bhkn", x_hat, mu_hat)
    np.testing.assert_allclose(sim, expected, rtol=1e-5, atol=1e-6)
    valid = np.ones((2, 9), bool)
    valid[1, 6:] = False
    near = to_np(KM.nearest_centroid(sim, valid))
    np.testing.assert_array_equal(near[0], expected[0].argmax(1))
    np.testing.assert_array_equal(near[1, :, :6], expected[1, :, :, :6].argmax(1))
    assert np.all(near[1, :, 6:] == 5)  # padding: no cluster


@pytest.mark.parametrize("limit", [1, 2 * 9 * 5 * 2, 10**9])
def test_assignments_in_head_slices_equal_one_similarity(limit, monkeypatch):
    """Routing's nearest centroids and balanced members, taken a few heads
    at a time (one, two, or all three heads per slice), equal those of the
    whole similarity, padding included."""
    monkeypatch.setattr(KM, "MAX_SIMILARITY_ELEMENTS", limit)
    x_hat = KM.sphere_normalize(_rand(2, 9, 3, 4))
    mu = _rand(3, 5, 4, seed=1)
    valid = np.ones((2, 9), bool)
    valid[1, 6:] = False
    whole = KM.nearest_centroid(KM.centroid_similarity(x_hat, mu, clusters_last=True), valid,
                                clusters_last=True)
    sliced, _ = KM.assign_by_heads(x_hat, mu, valid)
    assert tuple(sliced.shape) == (2, 3, 9)
    np.testing.assert_array_equal(to_np(sliced), to_np(whole))
    assert np.all(to_np(sliced)[1, :, 6:] == 5)
    # The balanced top-w members likewise.
    members_whole = KM.balanced_assignment(
        KM.centroid_similarity(x_hat, mu, clusters_last=True), 4, valid, clusters_last=True)
    near, members = KM.assign_by_heads(x_hat, mu, valid, nearest=False, window=4)
    assert near is None and tuple(members.shape) == (2, 3, 5, 4)
    np.testing.assert_array_equal(to_np(members), to_np(members_whole))


def test_balanced_assignment_is_sorted_top_w_and_ranks_padding_last():
    sim = np.random.default_rng(0).uniform(-1, 1, (2, 3, 4, 11)).astype("float32")
    valid = np.ones((2, 11), bool)
    valid[0, :4] = False
    idx = to_np(KM.balanced_assignment(sim, 5, valid))
    assert idx.shape == (2, 3, 4, 5)
    assert np.all(np.diff(idx, axis=-1) > 0)
    masked = np.where(valid[:, None, None, :], sim, -np.inf)
    for b in range(2):
        for h in range(3):
            for c in range(4):
                top = np.sort(np.argsort(-masked[b, h, c], kind="stable")[:5])
                np.testing.assert_array_equal(idx[b, h, c], top)
    # More members than real tokens: the real ones come first.
    idx = to_np(KM.balanced_assignment(sim, 9, valid))
    assert set(range(4, 11)) <= set(idx[0, 0, 0].tolist())
    with pytest.raises(ValueError, match="window=12"):
        KM.balanced_assignment(sim, 12)


def test_gather_tokens_and_scatter_mean():
    x = _rand(2, 7, 3, 4)  # (B, n, H, d): the token layout
    idx = np.random.default_rng(0).integers(0, 7, (2, 3, 4, 5)).astype("int32")
    g = to_np(SG.gather_tokens(x, idx))  # (B, H, 4, 5, d)
    for b in range(2):
        for h in range(3):
            np.testing.assert_array_equal(g[b, h], x[b, :, h][idx[b, h]])
    mean, counts = SG.scatter_mean(g, idx, 7, return_counts=True)
    mean, counts = to_np(mean), to_np(counts)  # (B, n, H, d), (B, H, n)
    for b in range(2):
        for h in range(3):
            for i in range(7):
                hits = idx[b, h] == i
                assert counts[b, h, i] == hits.sum()
                expected = g[b, h][hits].mean(axis=0) if hits.any() else np.zeros(4)
                np.testing.assert_allclose(mean[b, i, h], expected, rtol=1e-5, atol=1e-6)


def test_cluster_statistics_and_ema_update():
    x_hat = _rand(2, 6, 2, 3)
    assign = np.random.default_rng(0).integers(0, 3, (2, 2, 6)).astype("int32")
    assign[0, :, 0] = 4  # padding (k = 4 clusters below, sentinel 4)
    assign[..., :] = np.where(assign == 3, 2, assign)  # cluster 3 stays empty
    sums, counts = KM.cluster_statistics(x_hat, assign, 4)
    sums, counts = to_np(sums), to_np(counts)
    for h in range(2):
        for c in range(4):
            sel = assign[:, h, :] == c  # (B, n)
            assert counts[h, c] == sel.sum()
            np.testing.assert_allclose(
                sums[h, c], x_hat[:, :, h][sel].sum(0), rtol=1e-5, atol=1e-6
            )
    mu = _rand(2, 4, 3, seed=3)
    new = to_np(KM.ema_update(mu, sums, counts, 0.9))
    np.testing.assert_array_equal(new[:, 3], mu[:, 3])  # empty: unchanged
    means = sums / np.maximum(counts, 1)[..., None]
    np.testing.assert_allclose(new[:, :3], 0.9 * mu[:, :3] + 0.1 * means[:, :3], rtol=1e-5)


@pytest.mark.parametrize("causal, exclude_self", [(False, False), (True, True)])
def test_balanced_attention_equals_dense_weights(causal, exclude_self):
    B, T, H, d, k, w = 2, 13, 2, 4, 3, 5
    q, kk, v = _rand(B, T, H, d, seed=1), _rand(B, T, H, d, seed=2), _rand(B, T, H, 3, seed=3)
    sim = np.random.default_rng(4).uniform(-1, 1, (B, H, k, T)).astype("float32")
    key_mask = np.ones((B, T), bool)
    key_mask[1, 9:] = False
    qi = KM.balanced_assignment(sim, w)
    ki = KM.balanced_assignment(sim[..., ::-1].copy(), w, key_mask)
    out = to_np(R.balanced_cluster_attention(
        q, kk, v, qi, ki, causal=causal, key_mask=key_mask, exclude_self=exclude_self))
    weights = to_np(R.balanced_cluster_weights(
        q, kk, qi, ki, causal=causal, key_mask=key_mask, exclude_self=exclude_self))
    expected = np.einsum("bhts,bshd->bthd", weights, v)
    assert rel_error(out, expected) < 1e-5
    # Queries in no cluster get zeros; rows of covered queries sum to 1 or 0.
    covered = to_np(R.membership(qi, T)).any(axis=2)  # (B, H, T)
    assert np.all(out.transpose(0, 2, 1, 3)[~covered] == 0.0)
    sums = weights.sum(-1)
    assert np.all((np.abs(sums - 1) < 1e-5) | (sums == 0))


@pytest.mark.parametrize("shared", [False, True])
def test_clustered_window_mask_matches_brute_force(shared):
    rng = np.random.default_rng(0)
    B, H, T, k, w = 2, 2, 17, 3, 3
    cq = rng.integers(0, k + 1, (B, H, T)).astype("int32")  # k = padding
    ck = cq if shared else rng.integers(0, k + 1, (B, H, T)).astype("int32")
    mask = to_np(CH.sorted_chunk_mask(cq, ck, k, w, shared=shared))
    for b in range(B):
        for h in range(H):
            np.testing.assert_array_equal(
                mask[b, h], sorted_chunk_mask_loop(cq[b, h], ck[b, h], k, w, shared)
            )


_WINDOW_CASES = [  # (shared, w, fused, slices); the diagonal runs everywhere
    pytest.param(shared, w, fused, slices,
                 marks=() if i == j else pytest.mark.grid)
    for i, (shared, w) in enumerate([(False, 1), (True, 4), (False, 64)])
    for j, (fused, slices) in enumerate([(False, None), (True, None), (True, 3)])
]


@pytest.mark.parametrize("shared, w, fused, slices", _WINDOW_CASES)
def test_clustered_window_attention_equals_dense_mask(shared, w, fused, slices, monkeypatch):
    """Einsum and fused chunk paths (the fused one also cut into slices of
    3 chunks per attention call, as torch does for long inputs)."""
    if slices is not None:
        monkeypatch.setattr(CH, "_chunks_per_call", lambda items, wq, wk: slices)
    rng = np.random.default_rng(w)
    B, T, H, d, k = 2, 23, 2, 4, 4
    q = _rand(B, T, H, d, seed=1)
    kk = q if shared else _rand(B, T, H, d, seed=2)
    v = _rand(B, T, H, 3, seed=3)
    cq = rng.integers(0, k, (B, H, T)).astype("int32")
    cq[1, :, :5] = k  # padded tokens
    ck = cq if shared else rng.integers(0, k + 1, (B, H, T)).astype("int32")
    attention = CH.sorted_chunk_attention.uncompiled  # monkeypatch-safe on JAX
    out = to_np(attention(q, kk, v, cq, ck, k, w, shared=shared, fused=fused))
    mask = CH.sorted_chunk_mask(cq, ck, k, w, shared=shared)
    if shared:
        eye = np.eye(T, dtype=bool)[None, None]
        mask = P.exclude_self_unless_alone(mask, eye)
    expected = to_np(reference_attention(q, kk, v, mask=mask))
    assert rel_error(out, expected) < 1e-5
    assert np.all(out[1, :5] == 0.0)  # padded queries: zeros


@pytest.mark.parametrize("fused", [False, True])
def test_clustered_window_attention_with_every_token_padded(fused):
    """No query has a slot: zeros, not NaN (the torch path then has no chunk
    left to run)."""
    q = _rand(1, 9, 2, 4)
    pad = np.full((1, 2, 9), 3, "int32")  # k = 3 marks padding
    out = to_np(CH.sorted_chunk_attention(q, q, q, pad, pad, 3, 4, fused=fused))
    assert out.shape == (1, 9, 2, 4) and np.all(out == 0.0)


def test_clustered_window_attention_is_causal_by_construction():
    """Which keys a query sees never depends on later tokens' clusters."""
    rng = np.random.default_rng(0)
    T, k, w = 20, 3, 3
    cq = rng.integers(0, k, (1, 1, T)).astype("int32")
    ck = rng.integers(0, k, (1, 1, T)).astype("int32")
    mask = to_np(CH.sorted_chunk_mask(cq, ck, k, w))
    for t in range(T - 1):
        cq2, ck2 = cq.copy(), ck.copy()
        cq2[..., t + 1:] = rng.integers(0, k, T - t - 1)
        ck2[..., t + 1:] = rng.integers(0, k, T - t - 1)
        mask2 = to_np(CH.sorted_chunk_mask(cq2, ck2, k, w))
        np.testing.assert_array_equal(mask2[..., : t + 1, :], mask[..., : t + 1, :])


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jaxpr inspection")
def test_no_intermediate_of_size_n_squared():
    import jax

    B, n, H, d, k = 1, 1024, 1, 8, 32
    w = n // k
    q, kk, v = _rand(B, n, H, d), _rand(B, n, H, d, seed=1), _rand(B, n, H, d, seed=2)
    cq = np.random.default_rng(0).integers(0, k, (B, H, n)).astype("int32")
    sim = np.random.default_rng(1).uniform(-1, 1, (B, H, k, n)).astype("float32")

    def balanced(q, kk, v, sim):
        idx = KM.balanced_assignment(sim, w)
        return R.balanced_cluster_attention(q, kk, v, idx, idx, causal=True)

    def token(q, kk, v, cq):
        return CH.sorted_chunk_attention(q, kk, v, cq, cq, k, w)

    def sizes(jaxpr):
        # Every intermediate, nested (compiled) sub-programs included.
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                yield int(np.prod(getattr(var.aval, "shape", ())))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from sizes(inner)

    for fn, args in ((balanced, (q, kk, v, sim)), (token, (q, kk, v, cq))):
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
        all_sizes = list(sizes(jaxpr))
        assert len(all_sizes) > 50  # the nested programs were inspected
        assert max(all_sizes) < n * n // 4, (fn.__name__, max(all_sizes))


def test_exclude_self_unless_alone():
    mask = np.array([[True, True, False], [False, True, False], [False, False, False]])
    eye = np.eye(3, dtype=bool)
    out = to_np(P.exclude_self_unless_alone(ops.convert_to_tensor(mask), eye))
    np.testing.assert_array_equal(
        out, [[False, True, False], [False, True, False], [False, False, False]]
    )
