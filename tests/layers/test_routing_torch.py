"""RoutingAttention's ``"routed_torch"`` path: the planned flash-attention
kernel of ``keras_longattn.kernels.torch.routing`` for causal token routing.

Checked against independent references on the same weights and clusters:
the kernel against the portable sorted-chunk attention (explicit einsums)
and against a dense NumPy loop over the chunk timeline, values and
gradients; the layer path against the ``"reference"`` implementation and
the NumPy reference of ``test_routing_attention``; causality by gradients
and by perturbing future tokens; padding by perturbing padded positions.
On other backends the path refuses, naming the reason, and ``"auto"``
never picks it.
"""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers.routing_attention import RoutingAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error
from keras_longattn.testing.gradients import input_gradient
from tests.layers.test_routing_attention import numpy_reference

BACKEND = keras.backend.backend()
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="the kernel is PyTorch's")


def _x(B=2, T=29, dim=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, dim)).astype("float32")


# ------------------------------------------------------------- the kernel
def _chunk_timeline_reference(q, k, v, qb, kb, num_buckets, window, shared, scale):
    """Dense float64 sorted-chunk attention from first principles: per
    bucket, the merged timeline of keys and queries (a key before the query
    of its position), cut into chunks of ``window`` members; a query sees
    the keys of its own chunk before it and of the previous chunk."""
    B, T, H, _ = q.shape
    S, dv = k.shape[1], v.shape[3]
    out = np.zeros((B, T, H, dv))
    for b in range(B):
        for h in range(H):
            for c in range(num_buckets):
                if shared:
                    members = [("qk", t) for t in range(T) if qb[b, h, t] == c]
                else:
                    members = sorted(
                        [("k", s) for s in range(S) if kb[b, h, s] == c]
                        + [("q", t) for t in range(T) if qb[b, h, t] == c],
                        key=lambda m: (m[1], m[0] == "q"),
                    )
                for rank, (kind, t) in enumerate(members):
                    if kind == "k":
                        continue
                    lo = (rank // window - 1) * window
                    seen = [
                        s for r, (kk, s) in enumerate(members)
                        if max(lo, 0) <= r < rank and kk != "q"
                    ]
                    if shared and not seen:  # nothing else: itself
                        seen = [t]
                    if not seen:
                        continue
                    logits = np.array([q[b, t, h] @ k[b, s, h] for s in seen]) * scale
                    p = np.exp(logits - logits.max())
                    p /= p.sum()
                    out[b, t, h] = sum(pi * v[b, s, h] for pi, s in zip(p, seen))
    return out


KERNEL_CASES = [
    # B, T, S, H, d, dv, buckets, window, shared, padding
    (2, 29, 29, 2, 8, 8, 3, 5, False, False),
    (2, 29, 23, 2, 8, 6, 3, 5, False, True),  # cross lengths, dv < d, padding
    (1, 11, 19, 2, 8, 12, 3, 3, False, False),  # dv > d
    (2, 37, 37, 3, 8, 8, 4, 4, True, True),  # shared query/key
    (1, 40, 40, 2, 8, 8, 2, 1, False, False),  # window 1
    (1, 300, 300, 2, 16, 16, 5, 64, False, True),
    (1, 300, 300, 1, 16, 16, 5, 64, True, False),
]


@torch_only
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_equals_portable_sorted_chunks_values_and_gradients(case):
    import torch

    from keras_longattn import ops as la_ops
    from keras_longattn.kernels.torch.routing import token_routing_attention

    B, T, S, H, d, dv, k, w, shared, padding = case
    gen = torch.Generator().manual_seed(sum(case[:8]))
    q = torch.randn(B, T, H, d, generator=gen, requires_grad=True)
    key = torch.randn(B, S, H, d, generator=gen, requires_grad=True)
    v = torch.randn(B, S, H, dv, generator=gen, requires_grad=True)
    qb = torch.randint(0, k, (B, H, T), generator=gen)
    kb = qb.clone() if shared else torch.randint(0, k, (B, H, S), generator=gen)
    if padding:  # padded tokens carry bucket k: never seen, zero output
        qb[:, :, -2:] = k
        kb[:, :, -3:] = k
        if shared:
            kb = qb
    want = la_ops.sorted_chunk_attention(q, key, v, qb, kb, k, w, shared=shared)
    got = token_routing_attention(q, key, v, qb, kb, k, w, shared=shared)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    scale = 1.0 / np.sqrt(d)
    dense = _chunk_timeline_reference(
        *(t.detach().double().numpy() for t in (q, key, v)), qb.numpy(), kb.numpy(),
        k, w, shared, scale,
    )
    np.testing.assert_allclose(got.detach().numpy(), dense, rtol=1e-4, atol=1e-5)
    cot = torch.randn(got.shape, generator=gen)
    grads_want = torch.autograd.grad((want * cot).sum(), [q, key, v])
    grads_got = torch.autograd.grad((got * cot).sum(), [q, key, v])
    # (With window 1 a query sees one key: softmax 1, no query gradient.)
    assert float(grads_want[2].abs().max()) > 0
    for name, a, b in zip(("query", "key", "value"), grads_got, grads_want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


@torch_only
def test_kernel_all_padding_and_half_precision():
    import torch

    from keras_longattn.kernels.torch.routing import token_routing_attention

    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    buckets = torch.full((1, 2, 8), 3)  # every token padding
    out = token_routing_attention(q, q, q, buckets, buckets, 3, 4)
    assert float(out.detach().abs().max()) == 0.0
    (grad,) = torch.autograd.grad(out.sum(), [q])
    assert float(grad.abs().max()) == 0.0
    half = torch.randn(1, 16, 2, 4).to(torch.bfloat16)
    buckets = torch.randint(0, 2, (1, 2, 16))
    out = token_routing_attention(half, half, half, buckets, buckets, 2, 4)
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out.float()).all())


