"""Sparse Transformer patterns (against explicit loops) and their
block-sparse computation (against dense attention under the same patterns)."""

import time

import keras
from keras.ops import convert_to_numpy as to_np
import numpy as np
import pytest

from keras_longattn.ops import sparse as sp
from keras_longattn.ops import subset as subset_ops
from keras_longattn.ops.patterns import LocalPattern
from keras_longattn.ops.reference import reference_attention
from keras_longattn.testing import input_gradient
from keras_longattn.testing import rel_error


def dense(pattern, t, s=None):
    s = t if s is None else s
    return to_np(pattern.dense_mask(t, s))


def loop_sets(pattern, l, c, causal, t, s):
    """The paper's sets A and B as written, one (i, j) at a time."""
    a = np.zeros((t, s), bool)
    b = np.zeros((t, s), bool)
    for i in range(t):
        for j in range(s):
            if pattern == "strided":
                a[i, j] = (i - l < j <= i) if causal else abs(i - j) < l
                b[i, j] = (i - j) % l == 0
            else:
                a[i, j] = j // l == i // l
                b[i, j] = l - c <= j % l < l
            if causal:
                a[i, j] &= j <= i
                b[i, j] &= j <= i
    return a, b


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "pattern, l, c",
    [("strided", 1, None), ("strided", 3, None), ("strided", 4, None),
     ("strided", 20, None), ("fixed", 2, 1), ("fixed", 4, 1), ("fixed", 5, 2),
     ("fixed", 4, 3), ("fixed", 16, 5)],
)
def test_patterns_match_loop_definitions(pattern, l, c, causal):
    first, second = sp.sparse_transformer_patterns(pattern, l, c, causal=causal)
    t, s = 13, 17
    a, b = loop_sets(pattern, l, c, causal, t, s)
    np.testing.assert_array_equal(dense(first, t, s), a)
    np.testing.assert_array_equal(dense(second, t, s), b)
    if causal:
        assert first.is_causal and second.is_causal
    else:
        assert not second.is_causal


def test_strided_first_is_a_local_window():
    first, _ = sp.sparse_transformer_patterns("strided", 4, causal=True)
    assert first == LocalPattern(3, 0)
    first, _ = sp.sparse_transformer_patterns("strided", 4, causal=False)
    assert first == LocalPattern(3, 3)


def test_head_patterns_per_combination():
    first, second = sp.sparse_transformer_patterns("fixed", 5, 2, causal=True)
    heads = sp.sparse_head_patterns("fixed", 5, 2, "multihead", 3, True)
    assert heads == (first, first, second)  # ceil(3 / 2) heads get A.
    assert sp.sparse_head_patterns("fixed", 5, 2, "multihead", 1, True) == (first,)
    assert sp.sparse_head_patterns("fixed", 5, 2, "first", 2, True) == (first, first)
    assert sp.sparse_head_patterns("fixed", 5, 2, "second", 2, True) == (second, second)
    merged = sp.sparse_head_patterns("fixed", 5, 2, "merged", 2, True)
    assert len(merged) == 2
    np.testing.assert_array_equal(dense(merged[0], 12), dense(first, 12) | dense(second, 12))


