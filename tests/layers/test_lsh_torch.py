"""LSHAttention's ``"hashed_torch"`` path: every round's sorted chunks in
PyTorch's CPU flash kernel, the rounds combined and differentiated in one
autograd function (``keras_longattn.kernels.torch.lsh``).

Checked against the portable ``"hashed"`` path on the same weights and the
same hash seed (so the same buckets): values, input gradients and the
gradient of every weight, causal and bidirectional, with padding, lengths
that are not multiples of the bucket size, one and several rounds; the
kernel alone against the portable :func:`keras_longattn.ops.lsh.lsh_attention`
on random buckets; causality by perturbing future tokens and by gradients.
On other backends the path refuses, naming the reason, and ``"auto"``
never picks it.
"""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import LSHAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error
from keras_longattn.testing.gradients import input_gradient

BACKEND = keras.backend.backend()
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="the kernel is PyTorch's")


def _x(B=2, T=37, dim=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, dim)).astype("float32")


# ------------------------------------------------------------- the kernel
KERNEL_CASES = [
    # B, n, H, R, d, dv, buckets, window, causal, padding
    (2, 37, 2, 2, 8, 8, 4, 4, True, False),
    (2, 37, 2, 2, 8, 8, 4, 4, False, True),
    (1, 50, 3, 3, 8, 6, 6, 5, True, True),  # dv < d
    (1, 50, 2, 1, 8, 12, 2, 7, False, False),  # dv > d, big buckets
    (2, 40, 2, 2, 8, 8, 16, 1, True, False),  # window 1: many tokens alone
    (2, 40, 2, 2, 8, 8, 16, 1, False, True),
    (1, 300, 2, 4, 16, 16, 8, 64, False, True),
    (1, 300, 2, 4, 16, 16, 8, 64, True, False),
]


@torch_only
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_equals_portable_values_and_gradients(case):
    import torch

    from keras_longattn.kernels.torch import lsh as torch_lsh
    from keras_longattn.ops import lsh as lsh_ops

    B, n, H, R, d, dv, k, w, causal, padding = case
    gen = torch.Generator().manual_seed(sum(case[:8]))
    q = torch.randn(B, n, H, d, generator=gen, requires_grad=True)
    v = torch.randn(B, n, H, dv, generator=gen, requires_grad=True)
    buckets = torch.randint(0, k, (B, R * H, n), generator=gen)
    if padding:  # padded tokens carry bucket k in every round
        buckets[0, :, -3:] = k
        buckets[-1, :, 1] = k
    want = lsh_ops.lsh_attention(q, v, buckets, k, w, causal=causal)
    got = torch_lsh.lsh_attention(q, lsh_ops.shared_keys(q), v, buckets, k, w,
                                  causal=causal)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    cot = torch.randn(got.shape, generator=gen)
    grads_want = torch.autograd.grad((want * cot).sum(), [q, v])
    grads_got = torch.autograd.grad((got * cot).sum(), [q, v])
    for name, a, b in zip(("query", "value"), grads_got, grads_want):
        assert float(b.abs().max()) > 0
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5,
                                   err_msg=name)


@torch_only
@pytest.mark.parametrize("masked", [False, True])
def test_hash_equals_portable_hash(masked):
    """The kernel's hashing gives the portable buckets, bit for bit
    (including padding)."""
    import torch

    from keras_longattn.kernels.torch import lsh as torch_lsh
    from keras_longattn.ops import lsh as lsh_ops

    gen = torch.Generator().manual_seed(3)
    B, n, H, d, R, c = 3, 200, 3, 8, 2, 6
    x = torch.randn(B, n, H, d, generator=gen)
    x[0, 5] = 0.0  # a zero vector: every |x Rot| equal
    rot = torch.randn(R, c, H, d, generator=gen)
    valid = None
    if masked:
        valid = torch.ones(B, n, dtype=torch.bool)
        valid[1, 50:] = False
    want = lsh_ops.hash_buckets(x, rot, valid)
    old = torch_lsh.MAX_PROJECTION
    try:
        for limit in (old, B * n * c):  # all heads at once, one at a time
            torch_lsh.MAX_PROJECTION = limit
            got = torch_lsh.hash_buckets(x, rot, valid)
            assert got.dtype == torch.int32
            np.testing.assert_array_equal(got.numpy(), to_np(want))
    finally:
        torch_lsh.MAX_PROJECTION = old


