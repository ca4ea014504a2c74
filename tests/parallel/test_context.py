"""Context parallelism (keras_longattn.parallel.context) on 8 simulated
devices: ring attention equals the dense reference, halo local attention
the one-device blocked band and halo strided attention the one-device
strided Sparse Transformer op, values and gradients, causal and not, with
padding; the halo's traffic does not grow with the sequence, the ring's
does; per-device memory falls with the devices; bad arguments are refused.

Tolerance: float32, 1e-5 absolute on values and gradients.
"""

import keras
import numpy as np
import pytest

from keras_longattn.parallel import causal_schedule
from keras_longattn.parallel import context_parallel_refusal
from keras_longattn.parallel import halo_local_attention
from keras_longattn.parallel import halo_longformer_attention
from keras_longattn.parallel import halo_strided_attention
from keras_longattn.parallel import ring_attention
from keras_longattn.parallel import zigzag_order

B, T, H, D = 2, 64, 2, 8
ATOL = 1e-5


def _inputs(length=T, seed=0):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, length, H, D)).astype("float32"))
               for _ in range(3))
    mask = np.ones((B, length), bool)
    mask[1, length - 13:] = False  # right padding on the second example
    mask[0, 5:9] = False  # a gap in the middle of the first
    return q, k, v, jnp.asarray(mask)


def _mesh(shape=(2, 4), names=("batch", "sequence")):
    return keras.distribution.DeviceMesh(shape, names, keras.distribution.list_devices()[:8])


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=1e-5)


def _grads(fn, q, k, v):
    import jax
    import jax.numpy as jnp

    return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("causal,load_balance", [(False, True), (True, True), (True, False)])
def test_ring_equals_reference(devices, causal, load_balance):
    import jax
    import jax.numpy as jnp

    from keras_longattn.ops import reference_attention

    q, k, v, km = _inputs()
    mask = km[:, None, :]
    if causal:
        mask = jnp.logical_and(mask, jnp.tril(jnp.ones((T, T), bool))[None])
    mesh = _mesh()

    def ring(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, sequence_axis="sequence", batch_axis="batch",
                              causal=causal, key_mask=km, load_balance=load_balance)

    def dense(q, k, v):
        return reference_attention(q, k, v, mask=mask)

    _close(jax.jit(ring)(q, k, v), jax.jit(dense)(q, k, v))
    for got, want in zip(_grads(ring, q, k, v), _grads(dense, q, k, v)):
        _close(got, want)


def test_ring_heads_sharded_and_cross_lengths(devices):
    """Heads on one mesh axis, sequence on the other; keys longer than the
    queries (not causal)."""
    import jax.numpy as jnp

    from keras_longattn.ops import reference_attention

    q = _inputs(32)[0]
    _, k, v, km = _inputs(64, seed=1)
    mesh = _mesh((2, 4), ("heads", "sequence"))
    out = ring_attention(q, k, v, mesh=mesh, sequence_axis="sequence", head_axis="heads",
                         key_mask=km)
    _close(out, reference_attention(q, k, v, mask=km[:, None, :]))
    assert out.dtype == jnp.float32


def test_causal_schedule_is_exact_and_balanced():
    """The sub-blocks a causal ring pass computes: exactly those holding a
    visible (query, key) pair, and as many on every device (zigzag)."""
    for length, num in ((16, 2), (64, 4), (128, 8)):
        table = causal_schedule(length, num)
        order, _ = zigzag_order(length, num)
        chunks = order.reshape(num, 2, -1)
        for step in range(num):
            for device in range(num):
                source = (device - step) % num
                for a in range(2):
                    for c in range(2):
                        pairs = chunks[device, a][:, None] >= chunks[source, c][None, :]
                        assert table[step, device, a, c] == pairs.any()
        per_device = table.sum(axis=(0, 2, 3))
        assert (per_device == per_device[0]).all(), per_device
        # Half the work of the non-causal pass, plus the diagonal blocks.
        assert per_device[0] == 2 * num + 1


@pytest.mark.parametrize("look_back,look_ahead", [(7, 0), (3, 5), (8, 8)])
def test_halo_equals_one_device(devices, look_back, look_ahead):
    import jax

    from keras_longattn.ops import local_attention

    q, k, v, km = _inputs()
    mesh = _mesh()

    def halo(q, k, v):
        return halo_local_attention(q, k, v, mesh=mesh, sequence_axis="sequence",
                                    batch_axis="batch", look_back=look_back,
                                    look_ahead=look_ahead, key_mask=km)

    def band(q, k, v):
        return local_attention(q, k, v, look_back, look_ahead, key_mask=km)

    _close(jax.jit(halo)(q, k, v), jax.jit(band)(q, k, v))
    for got, want in zip(_grads(halo, q, k, v), _grads(band, q, k, v)):
        _close(got, want)