@pytest.mark.parametrize("causal", [True, False])
def test_merged_second_part_excludes_what_the_first_has(causal):
    """Merged attention computes B as B - A: strided drops only j == i, fixed
    drops the own block's summary cells."""
    n = 14
    for pattern, l, c in (("strided", 4, None), ("fixed", 5, 2)):
        first, second = sp.sparse_transformer_patterns(pattern, l, c, causal)
        rest = dense(sp.Difference(second, first), n)
        a, b = dense(first, n), dense(second, n)
        np.testing.assert_array_equal(rest, b & ~a)
        np.testing.assert_array_equal(rest | a, a | b)
        i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        if pattern == "strided":
            np.testing.assert_array_equal(rest, b & (i != j))
        else:
            np.testing.assert_array_equal(rest, b & (i // l != j // l))


def test_defaults():
    assert sp.default_block_length(2048) == 45
    assert sp.default_block_length(16) == 4
    assert sp.default_block_length(12) == 3  # sqrt(12) = 3.46
    assert sp.default_block_length(30) == 5  # sqrt(30) = 5.48
    assert sp.default_block_length(1) == 2
    assert sp.default_block_length(12, summary_width=5) == 6
    assert sp.default_summary_width(4) == 1
    assert sp.default_summary_width(128) == 16
    assert sp.default_summary_width(256) == 32
    assert sp.default_summary_width(1024) == 32


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sp.sparse_transformer_patterns("dilated", 4), "pattern='dilated'"),
        (lambda: sp.sparse_transformer_patterns("strided", 0), "block_length=0"),
        (lambda: sp.sparse_transformer_patterns("strided", 4, 2), "summary_width=2"),
        (lambda: sp.sparse_transformer_patterns("fixed", 4, 4), "summary_width=4"),
        (lambda: sp.sparse_transformer_patterns("fixed", 4, 0), "summary_width=0"),
        (lambda: sp.sparse_head_patterns("fixed", 4, 1, "sum", 2, True), "combination='sum'"),
        (lambda: sp.StridedPattern(0), "stride=0"),
        (lambda: sp.BlockPattern(2.5), "block_length=2.5"),
        (lambda: sp.SummaryPattern(1, 1), "summary_width=1"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------ computation
def _inputs(t, s, h=3, seed=0, dv=5):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, t, h, 4)).astype("float32")
    k = rng.standard_normal((2, s, h, 4)).astype("float32")
    v = rng.standard_normal((2, s, h, dv)).astype("float32")
    key_mask = rng.random((2, s)) > 0.3
    key_mask[1, :] = False  # one example sees no key at all
    return q, k, v, key_mask


def _dense_reference(q, k, v, key_mask, pattern, l, c, combination, causal):
    t, s, h = q.shape[1], k.shape[1], q.shape[2]
    heads = sp.sparse_head_patterns(pattern, l, c, combination, h, causal)
    mask = np.stack([dense(p, t, s) for p in heads])[None] & key_mask[:, None, None, :]
    return to_np(reference_attention(q, k, v, mask=mask))