@torch_only
def test_kernel_all_padding_and_half_precision():
    import torch

    from keras_longattn.kernels.torch import lsh as torch_lsh

    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    buckets = torch.full((1, 4, 8), 6)  # every token padding
    out = torch_lsh.lsh_attention(q, q, q, buckets, 6, 4)
    assert float(out.detach().abs().max()) == 0.0
    (grad,) = torch.autograd.grad(out.sum(), [q])
    assert float(grad.abs().max()) == 0.0
    half = torch.randn(1, 16, 2, 4).to(torch.bfloat16)
    buckets = torch.randint(0, 2, (1, 4, 16))
    out = torch_lsh.lsh_attention(half, half, half, buckets, 2, 4, causal=True)
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out.float()).all())


# -------------------------------------------------------------- the layer
LAYER_CASES = [
    # n, bucket_size, num_hashes, num_buckets, causal, padding
    (37, 4, 2, None, True, True),
    (37, 4, 2, None, False, True),
    (37, 4, 1, None, False, False),
    (37, 4, 1, 4, True, False),  # fixed buckets, larger than a chunk
    (101, 8, 3, None, True, False),
    (101, 8, 3, None, False, True),
    (130, 16, 4, 2, False, True),  # two buckets: many chunks each
]


def _weight_gradients(layer, x, call, cot):
    """Gradients of ``sum(layer(x, x) * cot)`` with respect to ``x`` and
    every trainable weight (torch autograd)."""
    import torch

    xt = torch.tensor(x, requires_grad=True)
    weights = [w.value for w in layer.trainable_weights]
    out = layer(xt, xt, **call)
    loss = (out * torch.tensor(cot)).sum()
    grads = torch.autograd.grad(loss, [xt] + weights, allow_unused=True)
    return [None if g is None else g.numpy() for g in grads]


