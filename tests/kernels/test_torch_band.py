"""The PyTorch band-attention kernel (``kernels/torch/band.py``) against the
dense reference: values and gradients, causal and bidirectional, padding,
lengths that are not multiples of the block, several kernel calls per
sequence. The function-level tests run both ways of computing it: the
compiled C++ kernel (``kernels/torch/csrc``, ``path="native"``, and with its
rows always copied to a contiguous buffer first, ``path="packed"``) and the
CPU flash-kernel calls (``path="flash"``). On the other backends: the
``"band_kernel"`` path refuses."""

import shutil

import keras
import numpy as np
import pytest

from keras_longattn.layers import LocalAttention
from keras_longattn.layers import LongformerAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.testing import AttentionLayerConformance

ON_TORCH = keras.backend.backend() == "torch"
torch_only = pytest.mark.skipif(not ON_TORCH, reason="PyTorch kernel")


@pytest.fixture(params=["native", "packed", "flash"])
def path(request, monkeypatch):
    """Runs the test with the compiled kernel (as it decides whether to copy
    a sequence's rows into a contiguous buffer first, then always copying
    them), then with the flash calls."""
    from keras_longattn.kernels.torch import band, native

    if request.param != "flash" and native.band_ops() is None:
        pytest.skip("the compiled band kernel does not build here "
                    "(test_native_kernel_builds says why)")
    if request.param == "packed":
        monkeypatch.setattr(band, "NATIVE_PACK", 1)
    with native.use_native(request.param != "flash"):
        yield request.param


@torch_only
def test_native_kernel_builds():
    """Where a C++ compiler exists the compiled kernel must build and be the
    one LocalAttention uses, so that a broken build cannot hide behind the
    fallback."""
    import warnings

    from keras_longattn.kernels.torch import band, native

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on PATH: the flash-kernel path is used")
    with native.use_native(True), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.band_ops() is not None
        assert band._Plan(64, 16, 7, 0, 16).native is not None
        # On a CPU with AVX-512F the build (-march=native) has the vector form.
        with open("/proc/cpuinfo") as f:
            avx512 = " avx512f" in f.read()
        assert native.band_ops().vector_path() == int(avx512)
    with native.use_native(False):
        assert native.band_ops() is None
        assert band._Plan(64, 16, 7, 0, 16).native is None


class BandKernelLimits:
    """What a forced ``implementation="band_kernel"`` refuses by design,
    before running (``"auto"`` takes another path for these calls): query
    and key lengths that differ, and ``value_dim != key_dim``. The property
    tests (``--run-slow``) then draw no cross-attention, and the two
    value_dim cases must fail with that refusal."""

    supports_cross_attention = False
    known_failures = {
        "test_prop_projection_shapes[value_dim]": "band_kernel needs value_dim == key_dim",
        "test_prop_projection_shapes[value_dim_output_shape_tuple]":
            "band_kernel needs value_dim == key_dim",
    }


@torch_only
class TestLocalAttentionBandKernel(BandKernelLimits, AttentionLayerConformance):
    layer_cls = LocalAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 6}
    implementation = "band_kernel"
    reference_lengths = (5, 16, 37, 2048)
    # float32 only: mixed precision runs another path.
    supports_mixed_precision = False


@torch_only
class TestLocalAttentionBandKernelExtents(BandKernelLimits, AttentionLayerConformance):
    """Unequal extents and a block size that divides neither."""

    layer_cls = LocalAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "look_back": 9, "look_ahead": 3,
                   "block_size": 5}
    implementation = "band_kernel"
    reference_lengths = (3, 23, 64)
    supports_mixed_precision = False


@torch_only
class TestSparseStridedBandKernel(BandKernelLimits, AttentionLayerConformance):
    """Strided multihead: both parts on the kernel when the length is a
    multiple of the stride and nothing is padded, else the window part only
    (lengths 16 and 2048 take the first way, 37 and padded calls the second)."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 4, "key_dim": 8, "pattern": "strided", "block_length": 4}
    implementation = "band_kernel"
    reference_lengths = (16, 37, 2048)
    supports_mixed_precision = False


@torch_only
class TestSparseStridedFirstBandKernel(BandKernelLimits, AttentionLayerConformance):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "strided", "block_length": 8,
                   "combination": "first"}
    implementation = "band_kernel"
    reference_lengths = (16, 37, 64)
    supports_mixed_precision = False


@torch_only
class TestSparseFixedBandKernel(BandKernelLimits, AttentionLayerConformance):
    """Fixed multihead: both parts on the torch kernels (own blocks on the
    band kernel, summaries on the flash kernel) with no padding (causal: any
    length, padded to a multiple of the block inside; bidirectional:
    multiples), the fused layouts otherwise (see the next test)."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 4, "key_dim": 8, "pattern": "fixed", "block_length": 8,
                   "summary_width": 2}
    implementation = "band_kernel"
    reference_lengths = (16, 37, 2048)
    supports_mixed_precision = False