CASES = [  # (pattern, l, c, T, S): T != S both ways, neither a multiple of l
    ("strided", 4, None, 13, 11),
    ("fixed", 5, 2, 11, 14),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-l{c[1]}-T{c[3]}-S{c[4]}")
def test_blocked_equals_dense_reference(case, causal):
    """Every combination, key padding (one example fully padded), lengths not
    multiples of l, T != S: equal to dense attention under the patterns."""
    pattern, l, c, t, s = case
    q, k, v, key_mask = _inputs(t, s)
    for combination in sp.SPARSE_COMBINATIONS:
        out = to_np(sp.sparse_attention(q, k, v, pattern, l, c, combination, causal,
                                        key_mask=key_mask))
        ref = _dense_reference(q, k, v, key_mask, pattern, l, c, combination, causal)
        assert np.all(np.isfinite(out))
        assert rel_error(out, ref) < 1e-5, combination
        np.testing.assert_array_equal(out[1], 0.0)  # no visible key -> zeros


FUSED_CASES = CASES + [  # lengths that are multiples of l: the unmasked kernels
    ("strided", 4, None, 16, 16),
    ("fixed", 4, 1, 24, 24),
]


def _fused_grid():
    """Every case, causal or not, padded or not; on jax and tensorflow each
    case runs once (causal and padding alternate over the cases)."""
    points = []
    for i, case in enumerate(FUSED_CASES):
        for causal in (True, False):
            for padded in (True, False):
                kept = causal == (i % 2 == 0) and padded == (i // 2 % 2 == 0)
                points.append(pytest.param(
                    case, causal, padded,
                    id=f"{'padding' if padded else 'no-padding'}-"
                       f"{case[0]}-l{case[1]}-T{case[3]}-S{case[4]}-"
                       f"{'causal' if causal else 'bidirectional'}",
                    marks=() if kept else pytest.mark.grid))
    return points


@pytest.mark.parametrize("case, causal, padded", _fused_grid())
def test_fused_equals_dense_reference(case, causal, padded):
    """fused=True (keras.ops.dot_product_attention on the same layouts):
    equal to the dense reference for every combination it supports, with
    and without key padding (without, the unmasked causal/full kernels
    run where the layout allows)."""
    pattern, l, c, t, s = case
    q, k, v, key_mask = _inputs(t, s)
    if not padded:
        key_mask = np.ones_like(key_mask)
    for combination in ("multihead", "first", "second"):
        out = to_np(sp.sparse_attention(q, k, v, pattern, l, c, combination, causal,
                                        key_mask=key_mask if padded else None,
                                        fused=True))
        ref = _dense_reference(q, k, v, key_mask, pattern, l, c, combination, causal)
        assert np.all(np.isfinite(out))
        assert rel_error(out, ref) < 1e-5, combination
        if padded:
            np.testing.assert_array_equal(out[1], 0.0)


@pytest.mark.parametrize("pattern, l, c", [("strided", 4, None), ("fixed", 4, 1)])
def test_fused_gradients_equal_blocked(pattern, l, c):
    """Gradients of the fused path equal the einsum path's (causal, n a
    multiple of l, so the unmasked kernels run, and with padding)."""
    q, k, v, _ = _inputs(24, 24)
    key_mask = np.ones((2, 24), bool)
    key_mask[1, 20:] = False
    for mask in (None, key_mask):
        grads = []
        for fused in (False, True):
            def f(x, fused=fused, mask=mask):
                return sp.sparse_attention(x, k, v, pattern, l, c, "multihead", True,
                                           key_mask=mask, fused=fused)
            grads.append(input_gradient(f, q))
        assert np.all(np.isfinite(grads[1]))
        assert rel_error(grads[1], grads[0]) < 1e-4


def test_fused_refuses_merged_and_dropout():
    q, k, v, _ = _inputs(8, 8)
    with pytest.raises(ValueError, match="merged"):
        sp.sparse_attention(q, k, v, "strided", 4, None, "merged", True, fused=True)
    with pytest.raises(ValueError, match="dropout"):
        sp.sparse_attention(q, k, v, "strided", 4, None, "multihead", True, fused=True,
                            dropout_fn=lambda p: p)


def test_merged_counts_each_key_once():
    """Merged attention is one softmax over A | B. Counting the keys both
    patterns allow twice (j == i for strided) would give another result."""
    q, k, v, _ = _inputs(13, 11)
    key_mask = np.ones((2, 11), bool)
    out = to_np(sp.sparse_attention(q, k, v, "strided", 4, None, "merged", True,
                                    key_mask=key_mask))
    ref = _dense_reference(q, k, v, key_mask, "strided", 4, None, "merged", True)
    assert rel_error(out, ref) < 1e-5
    # The same keys, each weighted by how many patterns allow it.
    first, second = sp.sparse_transformer_patterns("strided", 4, causal=True)
    count = dense(first, 13, 11).astype("float64") + dense(second, 13, 11)
    scores = np.einsum("bthd,bshd->bhts", q, k) / 2.0  # scale 1 / sqrt(4)
    w = np.exp(scores - scores.max(-1, keepdims=True)) * count
    w /= w.sum(-1, keepdims=True)
    twice = np.einsum("bhts,bshd->bthd", w, v)
    assert rel_error(out, twice) > 1e-2


def test_softmax_with_lse_is_finite_on_masked_rows():
    scores = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]], "float32")
    mask = np.array([[True, False, True], [False, False, False]])
    probs, lse = sp.softmax_with_lse(scores, mask)
    probs, lse = to_np(probs), to_np(lse)
    np.testing.assert_allclose(probs[0], [np.exp(1) / (np.exp(1) + np.exp(3)), 0,
                                          np.exp(3) / (np.exp(1) + np.exp(3))], rtol=1e-6)
    np.testing.assert_array_equal(probs[1], 0.0)
    np.testing.assert_allclose(lse[0], np.log(np.exp(1) + np.exp(3)), rtol=1e-6)
    assert np.isfinite(lse[1]) and lse[1] < -1e29


