"""The ``implementation="flex"`` paths (PyTorch's FlexAttention,
``keras_longattn/kernels/torch/flex.py``) against ``"reference"`` on the
same weights, for every layer that has one, and each of their refusals.

PyTorch only; on JAX and TensorFlow only the refusal of the path (not the
torch backend) runs. On the CPU FlexAttention runs forward only, so the
comparisons run under ``torch.no_grad()``. Tiles are :data:`TILE` tokens
(not FlexAttention's 128) so that the short sequences here span several
tiles: skipped, partial and full ones. Every case compiles FlexAttention
once for its pattern and shapes (a few seconds on a CPU), so the cases
share shapes and patterns wherever they can: the kernel-level checks use
the patterns and shapes of a layer case and reuse its compiled function.
"""

import keras
import numpy as np
import pytest

from keras_longattn.layers import BigBirdAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import LongformerAttention
from keras_longattn.layers import RoutingAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.ops import patterns as la_patterns
from keras_longattn.ops import sparse as la_sparse

ON_TORCH = keras.backend.backend() == "torch"
torch_only = pytest.mark.skipif(not ON_TORCH, reason="FlexAttention is PyTorch only")

#: Batch, sequence length and input features of the layer cases.
B, N, F = 2, 40, 16
#: Heads and head size (the kernel-level cases use the same shapes).
H, D = 2, 8
#: Tile of the block masks in these tests.
TILE = 16
#: Largest absolute difference from the reference (float32).
TOL = 1e-5

LAYERS = {
    "local": LocalAttention,
    "sparse": SparseAttention,
    "longformer": LongformerAttention,
    "bigbird": BigBirdAttention,
    "routing": RoutingAttention,
}