@torch_only
@pytest.mark.parametrize("causal", [True, False])
def test_fixed_band_kernel_runs_the_kernels_where_it_can(causal, monkeypatch):
    """Which calls reach ``kernels/torch/fixed.py``: unpadded ones whose
    length is a multiple of the block, and causal ones of any length;
    the results equal the reference layer's either way."""
    from keras_longattn.kernels.torch import fixed

    calls = []
    real = fixed.fixed_attention
    monkeypatch.setattr(fixed, "fixed_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 24, 16)).astype("float32")
    mask = np.ones((2, 24), bool)
    mask[1, 20:] = False
    kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed", "block_length": 8,
              "summary_width": 2}
    layer = SparseAttention(**kwargs)
    reference = SparseAttention(implementation="reference", **kwargs)
    layer(x, x)
    reference(x, x)
    reference.set_weights(layer.get_weights())
    for xs, m, reaches in ((x, None, True), (x[:, :21], None, causal), (x, mask, False)):
        calls.clear()
        out = layer(xs, xs, value_mask=m, use_causal_mask=causal)
        ref = reference(xs, xs, value_mask=m, use_causal_mask=causal)
        # The fixed kernels ran, or the layouts of "blocked_fused" (reported).
        assert layer.last_implementation == (
            "band_kernel" if reaches else "band_kernel:blocked_fused")
        assert bool(calls) == reaches, (xs.shape, m is None, calls)
        np.testing.assert_allclose(keras.ops.convert_to_numpy(out),
                                   keras.ops.convert_to_numpy(ref), rtol=1e-4, atol=1e-5)


def _dense(q, k, v, look_back, look_ahead, key_mask, scale):
    """Dense masked softmax attention in float64 torch (the specification)."""
    import torch

    T = q.shape[1]
    pos = torch.arange(T)
    rel = pos[None, :] - pos[:, None]  # key - query
    allowed = (rel >= -look_back) & (rel <= look_ahead)  # (T, S)
    allowed = allowed[None, None]  # (1, 1, T, S)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))  # (B, H, T, d)
    s = torch.einsum("bhtd,bhsd->bhts", q, k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see no key
    out = torch.einsum("bhts,bhsd->bhtd", p, v)
    return out.transpose(1, 2)


def _dense_per_head(q, k, v, allowed, scale):
    """Dense float64 attention of ``(B, T, H, d)`` heads, head ``h`` under
    its own boolean ``(T, S)`` (or per-example ``(B, T, S)``) pattern
    ``allowed[h]``; a query that sees no key gets zeros."""
    import torch

    refs = []
    for h, pattern in enumerate(allowed):
        scores = torch.einsum("btd,bsd->bts", q[:, :, h].double(), k[:, :, h].double()) * scale
        probs = torch.softmax(scores.masked_fill(~pattern, float("-inf")), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # rows that see no key
        refs.append(torch.einsum("bts,bsd->btd", probs, v[:, :, h].double()))
    return torch.stack(refs, dim=2)


def _assert_matches_reference(out, ref, inputs, gen):
    """``out`` equals its float64 reference ``ref``, and so do their
    gradients with respect to ``inputs`` under one random weighting of the
    outputs."""
    import torch

    np.testing.assert_allclose(out.detach().numpy(), ref.detach().numpy(), rtol=1e-5,
                               atol=1e-5)
    weights = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weights.double()).sum(), inputs)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-4, atol=1e-5)


CASES = [
    # (B, T, look_back, look_ahead, block_size, padded)
    (1, 64, 15, 0, None, False),
    (2, 100, 15, 0, 8, False),
    (2, 100, 7, 7, None, True),
    (1, 77, 9, 3, 5, True),
    (2, 33, 40, 0, None, False),  # window longer than the sequence
    (1, 130, 0, 0, 16, False),  # the position itself only
    (3, 50, 4, 11, 4, True),
]