def test_gradients_finite_through_fully_masked_rows():
    """Causal merged attention where the first rows of example 1 see no key
    (left padding): finite gradients."""
    q, k, v, _ = _inputs(11, 14)
    key_mask = np.ones((2, 14), bool)
    key_mask[1, :6] = False

    def f(x):
        return sp.sparse_attention(x, k, v, "fixed", 5, 2, "merged", True,
                                   key_mask=key_mask)

    g = input_gradient(f, q)
    assert np.all(np.isfinite(g))
    assert np.any(g != 0.0)


def test_float16_inputs():
    q, k, v, key_mask = _inputs(11, 14)
    ref = _dense_reference(q, k, v, key_mask, "fixed", 5, 2, "merged", True)
    cast = [keras.ops.cast(x, "float16") for x in (q, k, v)]
    out = sp.sparse_attention(*cast, "fixed", 5, 2, "merged", True, key_mask=key_mask)
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    out = to_np(keras.ops.cast(out, "float32"))
    assert np.all(np.isfinite(out))
    assert rel_error(out, ref) < 1e-2


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="inspects a jaxpr")
def test_no_quadratic_tensor_is_built():
    """Every intermediate of the blocked path (traced, not run) is far
    smaller than one (T, S) matrix, for every pattern and combination."""
    import jax

    n = 4096
    x = np.zeros((1, n, 2, 8), "float32")
    key_mask = np.ones((1, n), bool)
    for pattern in sp.SPARSE_PATTERNS:
        for combination in sp.SPARSE_COMBINATIONS:
            for causal in (True, False):
                def f(x, pattern=pattern, combination=combination, causal=causal):
                    return sp.sparse_attention(x, x, x, pattern, combination=combination,
                                               causal=causal, key_mask=key_mask)

                jaxpr = jax.make_jaxpr(f)(x)
                largest = max(_sizes(jaxpr.jaxpr))
                # l = 64, c = 8: the largest are the summary scores of
                # fixed/merged, 2 heads x n x (n / 8) = n * n / 4 elements;
                # one dense (T, S) mask alone would be n * n.
                assert largest <= n * n // 4, (pattern, combination, causal, largest)


def _sizes(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield int(np.prod(var.aval.shape))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None:
                yield from _sizes(getattr(inner, "jaxpr", inner))
    yield 0


@pytest.mark.slow
def test_runs_at_16384_positions():
    """B=1, H=2, d=8, n=16384 causal: a dense (T, S) float32 matrix per head
    would be 1 GiB; the blocked path takes a few seconds."""
    n = 16384
    x = np.random.default_rng(0).standard_normal((1, n, 2, 8)).astype("float32")
    start = time.perf_counter()
    out = to_np(sp.sparse_attention(x, x, x, "strided", combination="merged", causal=True))
    elapsed = time.perf_counter() - start
    assert out.shape == (1, n, 2, 8) and np.all(np.isfinite(out))
    assert elapsed < 60.0, f"{elapsed:.1f} s"


def test_summary_groups_with_recomputation_match(monkeypatch):
    """The summary part's query groups, recomputed in the backward pass
    (as for long sequences), give the reference's values and the same
    gradients as storing the weights."""
    q, k, v, key_mask = _inputs(23, 23)
    ref = _dense_reference(q, k, v, key_mask, "fixed", 4, 1, "merged", True)

    def f(x):
        return sp.sparse_attention(x, k, v, "fixed", 4, 1, "merged", True, key_mask=key_mask)

    stored = input_gradient(f, q)
    monkeypatch.setattr(subset_ops, "REMAT_SCORES", 0)
    out = to_np(f(q))
    assert rel_error(out, ref) < 1e-5
    recomputed = input_gradient(f, q)
    assert np.all(np.isfinite(recomputed))
    assert rel_error(recomputed, stored) < 1e-5


def test_summary_groups_cover_the_blocks():
    assert sp._summary_groups(5, causal=False) == [(0, 5, 5)]
    groups = sp._summary_groups(20, causal=True)
    assert len(groups) == 8 and groups[0][0] == 0 and groups[-1][1] == 20
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    assert all(read == end for _, end, read in groups)