def _flex():
    from keras_longattn.kernels.torch import flex

    return flex


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of :data:`TILE` tokens (several per sequence)."""
    if ON_TORCH:
        monkeypatch.setattr(_flex(), "BLOCK", TILE)
    yield


def _no_grad():
    import torch

    return torch.no_grad()


def _padding():
    """Key padding: example 0 on the right, example 1 on the left (its
    first queries see no key when causal) and in the middle."""
    mask = np.ones((B, N), bool)
    mask[0, N - 7 :] = False
    mask[1, :3] = False
    mask[1, N // 2] = False
    return mask


def _x(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def _pair(cls, query_shape, value_shape=None, dtype=None, **kwargs):
    """A ``"flex"`` layer and a float32 ``"reference"`` one with its
    weights."""
    layer = cls(num_heads=H, key_dim=D, implementation="flex", dtype=dtype, **kwargs)
    layer.build(query_shape, value_shape or query_shape)
    config = layer.get_config()
    config.update(implementation="reference", dtype="float32")
    ref = cls.from_config(config)
    ref.build(query_shape, value_shape or query_shape)
    ref.set_weights([np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(w, "float32")))
                     for w in layer.weights])
    return layer, ref


def _np(x):
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")))


def _check_layer(cls, kwargs, causal, padded, extra=None, T=N, S=N, dtype=None, tol=TOL):
    """``"flex"`` equals ``"reference"``; a query that sees no key gives a
    finite row; ``last_implementation`` is ``"flex"``."""
    query = _x((B, T, F), 0)
    value = query if T == S else _x((B, S, F), 1)
    layer, ref = _pair(cls, query.shape, value.shape, dtype=dtype, **kwargs)
    call = dict(use_causal_mask=causal, **(extra or {}))
    if padded:
        call["value_mask"] = _padding()[:, :S]
    with _no_grad():
        out = _np(layer(query, value, **call))
        expected = _np(ref(query, value, **call))
    assert layer.last_implementation == "flex"
    assert ref.last_implementation == "reference"
    assert np.isfinite(out).all()
    if dtype is None:
        assert np.abs(out - expected).max() < tol, np.abs(out - expected).max()
    else:
        err = np.abs(out - expected).max() / np.abs(expected).max()
        assert err < tol, err
    return layer


# ------------------------------------------------------------------ layers
@torch_only
@pytest.mark.parametrize("case", ["bidirectional", "causal-padded"])
def test_local_equals_reference(case):
    if case == "bidirectional":  # full, partial and skipped tiles, no mask data
        _check_layer(LocalAttention, {"window": 32}, causal=False, padded=False)
    else:
        _check_layer(LocalAttention, {"window": 6}, causal=True, padded=True)


def _sparse(pattern, combination):
    kwargs = {"pattern": pattern, "block_length": 5 if pattern == "strided" else 8,
              "combination": combination}
    if pattern == "fixed":
        kwargs["summary_width"] = 2
    return kwargs


SPARSE_CASES = {
    # (pattern, combination): causal. Every arrangement: strided A in order
    # and B by column, fixed A in order and B on the summary keys, fixed
    # "merged" with the summary keys appended. Strided "merged" is refused
    # on the CPU (see test_strided_merged_by_lse).
    ("strided", "multihead"): True,
    ("fixed", "multihead"): False,
    ("fixed", "merged"): True,
}


@torch_only
@pytest.mark.parametrize("pattern,combination", list(SPARSE_CASES))
def test_sparse_equals_reference(pattern, combination):
    _check_layer(SparseAttention, _sparse(pattern, combination),
                 causal=SPARSE_CASES[pattern, combination], padded=True)


@torch_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern,combination", [
    ("strided", "first"), ("strided", "second"), ("fixed", "first"), ("fixed", "second")])
def test_sparse_first_second_equal_reference(pattern, combination, causal):
    """``"first"`` and ``"second"`` (the parts of ``"multihead"`` on every
    head) on FlexAttention's unfused implementation: the same masks and
    arrangements, without compiling a kernel per case."""
    with _flex().unfused():
        _check_layer(SparseAttention, _sparse(pattern, combination), causal=causal,
                     padded=True)


def _global_mask():
    mask = np.zeros((B, N), bool)
    mask[0, [0, 9, 37]] = True  # 37 is padded in example 0
    mask[1, [1, 25]] = True  # 1 is padded in example 1
    return mask


@torch_only
@pytest.mark.parametrize("case", ["dilated-global_mask", "causal-global_tokens"])
def test_longformer_equals_reference(case):
    if case == "dilated-global_mask":
        _check_layer(LongformerAttention, {"window": 4, "dilation": [1, 3], "max_global": 4},
                     causal=False, padded=True, extra={"global_mask": _global_mask()})
    else:
        _check_layer(LongformerAttention, {"window": 6, "dilation": 2, "global_tokens": 2},
                     causal=True, padded=True)


BIGBIRD = {"block_size": 4, "window_blocks": 3, "global_blocks": 1, "random_blocks": 2,
           "seed": 3}


@torch_only
@pytest.mark.parametrize("causal", [False, True])
def test_bigbird_equals_reference(causal):
    # Padded: random blocks per example (from each one's real length).
    _check_layer(BigBirdAttention, BIGBIRD, causal=causal, padded=True)


@torch_only
@pytest.mark.parametrize("case", ["local_heads-padded", "causal-balanced-padded"])
def test_routing_equals_reference(case):
    if case == "local_heads-padded":
        kwargs = {"num_clusters": 4, "local_heads": 1, "seed": 1}
        _check_layer(RoutingAttention, kwargs, causal=False, padded=True)
    else:
        kwargs = {"num_clusters": 4, "causal_routing": "balanced", "seed": 1}
        _check_layer(RoutingAttention, kwargs, causal=True, padded=True)


@torch_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(dtype):
    """bfloat16 and float16 compute dtypes, against a float32 reference
    (bfloat16 on a cross-attention call: positions are absolute, T != S)."""
    T = 24 if dtype == "bfloat16" else N
    layer = _check_layer(LocalAttention, {"window": 6}, causal=dtype == "float16",
                         padded=True, dtype=dtype, T=T, tol=3e-2)
    assert layer.compute_dtype == dtype


# ------------------------------------------------------------ kernel level
def _heads(seed, T=N):
    import torch

    return torch.as_tensor(_x((B, T, H, D), seed))


def _perturbed(x, keep, seed):
    """``x`` with large random values at the positions ``keep`` marks
    False."""
    import torch

    noise = torch.as_tensor(_x(tuple(x.shape), seed)) * 100.0
    where = torch.as_tensor(~keep)[:, :, None, None]
    return torch.where(where, noise, x)


def _inert(run, seed=7):
    """``run(key, value)`` is the same when the padded keys and values
    change."""
    keep = _padding()
    key, value = _heads(1), _heads(2)
    with _no_grad():
        clean = run(key, value)
        moved = run(_perturbed(key, keep, seed), _perturbed(value, keep, seed + 1))
    np.testing.assert_array_equal(_np(moved), _np(clean))
    return _np(clean)


@torch_only
def test_padding_inert_and_empty_rows_zero():
    """Perturbing padded keys and values changes no output of any entry
    point (the shapes and patterns of the layer cases above); a query that
    sees no key gets zeros."""
    flex = _flex()
    mask = _padding()
    q = _heads(0)
    local = la_patterns.LocalPattern(5, 0)  # LocalAttention(window=6), causal
    out = _inert(lambda k, v: flex.local_attention(q, k, v, local, key_mask=mask))
    assert not np.any(out[1, :3])  # example 1's first queries see no key

    first, second = la_sparse.sparse_transformer_patterns("strided", 5, None, True)
    _inert(lambda k, v: flex.sparse_attention(
        q, k, v, "strided", 5, None, "multihead", first, second, first_heads=1,
        key_mask=mask))

    causal = la_patterns.CausalPattern()
    window = la_patterns.DilatedPattern(6, 0, 2)
    positions = np.asarray([[0, 1]], "int32")
    valid = positions < N
    _inert(lambda k, v: flex.longformer_attention(
        q, k, v, (window, window), (2, 2), global_pattern=causal,
        global_positions=positions, global_query_valid=valid, global_key_valid=valid,
        key_mask=mask))

    from keras_longattn.ops import bigbird as la_bigbird

    used = la_bigbird.used_key_blocks(mask, N, 4)
    table = la_bigbird.block_mask(10, 10, used, 3, 1, 2, 3, True)
    _inert(lambda k, v: flex.bigbird_attention(q, k, v, table, 4, causal_pattern=causal,
                                               key_mask=mask))


@torch_only
def test_strided_merged_by_lse():
    """Strided ``"merged"`` (A and B minus A merged by their log-sum-exps,
    refused on the CPU kernel) on FlexAttention's unfused implementation,
    which returns the log-sum-exp on the CPU too: equal to dense attention
    under A | B, zeros where a query sees no key."""
    import torch

    flex = _flex()
    from keras_longattn.ops import reference as la_reference

    mask = _padding()
    q, k, v = _heads(0), _heads(1), _heads(2)
    for causal in (False, True):
        first, second = la_sparse.sparse_transformer_patterns("strided", 5, None, causal)
        with flex.unfused(), _no_grad():
            out = flex.sparse_attention(
                q, k, v, "strided", 5, None, "merged", first, second,
                second_only=la_patterns.Difference(second, first), key_mask=mask)
        dense = (first | second).dense_mask(N, N)
        dense = keras.ops.logical_and(dense[None], torch.as_tensor(mask)[:, None, :])
        expected = la_reference.reference_attention(q, k, v, mask=dense[:, None],
                                                    scale=D ** -0.5)
        assert np.abs(_np(out) - _np(expected)).max() < TOL
        if causal:
            assert not np.any(_np(out)[1, :3])


@torch_only
def test_block_mask_matches_torch_sliding_window(monkeypatch):
    """The block mask built from ``LocalPattern`` equals the one torch
    builds from a sliding-window ``mask_mod`` (FlexAttention's own tiles of
    128, several of them): the same partial and full tiles."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _flex()
    monkeypatch.setattr(flex, "BLOCK", 128)
    n = 600
    for look_back, look_ahead in ((200, 0), (64, 64)):
        pattern = la_patterns.LocalPattern(look_back, look_ahead)
        ours = flex.pattern_block_mask(pattern, n, n, device="cpu")

        def window(b, h, q, kv, look_back=look_back, look_ahead=look_ahead):
            return (kv >= q - look_back) & (kv <= q + look_ahead)

        peer = create_block_mask(window, None, None, n, n, device="cpu")
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            torch.testing.assert_close(getattr(ours, name), getattr(peer, name))
        assert torch.equal(ours.to_dense(), peer.to_dense())