@torch_only
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("small_calls", [False, True])
@pytest.mark.parametrize("d", [8, 16, 48])
def test_kernel_equals_dense_reference(case, small_calls, d, path, monkeypatch):
    """Head sizes 16 and 48 in tiles of 32 take the compiled kernel's
    AVX-512 form where it is built (two register blocks), 8 and tiles of 5
    its BLAS form."""
    import torch

    from keras_longattn.kernels.torch import band

    if small_calls:
        # flash: many groups and edge segments per sequence; native: tiles
        # of 5 queries (a length of 5 never divides the cases' windows).
        monkeypatch.setattr(band, "MAX_BAND_ELEMENTS", 1 << 11)
        monkeypatch.setattr(band, "NATIVE_TILE", 5)
    B, T, look_back, look_ahead, block_size, padded = case
    H = 2
    gen = torch.Generator().manual_seed(T + look_back + d)
    q, k, v = (torch.randn(B, T, H, d, generator=gen, requires_grad=True) for _ in range(3))
    key_mask = None
    if padded:
        key_mask = torch.rand(B, T, generator=gen) > 0.3
        key_mask[0, : T // 2] = False  # early queries of a causal band see nothing
    scale = 0.3
    out = band.band_attention(q, k, v, look_back, look_ahead, block_size=block_size,
                              key_mask=key_mask, scale=scale)
    ref = _dense(q, k, v, look_back, look_ahead, key_mask, scale)
    _assert_matches_reference(out, ref, (q, k, v), gen)


@torch_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window_heads", [0, 1, 2, 3])
@pytest.mark.parametrize("d", [8, 32])
def test_strided_kernel_equals_dense_reference(causal, window_heads, d, path):
    """Head by head: a window of ``l`` keys for the first heads, every
    ``l``-th key for the others; inputs are head slices (strided views)."""
    import torch

    from keras_longattn.kernels.torch import strided

    B, T, H, l = 2, 48, 3, 6
    gen = torch.Generator().manual_seed(window_heads + d)
    wide = [torch.randn(B, T, 2 * H, d, generator=gen) for _ in range(3)]
    q, k, v = (w[:, :, ::2].requires_grad_(True) for w in wide)
    out = strided.strided_attention(q, k, v, l, causal, window_heads, 0.4)
    pos = torch.arange(T)
    rel = pos[None, :] - pos[:, None]
    window = (rel > -l) & ((rel <= 0) if causal else (rel < l))
    column = (rel % l == 0) & ((rel <= 0) if causal else torch.ones_like(window))
    ref = _dense_per_head(q, k, v, [window if h < window_heads else column for h in range(H)],
                          0.4)
    _assert_matches_reference(out, ref, (q, k, v), gen)


@torch_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_heads", [0, 1, 2, 3])
@pytest.mark.parametrize("d", [8, 32])
def test_fixed_kernel_equals_dense_reference(causal, block_heads, d, path):
    """Head by head: the own block of ``l`` for the first heads, the last
    ``c`` cells of every block for the others (causal: the first ``l - c``
    queries of those heads see no key and get zeros); inputs are head
    slices (strided views); three query groups of unequal size."""
    import torch

    from keras_longattn.kernels.torch import fixed

    B, T, H, l, c = 2, 42, 3, 6, 2
    gen = torch.Generator().manual_seed(10 + block_heads + d)
    wide = [torch.randn(B, T, 2 * H, d, generator=gen) for _ in range(3)]
    q, k, v = (w[:, :, 1::2].requires_grad_(True) for w in wide)
    out = fixed.fixed_attention(q, k, v, l, c, causal, block_heads, 0.4)
    pos = torch.arange(T)
    later = pos[None, :] > pos[:, None]  # key after query
    own = (pos[None, :] // l == pos[:, None] // l)
    summary = (pos[None, :] % l >= l - c).expand(T, T)
    if causal:
        own, summary = own & ~later, summary & ~later
    ref = _dense_per_head(q, k, v, [own if h < block_heads else summary for h in range(H)], 0.4)
    if causal and block_heads < H:
        assert not out[:, : l - c, block_heads:].any()  # zeros, not a mean of values
    _assert_matches_reference(out, ref, (q, k, v), gen)


@torch_only
@pytest.mark.parametrize("tile,d", [(32, 32), (32, 16), (5, 8), (32, 8)])
@pytest.mark.parametrize("pack", [0, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_native_key_intervals_equal_dense_reference(tile, d, pack, padded):
    """The compiled kernel's explicit key intervals (the fixed pattern's
    summaries): ``T`` queries against ``S != T`` keys, query ``p`` seeing
    keys ``[first[p], last[p])`` -- arbitrary, not monotone, some empty --
    values, log-sum-exp and the three gradients against dense float64."""
    import torch

    from keras_longattn.kernels.torch import native

    ops = native.band_ops()
    if ops is None:
        pytest.skip("the compiled band kernel does not build here")
    N, T, S, H, scale = 2, 45, 70, 2, 0.3
    gen = torch.Generator().manual_seed(tile + d + pack + 2 * padded)
    first = torch.randint(0, S, (T,), generator=gen)
    last = (first + torch.randint(-5, 40, (T,), generator=gen)).clamp(0, S)
    last[:3] = first[:3]  # some queries see nothing
    intervals = torch.stack([first, last]).to(torch.int32).contiguous()
    valid = (torch.rand(N, S, generator=gen) > 0.3) if padded else None
    # Head slices of wider tensors: strided rows.
    q = torch.randn(N, T, 2 * H, d, generator=gen)[:, :, ::2]
    k, v = (torch.randn(N, S, 2 * H, d, generator=gen)[:, :, 1::2] for _ in range(2))
    out, lse = torch.empty(N, T, H, d), torch.empty(N, T, H)
    ops.forward(q, k, v, valid, 0, 0, tile, scale, out, lse, pack, intervals)

    keys = torch.arange(S)
    allowed = (keys[None, :] >= first[:, None]) & (keys[None, :] < last[:, None])
    allowed = allowed[None].expand(N, T, S)
    if valid is not None:
        allowed = allowed & valid[:, None, :]
    qd, kd, vd = (t.double().requires_grad_(True) for t in (q, k, v))
    ref = _dense_per_head(qd, kd, vd, [allowed] * H, scale)
    np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), rtol=1e-5, atol=1e-5)
    seen = allowed.any(-1)  # (N, T)
    scores = torch.einsum("nthd,nshd->nhts", qd, kd) * scale
    ref_lse = torch.logsumexp(scores.masked_fill(~allowed[:, None], float("-inf")),
                              dim=-1).transpose(1, 2)  # (N, T, H)
    np.testing.assert_allclose(lse[seen].numpy(), ref_lse[seen].detach().numpy(), rtol=1e-5,
                               atol=1e-5)
    assert (lse[~seen] < -1e29).all() and not out[~seen].any()

    grad_out = torch.randn(N, T, H, d, generator=gen)
    dq, dk, dv = torch.empty(N, T, H, d), torch.empty(N, S, H, d), torch.empty(N, S, H, d)
    ops.backward(q, k, v, valid, 0, 0, tile, scale, out, lse, grad_out, dq, dk, dv, pack,
                 intervals)
    ref_grads = torch.autograd.grad((ref * grad_out.double()).sum(), (qd, kd, vd))
    for g, r in zip((dq, dk, dv), ref_grads):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-4, atol=1e-5)


@torch_only
def test_native_key_intervals_reject_bad_input():
    import torch

    from keras_longattn.kernels.torch import native

    ops = native.band_ops()
    if ops is None:
        pytest.skip("the compiled band kernel does not build here")
    q, k = torch.randn(1, 8, 1, 16), torch.randn(1, 12, 1, 16)
    out, lse = torch.empty(1, 8, 1, 16), torch.empty(1, 8, 1)
    with pytest.raises(RuntimeError, match="explicit key intervals"):
        ops.forward(q, k, k, None, 0, 0, 32, 1.0, out, lse)
    bad = torch.tensor([[0] * 8, [5] * 7 + [13]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="query 7 outside"):
        ops.forward(q, k, k, None, 0, 0, 32, 1.0, out, lse, -1, bad)


@torch_only
def test_fixed_kernel_rejects_bad_lengths_with_the_value():
    import torch

    from keras_longattn.kernels.torch import fixed

    q = torch.randn(1, 10, 2, 4)
    with pytest.raises(ValueError, match="block_length=3"):
        fixed.fixed_attention(q, q, q, 3, 1, True, 1, 0.5)
    with pytest.raises(ValueError, match="summary_width=5"):
        fixed.fixed_attention(q, q, q, 5, 5, True, 1, 0.5)


@torch_only
def test_strided_kernel_rejects_a_stride_that_does_not_divide():
    import torch

    from keras_longattn.kernels.torch import strided

    q = torch.randn(1, 10, 2, 4)
    with pytest.raises(ValueError, match="stride=3"):
        strided.strided_attention(q, q, q, 3, True, 1, 0.5)


@torch_only
def test_future_tokens_do_not_change_causal_outputs(path):
    """Causality by perturbation: changing positions > t leaves outputs <= t."""
    import torch

    from keras_longattn.kernels.torch import band

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 90, 2, 8, generator=gen) for _ in range(3))
    out = band.band_attention(q, k, v, 20, 0, block_size=16)
    k2, v2 = k.clone(), v.clone()
    k2[:, 50:] += 3.0
    v2[:, 50:] -= 2.0
    out2 = band.band_attention(q, k2, v2, 20, 0, block_size=16)
    np.testing.assert_array_equal(out[:, :50].numpy(), out2[:, :50].numpy())
    assert not np.allclose(out[:, 50:].numpy(), out2[:, 50:].numpy())