# -------------------------------------------------------------- the layer
LAYER_CASES = [
    ({"num_clusters": 4}, (29, 29)),
    ({"num_clusters": 3, "local_heads": 1, "local_window": 5}, (37, 37)),
    ({"num_clusters": 3}, (11, 19)),  # cross-attention
    ({"num_clusters": 3, "shared_qk": True}, (29, 29)),
    ({"num_clusters": 4, "window": 3}, (40, 40)),
]


@torch_only
@pytest.mark.parametrize("kwargs, lengths", LAYER_CASES)
def test_layer_equals_reference_values_and_gradients(kwargs, lengths):
    """Causal calls with padded queries and keys: values equal the
    reference path and the NumPy reference on the same weights and
    clusters; input gradients (query side and key/value side) equal the
    reference path's."""
    T, S = lengths
    q, kv = _x(T=T), _x(T=S, seed=1)
    q_mask = np.ones((2, T), bool)
    kv_mask = np.ones((2, S), bool)
    q_mask[1, T - 4:] = False
    kv_mask[1, S - 5:] = False
    if kwargs.get("shared_qk"):
        kv, kv_mask = q, q_mask
    layer = RoutingAttention(num_heads=2, key_dim=8, implementation="routed_torch", **kwargs)
    ref = RoutingAttention(num_heads=2, key_dim=8, implementation="reference", **kwargs)
    layer(q, kv)
    ref(q, kv)
    ref.set_weights(layer.get_weights())
    call = {"query_mask": q_mask, "value_mask": kv_mask, "use_causal_mask": True}
    out = to_np(layer(q, kv, **call))
    assert layer.last_implementation == "routed_torch"
    want = to_np(ref(q, kv, **call))
    assert rel_error(out[q_mask], want[q_mask]) < 1e-5
    np_ref = numpy_reference(layer, q, kv, use_causal_mask=True, query_mask=q_mask,
                             value_mask=kv_mask)
    assert rel_error(out[q_mask], np_ref[q_mask]) < 1e-5
    sides = ("query",) if kwargs.get("shared_qk") else ("query", "key/value")
    for wrt in sides:
        def fn(x, l):
            if kwargs.get("shared_qk"):
                return l(x, x, **call)
            return l(x, kv, **call) if wrt == "query" else l(q, x, **call)

        x = q if wrt == "query" else kv
        got = input_gradient(lambda v: fn(v, layer), x)
        expected = input_gradient(lambda v: fn(v, ref), x)
        assert np.abs(expected).max() > 0
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=wrt)


