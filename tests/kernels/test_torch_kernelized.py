"""The PyTorch kernelized attention with written-out gradients
(``keras_longattn/kernels/torch/kernelized.py``) against the portable
``keras.ops`` functions it replaces: values and gradients of every input,
both modes, padding, lengths that are not a multiple of the chunk, cross
attention (T != S), zero normalisers, causality by gradients; and the
layers' ``"kernel_fused"`` / ``"favor_fused"`` paths (chosen by ``"auto"``
on PyTorch, refused with a reason elsewhere)."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.kernels import backend_ops
from keras_longattn.layers import LinearAttention
from keras_longattn.layers import PerformerAttention
from keras_longattn.ops import kernelized
from keras_longattn.ops import performer as performer_ops
from keras_longattn.testing import rel_error

BACKEND = keras.backend.backend()
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="PyTorch kernels")


def _rand(shape, seed, low=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype("float32")
    if low is not None:  # non-negative features
        x = np.abs(x) + low
    return x


def _grads(fn, arrays):
    """Output and gradients of ``sum(out * weights)`` w.r.t. every array."""
    import torch

    xs = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = fn(*xs)
    w = torch.tensor(_rand(tuple(out.shape), 99))
    grads = torch.autograd.grad((out * w).sum(), xs)
    return out.detach().numpy(), [g.numpy() for g in grads]


def _close(a, b, tol=2e-5):
    assert rel_error(a, b) <= tol, rel_error(a, b)


CASES = [
    # B, T, S, H, F, D, chunk, key_mask
    (2, 37, 37, 2, 8, 5, 6, False),
    (1, 64, 64, 3, 16, 16, 64, False),
    (2, 50, 50, 2, 8, 4, 7, True),
    (2, 20, 33, 2, 8, 4, 8, True),  # cross attention, T < S
    (1, 33, 20, 1, 4, 3, 5, False),  # T > S
    (1, 9, 9, 1, 4, 3, 100, False),  # one chunk larger than the length
]


@torch_only
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_associative_attention_matches_portable(case, causal, head_major):
    B, T, S, H, F, D, chunk, masked = case
    fused = backend_ops().kernelized
    arrays = [
        _rand((B, T, H, F), 0, low=0.05),
        _rand((B, S, H, F), 1, low=0.05),
        _rand((B, S, H, D), 2),
    ]
    mask = None
    if masked:
        import torch

        mask = torch.tensor(np.arange(S)[None, :] < np.array([S, S - 7])[:B, None])

    def make(module):
        def fn(q, k, v):
            if module is not kernelized and head_major:
                # (B, H, n, F) features: the same function of q and k.
                return module.associative_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v, causal=causal,
                    key_mask=mask, chunk_size=chunk, head_major=True,
                )
            return module.associative_attention(
                q, k, v, causal=causal, key_mask=mask, chunk_size=chunk
            )

        return fn

    out, grads = _grads(make(fused), arrays)
    ref, ref_grads = _grads(make(kernelized), arrays)
    _close(out, ref)
    for g, r in zip(grads, ref_grads):
        _close(g, r)


@torch_only
@pytest.mark.parametrize("causal", [True, False])
def test_zero_normaliser_is_finite_and_zero(causal):
    """ReLU features can be all zero: the query's output is exactly 0 and
    every gradient finite, as in the portable function."""
    fused = backend_ops().kernelized
    q = _rand((1, 12, 1, 4), 0, low=0.1)
    q[0, 5] = 0.0
    arrays = [q, _rand((1, 12, 1, 4), 1, low=0.1), _rand((1, 12, 1, 3), 2)]

    def make(module):
        return lambda a, b, c: module.associative_attention(
            a, b, c, causal=causal, chunk_size=5
        )

    out, grads = _grads(make(fused), arrays)
    ref, ref_grads = _grads(make(kernelized), arrays)
    assert np.all(out[0, 5] == 0.0)
    assert all(np.isfinite(g).all() for g in grads)
    _close(out, ref)
    for g, r in zip(grads, ref_grads):
        _close(g, r)


@torch_only
def test_causal_gradients_do_not_reach_the_past():
    """An output at position i has exactly zero gradient with respect to
    keys and values after i (chunked prefix sums in both passes)."""
    import torch

    fused = backend_ops().kernelized
    q, k, v = (
        torch.tensor(_rand((1, 40, 2, 4), s, low=0.1 if s < 2 else None),
                     requires_grad=True)
        for s in range(3)
    )
    out = fused.causal_kernel_attention(q, k, v, chunk_size=8)
    for i in (0, 7, 8, 21, 39):
        gq, gk, gv = torch.autograd.grad(out[0, i].sum(), (q, k, v), retain_graph=True)
        assert torch.all(gk[0, i + 1:] == 0) and torch.all(gv[0, i + 1:] == 0)
        assert torch.all(gq[0, :i] == 0) and torch.all(gq[0, i + 1:] == 0)


@torch_only
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize(
    "is_query,causal,masked",
    [(True, False, False), (True, True, False), (False, False, False),
     (False, True, False), (False, False, True), (False, True, True)],
)
def test_softmax_kernel_features_match_portable(is_query, causal, masked, head_major):
    import torch

    fused = backend_ops().kernelized
    x = _rand((2, 30, 3, 8), 0)
    w = performer_ops.orthogonal_gaussian_numpy(20, 8, seed=3)
    mask = None
    if masked:
        mask = torch.tensor(np.arange(30)[None, :] < np.array([[30], [11]]))

    def make(fn):
        return lambda a, b: fn(a, b, is_query=is_query, causal=causal, mask=mask)

    def fast(a, b, **kwargs):
        out = fused.softmax_kernel_features(a, b, head_major=head_major, **kwargs)
        return out.transpose(1, 2) if head_major else out

    out, grads = _grads(make(fast), [x, w])
    ref, ref_grads = _grads(make(performer_ops.softmax_kernel_features), [x, w])
    _close(out, ref)
    for g, r in zip(grads, ref_grads):
        _close(g, r, tol=5e-5)


@torch_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "layer_cls,fast,portable,kwargs",
    [
        (LinearAttention, "kernel_fused", "kernel", {}),
        (LinearAttention, "kernel_fused", "kernel", {"feature_map": "relu"}),
        (PerformerAttention, "favor_fused", "favor", {"num_features": 24, "seed": 1}),
    ],
)
def test_layer_paths_agree_on_the_same_weights(layer_cls, fast, portable, kwargs, causal):
    """The fused path (what "auto" picks on PyTorch) and the portable path
    of one layer: outputs and input gradients, with padded keys."""
    from keras_longattn.testing.gradients import input_gradient

    x = _rand((2, 45, 16), 0)
    mask = np.arange(45)[None, :] < np.array([[45], [30]])
    layer = layer_cls(num_heads=2, key_dim=8, chunk_size=8, **kwargs)
    layer(x, x)
    assert layer.select_implementation(use_causal_mask=causal) == fast
    outs, grads = {}, {}
    for name in (fast, portable):
        layer.implementation = name
        outs[name] = to_np(layer(x, x, value_mask=mask, use_causal_mask=causal))
        assert layer.last_implementation == name
        grads[name] = input_gradient(
            lambda t: layer(t, t, value_mask=mask, use_causal_mask=causal), x
        )
    _close(outs[fast], outs[portable])
    _close(grads[fast], grads[portable], tol=5e-5)


@pytest.mark.skipif(BACKEND == "torch", reason="refusal on the other backends")
@pytest.mark.parametrize(
    "layer_cls,fast,kwargs",
    [(LinearAttention, "kernel_fused", {}),
     (PerformerAttention, "favor_fused", {"num_features": 8, "seed": 0})],
)
def test_fused_paths_are_refused_without_the_backend_entry(layer_cls, fast, kwargs):
    x = _rand((1, 10, 16), 0)
    auto = layer_cls(num_heads=2, key_dim=8, **kwargs)
    auto(x, x)
    assert auto.last_implementation != fast
    layer = layer_cls(num_heads=2, key_dim=8, implementation=fast, **kwargs)
    with pytest.raises(ValueError, match="written-out gradients"):
        layer(x, x)


# ------------------------------------------- the conformance suite, fused
# The layers' conformance classes rerun with the fused paths (PyTorch only):
# reference equality, causality, padding, mixed precision, save/load, jit.
from tests.layers import test_linear_attention as _linear_tests  # noqa: E402
from tests.layers import test_performer_attention as _performer_tests  # noqa: E402


@torch_only
class TestLinearAttentionKernelFused(_linear_tests.TestLinearAttentionKernel):
    implementation = "kernel_fused"


@torch_only
class TestPerformerFavorFused(_performer_tests.TestPerformerFavor):
    implementation = "favor_fused"


@torch_only
class TestPerformerRedrawnFused(_performer_tests.TestPerformerRedrawn):
    implementation = "favor_fused"