@torch_only
def test_padded_keys_do_not_change_outputs(path):
    import torch

    from keras_longattn.kernels.torch import band

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 61, 2, 8, generator=gen) for _ in range(3))
    key_mask = torch.ones(2, 61, dtype=torch.bool)
    key_mask[:, 40:] = False
    out = band.band_attention(q, k, v, 7, 7, key_mask=key_mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, 40:] = 100.0
    v2[:, 40:] = -100.0
    out2 = band.band_attention(q, k2, v2, 7, 7, key_mask=key_mask)
    np.testing.assert_allclose(out.numpy(), out2.numpy(), rtol=0, atol=1e-6)


@torch_only
def test_kernel_rejects_bad_input_with_the_value():
    import torch

    from keras_longattn.kernels.torch import band

    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="look_back=-1"):
        band.band_attention(q, q, q, -1, 0)
    with pytest.raises(ValueError, match="float32"):
        band.band_attention(q.double(), q.double(), q.double(), 2, 0)
    with pytest.raises(ValueError, match="lengths differ"):
        band.band_attention(q, q[:, :5], q[:, :5], 2, 0)


@torch_only
def test_auto_prefers_the_kernel_on_torch_in_float32():
    x = np.random.default_rng(0).standard_normal((1, 40, 16)).astype("float32")
    layer = LocalAttention(num_heads=2, key_dim=8, window=8)
    layer(x, x, use_causal_mask=True)
    assert layer.last_implementation == "band_kernel"
    half = LocalAttention(num_heads=2, key_dim=8, window=8, dtype="mixed_bfloat16")
    half(x, x, use_causal_mask=True)
    assert half.last_implementation != "band_kernel"