@pytest.mark.parametrize("causal,dilation,global_tokens,shape",
                         [(False, (1, 2), 3, (2, 4)), (True, (1, 2), 3, (2, 4)),
                          (True, 1, 0, (2, 4)), (False, 2, 3, (1, 1))])
def test_halo_longformer_equals_one_device(devices, causal, dilation, global_tokens, shape):
    """Window (dilated per head), global keys and global rows with their own
    projections, padding: equal to the one-device Longformer op."""
    import jax
    import jax.numpy as jnp

    from keras_longattn.ops.longformer import global_slots, longformer_attention

    q, k, v, km = _inputs()
    _, kg, vg, _ = _inputs(seed=1)
    g = global_tokens
    mesh = keras.distribution.DeviceMesh(shape, ("batch", "sequence"),
                                         keras.distribution.list_devices()[:shape[0] * shape[1]])

    def halo(q, k, v, kg, vg):
        return halo_longformer_attention(
            q, k, v, mesh=mesh, sequence_axis="sequence", batch_axis="batch", window=4,
            dilation=dilation, causal=causal, global_tokens=g,
            global_query=q[:, :g] * 0.5 if g else None, global_key=kg, global_value=vg,
            key_mask=km)

    def one(q, k, v, kg, vg):
        return longformer_attention(
            q, k, v, 4, dilation=dilation, causal=causal,
            slots=global_slots(T, T, global_tokens=g) if g else None,
            global_query=q[:, :g] * 0.5 if g else None, global_key=kg if g else None,
            global_value=vg if g else None, key_mask=km)

    _close(jax.jit(halo)(q, k, v, kg, vg), jax.jit(one)(q, k, v, kg, vg))
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3, 4)))(
        q, k, v, kg, vg) for f in (halo, one)]
    for got, want in zip(*grads):
        _close(got, want)


@pytest.mark.parametrize("combination,causal", [("multihead", True), ("second", False)])
def test_halo_strided_equals_one_device(devices, combination, causal):
    """Strided Sparse Transformer attention: the window from the halo, the
    columns from an all-to-all; "merged" is covered by
    tests/parallel/test_layers_context.py."""
    import jax

    from keras_longattn.ops.sparse import sparse_attention

    q, k, v, km = _inputs()
    mesh = _mesh()

    def halo(q, k, v):
        return halo_strided_attention(q, k, v, mesh=mesh, sequence_axis="sequence",
                                      batch_axis="batch", stride=8, combination=combination,
                                      causal=causal, key_mask=km)

    def one(q, k, v):
        return sparse_attention(q, k, v, pattern="strided", block_length=8,
                                combination=combination, causal=causal, key_mask=km)

    _close(jax.jit(halo)(q, k, v), jax.jit(one)(q, k, v))
    for got, want in zip(_grads(halo, q, k, v), _grads(one, q, k, v)):
        _close(got, want)


def test_halo_strided_traffic_is_the_window_and_the_own_block(devices):
    """What halo strided attention sends per device (forward, traced
    program): the window's halo (7 keys, values and mask) and, for the
    columns, its own block of queries, keys, values and mask out and of
    outputs and log-sum-exps back (two all-to-alls): O(w + n / P), not the
    O(n) keys of an all-gather."""
    import jax
    import jax.numpy as jnp

    from keras_longattn.parallel.measure import jaxpr_collective_bytes

    mesh = _mesh((8,), ("sequence",))
    row = B * H * D * 4
    for n in (128, 256):
        x = jnp.zeros((B, n, H, D), jnp.float32)
        mask = jnp.ones((B, n), bool)

        def fn(q, k, v, mask=mask):
            return halo_strided_attention(q, k, v, mesh=mesh, sequence_axis="sequence",
                                          stride=8, causal=True, key_mask=mask)

        block = n // 8
        halo = 7 * row * 2 + 7 * B
        columns = block * row * 3 + block * B + block * row + block * B * H * 4
        assert jaxpr_collective_bytes(jax.make_jaxpr(fn)(x, x, x)) == halo + columns