@torch_only
def test_bidirectional_calls_equal_reference():
    """Balanced (bidirectional) routing runs as ``"routed_fused"`` does."""
    x = _x(T=29)
    mask = np.ones((2, 29), bool)
    mask[1, 20:] = False
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=4, local_heads=1,
                             implementation="routed_torch")
    ref = RoutingAttention(num_heads=2, key_dim=8, num_clusters=4, local_heads=1,
                           implementation="reference")
    layer(x, x)
    ref(x, x)
    ref.set_weights(layer.get_weights())
    out = to_np(layer(x, x, query_mask=mask, value_mask=mask))
    want = to_np(ref(x, x, query_mask=mask, value_mask=mask))
    assert rel_error(out[mask], want[mask]) < 1e-5


@torch_only
def test_strictly_causal_by_perturbation_and_gradient():
    """Changing tokens from position t on changes no output before t, and
    the output at t has no gradient towards later inputs."""
    T, t = 40, 23
    x = _x(T=T)
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3, implementation="routed_torch")
    out = to_np(layer(x, x, use_causal_mask=True))
    y = x.copy()
    y[:, t:] = np.random.default_rng(5).standard_normal(y[:, t:].shape)
    out2 = to_np(layer(y, y, use_causal_mask=True))
    # Equal up to rounding: the perturbation can change how chunks are
    # grouped into kernel batches (their padded sizes), so the flash kernel
    # may tile a row differently; a leak moves outputs by O(1e-2), not 1 ulp.
    np.testing.assert_allclose(out[:, :t], out2[:, :t], rtol=0, atol=1e-6)
    assert np.abs(out[:, t:] - out2[:, t:]).max() > 1e-2

    def at_t(v):
        return layer(v, v, use_causal_mask=True)[:, t]

    grad = input_gradient(at_t, x)
    assert np.abs(grad[:, : t + 1]).max() > 0
    assert np.abs(grad[:, t + 1:]).max() == 0.0


@torch_only
def test_padded_positions_do_not_matter():
    x = _x(T=33)
    mask = np.ones((2, 33), bool)
    mask[:, 25:] = False
    mask[0, 3] = False
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3, implementation="routed_torch")
    out = to_np(layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=True))
    y = x.copy()
    y[~mask] = 100.0 * np.random.default_rng(2).standard_normal(y[~mask].shape)
    out2 = to_np(layer(y, y, query_mask=mask, value_mask=mask, use_causal_mask=True))
    np.testing.assert_allclose(out[mask], out2[mask], rtol=1e-6, atol=1e-6)


def test_auto_prefers_the_kernel_on_torch_only():
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3)
    x = _x(T=24)
    layer(x, x, use_causal_mask=True)
    if BACKEND == "torch":
        assert layer.last_implementation == "routed_torch"
        assert layer.auto_order()[0] == "routed_torch"
    else:
        assert layer.last_implementation != "routed_torch"
        explicit = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3,
                                    implementation="routed_torch")
        with pytest.raises(ValueError, match="routed_torch: needs the torch backend"):
            explicit(x, x, use_causal_mask=True)


def test_kernel_refuses_dropout_in_training():
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3, dropout=0.5,
                             implementation="routed_torch")
    x = _x(T=24)
    with pytest.raises(ValueError, match="routed_torch: "):
        layer(x, x, use_causal_mask=True, training=True)


@torch_only
class TestRoutingAttentionTorchKernel(AttentionLayerConformance):
    """The conformance suite on the kernel path (local and routing heads)."""

    layer_cls = RoutingAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "local_heads": 1}
    implementation = "routed_torch"
    secondary = True
    reference_lengths = (37, 300)

    def reference_output(self, layer, query, value, **call_kwargs):
        return numpy_reference(layer, query, value, **call_kwargs)