@torch_only
def test_compiled_once_per_shape():
    """A repeated call reuses its compiled function and block mask; new
    shapes compile once more."""
    flex = _flex()
    mask = _padding()
    pattern = la_patterns.LocalPattern(5, 0)
    q, k, v = _heads(0), _heads(1), _heads(2)
    with _no_grad():
        flex.local_attention(q, k, v, pattern, key_mask=mask)
        compiled, structures = flex.compiled_count(), len(flex._STRUCTURES.items)
        flex.local_attention(_heads(3), _heads(4), _heads(5), pattern, key_mask=mask)
    assert flex.compiled_count() == compiled
    assert len(flex._STRUCTURES.items) == structures


# ---------------------------------------------------------------- refusals
def _layer(name, **kwargs):
    defaults = {
        "local": {"window": 6},
        "sparse": {"block_length": 5},
        "longformer": {"window": 4},
        "bigbird": BIGBIRD,
        "routing": {"num_clusters": 4},
    }[name]
    return LAYERS[name](num_heads=H, key_dim=D, implementation="flex",
                        **dict(defaults, **kwargs))


def _refusal(layer, **kwargs):
    """The ValueError of selecting ``"flex"`` for a call (None: selected)."""
    try:
        assert layer.select_implementation(query_length=N, key_length=N, **kwargs) == "flex"
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.skipif(ON_TORCH, reason="the refusal off the torch backend")
@pytest.mark.parametrize("name", list(LAYERS))
def test_refused_off_torch(name):
    reason = _refusal(_layer(name))
    assert reason is not None and "needs the torch backend" in reason