def test_halo_traffic_is_the_window_and_ring_traffic_the_sequence(devices):
    """Bytes the collectives move per device, forward + backward, from the
    compiled programs: constant in n for the halo, growing with n for the
    ring; per-device temporary memory of the halo falls with the devices."""
    from keras_longattn.parallel.measure import scaling_rows

    small = {(r["kind"], r["devices"]): r for r in scaling_rows(
        length=512, devices=(1, 2, 8), heads=2, head_dim=8, window=16)}
    large = {(r["kind"], r["devices"]): r for r in scaling_rows(
        length=2048, devices=(8,), heads=2, head_dim=8, window=16)}
    assert small[("local", 1)]["collective_bytes"] == 0
    # On one device only the sum of the (replicated) global queries'
    # gradient is left: 16 global tokens x 2 heads x 8 x float32.
    assert small[("longformer", 1)]["collective_bytes"] == 16 * 2 * 8 * 4
    halo = small[("local", 8)]["collective_bytes"]
    assert halo > 0
    assert large[("local", 8)]["collective_bytes"] == halo
    # Causal window 16: 15 keys and values (float32, 2 heads of 8) and their
    # mask forward, the keys' and values' gradients backward.
    row = 2 * 8 * 4
    assert halo == 15 * row * 2 + 15 + 15 * row * 2
    # Longformer: the same at both lengths (window halo, global tokens).
    assert large[("longformer", 8)]["collective_bytes"] == small[("longformer", 8)][
        "collective_bytes"] > 0
    ring_small = small[("full", 8)]["collective_bytes"]
    # 7 ring steps of a 64-token block: keys, values, positions (int32) and
    # mask forward; the keys' and values' gradients backward.
    assert ring_small == 7 * (64 * row * 2 + 64 * 4 + 64) + 7 * (64 * row * 2)
    assert large[("full", 8)]["collective_bytes"] >= 3.5 * ring_small
    for kind in ("local", "longformer"):
        memory = [small[(kind, p)]["temp_bytes"] for p in (1, 2, 8)]
        assert memory[1] < 0.7 * memory[0] and memory[2] < 0.3 * memory[0], (kind, memory)


def test_zigzag_order():
    order, inverse = zigzag_order(16, 4)
    assert order.tolist()[:4] == [0, 1, 14, 15]
    assert order.tolist()[4:8] == [2, 3, 12, 13]
    assert (order[inverse] == np.arange(16)).all()
    with pytest.raises(ValueError, match="length=10"):
        zigzag_order(10, 4)


def test_refusals(devices):
    q, k, v, km = _inputs()
    mesh = _mesh((8,), ("sequence",))
    with pytest.raises(ValueError, match="sequence_axis.*'seq'"):
        ring_attention(q, k, v, mesh=mesh, sequence_axis="seq")
    with pytest.raises(TypeError, match="mesh"):
        ring_attention(q, k, v, mesh="mesh", sequence_axis="sequence")
    with pytest.raises(ValueError, match="multiple of 16.*length 40"):
        ring_attention(q[:, :40], k[:, :40], v[:, :40], mesh=mesh, sequence_axis="sequence",
                       causal=True)
    with pytest.raises(ValueError, match="same length"):
        ring_attention(q[:, :32], k, v, mesh=mesh, sequence_axis="sequence", causal=True)
    with pytest.raises(ValueError, match="key_mask"):
        ring_attention(q, k, v, mesh=mesh, sequence_axis="sequence", key_mask=km[:, :8])
    with pytest.raises(ValueError, match="query.shape"):
        ring_attention(q[0], k, v, mesh=mesh, sequence_axis="sequence")
    with pytest.raises(ValueError, match="8 positions.*look_back=9"):
        halo_local_attention(q, k, v, mesh=mesh, sequence_axis="sequence", look_back=9)
    with pytest.raises(ValueError, match="reach 16.*window=16"):
        halo_longformer_attention(q, k, v, mesh=mesh, sequence_axis="sequence", window=16,
                                  causal=True)
    with pytest.raises(ValueError, match="first device.*global_tokens=9"):
        halo_longformer_attention(q, k, v, mesh=mesh, sequence_axis="sequence", window=4,
                                  global_tokens=9)
    with pytest.raises(ValueError, match="global_query.shape"):
        halo_longformer_attention(q, k, v, mesh=mesh, sequence_axis="sequence", window=4,
                                  global_tokens=2, global_query=q[:, :3])
    with pytest.raises(ValueError, match="multiple of the 8 devices.*stride=4"):
        halo_strided_attention(q, k, v, mesh=mesh, sequence_axis="sequence", stride=4)
    with pytest.raises(ValueError, match="8 positions.*multiple of the stride.*stride=16"):
        halo_strided_attention(q, k, v, mesh=mesh, sequence_axis="sequence", stride=16)
    with pytest.raises(ValueError, match="stride=0"):
        halo_strided_attention(q, k, v, mesh=mesh, sequence_axis="sequence", stride=0)
    with pytest.raises(ValueError, match="combination"):
        halo_strided_attention(q, k, v, mesh=mesh, sequence_axis="sequence", stride=8,
                               combination="both")
    with pytest.raises(ValueError, match="look_ahead=-1"):
        halo_local_attention(q, k, v, mesh=mesh, sequence_axis="sequence", look_back=2,
                             look_ahead=-1)


def test_other_backends_refuse():
    assert context_parallel_refusal("jax") is None
    for backend in ("tensorflow", "torch"):
        assert "JAX backend only" in context_parallel_refusal(backend)
    if keras.backend.backend() != "jax":
        x = np.zeros((1, 8, 1, 4), "float32")
        with pytest.raises(NotImplementedError, match="JAX backend only"):
            ring_attention(x, x, x, mesh=None, sequence_axis="sequence")