@pytest.mark.skipif(ON_TORCH, reason="the refusal of the other backends")
def test_other_backends_refuse_the_band_kernel():
    x = np.random.default_rng(0).standard_normal((1, 12, 16)).astype("float32")
    layer = LocalAttention(num_heads=2, key_dim=8, window=4, implementation="band_kernel")
    with pytest.raises(ValueError, match="band_kernel"):
        layer(x, x, use_causal_mask=True)
    auto = LocalAttention(num_heads=2, key_dim=8, window=4)
    auto(x, x, use_causal_mask=True)
    assert auto.last_implementation != "band_kernel"


# ------------------------------------------- extra keys (Longformer's globals)
def _dense_with_extra(q, k, v, look_back, look_ahead, key_mask, extra_k, extra_v,
                      extra_mask, scale):
    """Dense float64 attention over the band and the extra keys in one
    softmax (the specification of ``extra_keys``)."""
    import torch

    T = q.shape[1]
    pos = torch.arange(T)
    rel = pos[None, :] - pos[:, None]
    allowed = ((rel >= -look_back) & (rel <= look_ahead))[None].expand(q.shape[0], T, T)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, :]
    allowed = torch.cat([allowed, extra_mask], dim=2)  # (B, T, T + G)
    keys = torch.cat([k, extra_k], dim=1).double()
    values = torch.cat([v, extra_v], dim=1).double()
    s = torch.einsum("bthd,bshd->bhts", q.double(), keys) * scale
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return torch.einsum("bhts,bshd->bthd", p, values)