@torch_only
@pytest.mark.parametrize("name", list(LAYERS))
def test_cpu_gradients_refused(name):
    """On the CPU FlexAttention has no backward: a trainable layer is
    refused while gradients are enabled, and selected under no_grad."""
    flex = _flex()
    layer = _layer(name)
    reason = _refusal(layer)
    assert reason is not None and flex.CPU_GRAD_REASON in reason
    with _no_grad():
        assert _refusal(layer) is None
    layer.trainable = False
    assert _refusal(layer) is None


@torch_only
def test_cpu_gradients_refused_on_call_and_inputs():
    """A call with gradients enabled raises the refusal before running; an
    input that requires grad (``attend`` on a frozen layer) raises the same
    reason, since the refusal cannot see it."""
    layer = _layer("local")
    x = _x((B, N, F), 0)
    with pytest.raises(ValueError, match="runs forward only"):
        layer(x, x)
    layer.trainable = False
    q = _heads(0).requires_grad_(True)
    with pytest.raises(ValueError, match="runs forward only"):
        layer.attend(q, _heads(1), _heads(2))


@torch_only
def test_cpu_lse_refused():
    """Strided ``"merged"`` merges its parts by log-sum-exp, which the CPU
    kernel does not return; the fixed one runs one softmax."""
    flex = _flex()
    with _no_grad():
        reason = _refusal(_layer("sparse", combination="merged"))
        assert reason is not None and flex.CPU_LSE_REASON in reason
        assert _refusal(_layer("sparse", pattern="fixed", block_length=8,
                               combination="merged")) is None


@torch_only
def test_dtype_refused():
    with _no_grad():
        reason = _refusal(_layer("local", dtype="float64"))
    assert reason is not None and "float32, bfloat16 or float16" in reason
    assert "float64" in reason


@torch_only
def test_missing_flex_attention_refused(monkeypatch):
    flex = _flex()
    monkeypatch.setattr(flex, "_flex_module", None)
    with _no_grad():
        reason = _refusal(_layer("bigbird"))
    assert reason is not None and "FlexAttention (torch.nn.attention.flex_attention) is " \
        "missing" in reason


@torch_only
def test_cpu_platform_and_compiler_refused(monkeypatch):
    from torch._inductor import cpp_builder
    from torch._inductor.kernel.flex import flex_cpu

    with _no_grad():
        assert _refusal(_layer("local")) is None
        with monkeypatch.context() as patch:
            patch.setattr(flex_cpu, "check_cpu_supported", lambda: False)
            reason = _refusal(_layer("local"))
            assert reason is not None and "needs AVX2" in reason

        def no_compiler():
            raise RuntimeError("no c++")

        monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
        reason = _refusal(_layer("longformer"))
        assert reason is not None and "no C++ compiler" in reason