@torch_only
@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_equals_hashed_values_and_all_gradients(case):
    """Same weights, same hash seed: values, the input gradient and the
    gradient of every weight equal the portable ``"hashed"`` path's."""
    n, bucket_size, num_hashes, num_buckets, causal, padding = case
    kwargs = {"num_heads": 2, "key_dim": 8, "bucket_size": bucket_size,
              "num_hashes": num_hashes, "num_buckets": num_buckets, "hash_seed": 3}
    x = _x(T=n)
    call = {"use_causal_mask": causal}
    mask = np.ones((2, n), bool)
    if padding:
        mask[0, n - n // 3:] = False
        mask[1, :3] = False
        mask[1, n // 2] = False
        call.update(query_mask=mask, value_mask=mask)
    layer = LSHAttention(implementation="hashed_torch", **kwargs)
    ref = LSHAttention(implementation="hashed", **kwargs)
    layer(x, x)
    ref(x, x)
    ref.set_weights(layer.get_weights())
    out = to_np(layer(x, x, **call))
    assert layer.last_implementation == "hashed_torch"
    want = to_np(ref(x, x, **call))
    assert ref.last_implementation == "hashed"
    assert rel_error(out[mask], want[mask]) < 1e-5
    np.testing.assert_allclose(out[~mask], 0.0, atol=0)
    cot = np.random.default_rng(7).standard_normal(out.shape).astype("float32")
    got = _weight_gradients(layer, x, call, cot)
    expected = _weight_gradients(ref, x, call, cot)
    names = ["input"] + [w.path for w in layer.trainable_weights]
    checked = 0
    for name, a, b in zip(names, got, expected):
        assert (a is None) == (b is None), name
        if b is None:
            continue
        if np.abs(b).max() > 0:
            checked += 1
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5, err_msg=name)
    # The input, the query, value and output kernels and biases at least.
    assert checked >= 5


@torch_only
def test_layer_bad_weights_are_caught():
    """The comparison above can fail: another hash seed gives other values."""
    x = _x(T=37)
    kwargs = {"num_heads": 2, "key_dim": 8, "bucket_size": 4, "num_hashes": 2}
    layer = LSHAttention(implementation="hashed_torch", hash_seed=3, **kwargs)
    ref = LSHAttention(implementation="hashed", hash_seed=4, **kwargs)
    layer(x, x)
    ref(x, x)
    ref.set_weights(layer.get_weights())
    assert rel_error(to_np(layer(x, x)), to_np(ref(x, x))) > 1e-3


@torch_only
@pytest.mark.parametrize("num_hashes", [1, 3])
def test_strictly_causal_by_perturbation_and_gradient(num_hashes):
    """Changing tokens from position t on changes no output before t (the
    buckets of the earlier tokens are their own), and the output at t has
    no gradient towards later inputs."""
    T, t = 90, 53
    x = _x(T=T)
    layer = LSHAttention(num_heads=2, key_dim=8, bucket_size=8, num_hashes=num_hashes,
                         num_buckets=6, hash_seed=1, implementation="hashed_torch")
    out = to_np(layer(x, x, use_causal_mask=True))
    y = x.copy()
    y[:, t:] = np.random.default_rng(5).standard_normal(y[:, t:].shape)
    out2 = to_np(layer(y, y, use_causal_mask=True))
    # Equal up to rounding: chunks may be batched differently in the kernel.
    np.testing.assert_allclose(out[:, :t], out2[:, :t], rtol=0, atol=1e-6)
    assert np.abs(out[:, t:] - out2[:, t:]).max() > 1e-2

    def at_t(v):
        return layer(v, v, use_causal_mask=True)[:, t]

    grad = input_gradient(at_t, x)
    assert np.abs(grad[:, : t + 1]).max() > 0
    assert np.abs(grad[:, t + 1:]).max() == 0.0


@torch_only
def test_padded_positions_do_not_matter():
    x = _x(T=45)
    mask = np.ones((2, 45), bool)
    mask[:, 33:] = False
    mask[0, 3] = False
    layer = LSHAttention(num_heads=2, key_dim=8, bucket_size=4, num_hashes=2,
                         hash_seed=0, implementation="hashed_torch")
    call = {"query_mask": mask, "value_mask": mask}
    out = to_np(layer(x, x, **call))
    y = x.copy()
    y[~mask] = 100.0 * np.random.default_rng(2).standard_normal(y[~mask].shape)
    out2 = to_np(layer(y, y, **call))
    np.testing.assert_allclose(out[mask], out2[mask], rtol=1e-6, atol=1e-6)


def test_auto_prefers_the_kernel_on_torch_only():
    layer = LSHAttention(num_heads=2, key_dim=8, bucket_size=4, hash_seed=0)
    x = _x(T=24)
    layer(x, x, use_causal_mask=True)
    if BACKEND == "torch":
        assert layer.last_implementation == "hashed_torch"
        assert layer.auto_order()[0] == "hashed_torch"
    else:
        assert layer.last_implementation == "hashed"
        explicit = LSHAttention(num_heads=2, key_dim=8, bucket_size=4, hash_seed=0,
                                implementation="hashed_torch")
        with pytest.raises(ValueError, match="hashed_torch: needs the torch backend"):
            explicit(x, x, use_causal_mask=True)


def test_kernel_refuses_dropout_in_training():
    layer = LSHAttention(num_heads=2, key_dim=8, bucket_size=4, hash_seed=0,
                         dropout=0.5, implementation="hashed_torch")
    x = _x(T=24)
    with pytest.raises(ValueError, match="hashed_torch: "):
        layer(x, x, use_causal_mask=True, training=True)


@torch_only
class TestLSHAttentionTorchKernel(AttentionLayerConformance):
    """The conformance suite on the kernel path."""

    layer_cls = LSHAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "bucket_size": 4, "num_hashes": 2,
                   "hash_seed": 3}
    implementation = "hashed_torch"
    supports_cross_attention = False  # shared queries and keys
    secondary = True
    reference_lengths = (16, 37, 300)


@torch_only
@pytest.mark.slow
def test_both_implementations_compiled_in_one_process():
    """Models of "hashed_torch" and then "hashed" under jit_compile=True in
    one process, at two lengths, predict the same as direct calls: dynamo
    once resumed the hashing of the second with its hash function as None
    (the hash function is now called by each implementation itself)."""
    rng = np.random.default_rng(0)
    for impl in ("hashed_torch", "hashed"):
        x_in = keras.Input((None, 16))
        m_in = keras.Input((None,), dtype="bool")
        layer = LSHAttention(num_heads=2, key_dim=8, bucket_size=4, num_hashes=2,
                             hash_seed=0, implementation=impl)
        model = keras.Model([x_in, m_in], layer(x_in, x_in, query_mask=m_in,
                                                value_mask=m_in, use_causal_mask=True))
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", jit_compile=True)
        for n in (13, 20):
            x = rng.standard_normal((4, n, 16)).astype("float32")
            mask = np.ones((4, n), bool)
            mask[1, n - 4:] = False
            pred = model.predict([x, mask], batch_size=2, verbose=0)
            direct = to_np(layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=True))
            np.testing.assert_allclose(pred[mask], direct[mask], rtol=1e-4, atol=1e-5)