@torch_only
@pytest.mark.parametrize("case", CASES)
def test_extra_keys_equal_one_softmax(case, path):
    """The band and a few extra keys merged inside the autograd function
    equal one dense softmax over both, values and the gradients of every
    input (the extra keys' included); queries that see nothing get zeros."""
    import torch

    from keras_longattn.kernels.torch import band

    B, T, look_back, look_ahead, block_size, padded = case
    H, d, G = 2, 8, 3
    gen = torch.Generator().manual_seed(3 * T + look_ahead)
    q, k, v = (torch.randn(B, T, H, d, generator=gen, requires_grad=True) for _ in range(3))
    ek, ev = (torch.randn(B, G, H, d, generator=gen, requires_grad=True) for _ in range(2))
    extra_mask = torch.rand(B, T, G, generator=gen) > 0.4
    extra_mask[0, : T // 3] = False
    key_mask = None
    if padded:
        key_mask = torch.rand(B, T, generator=gen) > 0.3
        key_mask[0, : T // 2] = False  # with the extra mask: queries that see nothing
    out = band.band_attention(q, k, v, look_back, look_ahead, block_size=block_size,
                              key_mask=key_mask, scale=0.3, extra_keys=ek,
                              extra_values=ev, extra_mask=extra_mask)
    ref = _dense_with_extra(q, k, v, look_back, look_ahead, key_mask, ek, ev, extra_mask, 0.3)
    np.testing.assert_allclose(out.detach().numpy(), ref.detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    weights = torch.randn(out.shape, generator=gen)
    inputs = (q, k, v, ek, ev)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * weights.double()).sum(), inputs)
    for g, r in zip(grads, ref_grads):
        assert np.abs(r.numpy()).max() > 0
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-4, atol=1e-5)


@torch_only
class TestLongformerBandKernel(BandKernelLimits, AttentionLayerConformance):
    """Longformer on the band kernel: two global tokens (padded away in
    example 1 of the padding checks), an even window that is not a
    multiple of the blocks."""

    layer_cls = LongformerAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 6, "global_tokens": 2}
    implementation = "band_kernel"
    reference_lengths = (16, 37, 2048)
    supports_mixed_precision = False


@torch_only
@pytest.mark.parametrize("causal", [False, True])
def test_longformer_band_kernel_global_mask_and_weight_gradients(causal):
    """Per-example global positions with padding: outputs and the gradients
    of every weight (the global projections' included) equal the
    reference; ``auto`` takes the kernel, and dilated heads refuse it."""
    from keras_longattn.testing.gradients import weight_gradients

    n = 45
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, n, 16)).astype("float32") for _ in range(3))
    pad = np.ones((2, n), bool)
    pad[0, n - 6:] = False
    pad[1, :2] = False
    gm = np.zeros((2, n), bool)
    gm[0, [3, 20]] = True
    gm[1, [0, 5, n - 1]] = True
    kwargs = {"num_heads": 2, "key_dim": 8, "window": 8}
    layer = LongformerAttention(**kwargs)
    ref = LongformerAttention(implementation="reference", **kwargs)
    layer(q, v, key=k)
    ref(q, v, key=k)
    weights = [w + rng.standard_normal(w.shape).astype("float32") * 0.3
               for w in layer.get_weights()]
    layer.set_weights(weights)
    ref.set_weights(weights)
    call = {"key": k, "global_mask": gm, "value_mask": pad, "query_mask": pad,
            "use_causal_mask": causal}
    out, expected = layer(q, v, **call), ref(q, v, **call)
    assert layer.last_implementation == "band_kernel"
    out, expected = keras.ops.convert_to_numpy(out), keras.ops.convert_to_numpy(expected)
    np.testing.assert_allclose(out[pad], expected[pad], rtol=1e-4, atol=1e-5)

    def loss(lay):
        out = lay(q, v, **call) * keras.ops.cast(pad[..., None], "float32")
        return keras.ops.sum(keras.ops.sin(out) * (1.0 + keras.ops.arange(16, dtype="float32")))

    from keras_longattn.testing import rel_error

    got = weight_gradients(layer, lambda: loss(layer))
    want = weight_gradients(ref, lambda: loss(ref))
    names = [w.path for w in layer.trainable_variables]
    for name, g, w in zip(names, got, want):
        # Key biases shift every score of a row equally: softmax-invariant.
        if "key/bias" in name or "key_global/bias" in name:  # zero up to rounding
            assert np.abs(g).max() < 1e-3 and np.abs(w).max() < 1e-3, name
            continue
        assert np.abs(w).max() > 0, name
        assert rel_error(g, w) < 1e-4, name

    dilated = LongformerAttention(num_heads=2, key_dim=8, window=8, dilation=[1, 2])
    dilated(q, v, key=k)
    assert dilated.last_implementation != "band_kernel"
    with pytest.raises(ValueError, match="dilat"):
        LongformerAttention(num_heads=2, key_dim=8, window=8, dilation=[1, 2],
                            implementation="band_kernel")(q, v, key=k)