@torch_only
def test_dropout_and_routing_refusals():
    with _no_grad():
        reason = _refusal(_layer("local", dropout=0.1), training=True)
        assert reason is not None and "attention dropout" in reason
        assert _refusal(_layer("local", dropout=0.1)) is None
        reason = _refusal(_layer("routing", shared_qk=True))
        assert reason is not None and "shared_qk=True" in reason
        reason = _refusal(_layer("routing"), use_causal_mask=True)
        assert reason is not None and "causal_routing='token'" in reason
        assert _refusal(_layer("routing", causal_routing="balanced"),
                        use_causal_mask=True) is None


@torch_only
def test_not_chosen_by_auto():
    """``"flex"`` runs only by name: no backend lists its kind for
    ``"auto"``."""
    layer = LocalAttention(num_heads=H, key_dim=D, window=6)
    with _no_grad():
        assert "flex" not in layer.auto_order()
        assert layer.select_implementation(query_length=N, key_length=N) != "flex"


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the flex path is torch's")
def test_auto_tries_flex_only_where_a_device_proved_it(monkeypatch):
    """"auto" puts the flex path first only on a GPU of a vendor with a
    current proof (or named by the trust variable), never on the CPU."""
    from keras_longattn.kernels import proven

    layer = LocalAttention(num_heads=2, key_dim=8, window=4)
    assert "flex" not in layer.auto_order()
    monkeypatch.setattr(proven, "active_vendor", lambda backend: "testvendor")
    monkeypatch.delenv(proven.TRUST_VARIABLE, raising=False)
    assert "flex" not in layer.auto_order()
    monkeypatch.setitem(proven.PROVEN, ("torch", "testvendor"), {"flex": {
        "sources": proven.source_hashes("flex")}})
    assert layer.auto_order()[0] == "flex"
    monkeypatch.delitem(proven.PROVEN, ("torch", "testvendor"))
    monkeypatch.setenv(proven.TRUST_VARIABLE, "flex")
    assert layer.auto_order()[0] == "flex"
    monkeypatch.setattr(proven, "active_vendor", lambda backend: None)
    assert "flex" not in layer.auto_order()


# ------------------------------------------------------ block structure work
@torch_only
def test_block_structure_evaluates_only_the_candidate_tiles():
    """A band's block mask evaluates the pattern on the pairs of its
    candidate tiles only: O(n * w) pairs, not n^2, and the same tables as
    evaluating every tile."""
    import torch

    flex = _flex()
    n, pattern = 64 * TILE, la_patterns.LocalPattern(TILE, 0)
    seen = []

    def counting(q, k):
        seen.append(int(torch.broadcast_tensors(q, k)[0].numel()))
        return pattern.allowed(q, k)

    tiles = pattern.candidate_tiles(np.arange(n), np.arange(n), TILE)
    partial, full = flex.block_structure(counting, n, n, "cpu", tiles)
    assert sum(seen) <= 2 * n * TILE
    every = flex.block_structure(pattern.allowed, n, n, "cpu", flex.every_tile(n, n))
    assert torch.equal(partial, every[0]) and torch.equal(full, every[1])
    with pytest.raises(ValueError, match="tiles"):
        flex.block_structure(pattern.allowed, n, n, "cpu", (np.array([64]), np.array([0])))


@torch_only
@pytest.mark.parametrize("k,wq,wk", [(4, 10, 10), (3, 7, 20), (5, 16, 16), (2, 33, 5)])
def test_document_tiles_cover_every_cluster_pair(k, wq, wk):
    flex = _flex()
    qb, kb = flex.document_tiles(k, wq, wk)
    listed = set(zip(qb.tolist(), kb.tolist()))
    q, kk = np.arange(k * wq)[:, None], np.arange(k * wk)[None, :]
    same = q // wq == kk // wk
    needed = {(i // TILE, j // TILE) for i, j in zip(*np.nonzero(same))}
    assert needed <= listed and len(listed) <= len(needed) + 2 * k
