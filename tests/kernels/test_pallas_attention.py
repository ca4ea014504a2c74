"""The block-sparse Pallas kernel against dense attention, and the layers'
``implementation="pallas"`` against ``"reference"`` on the same weights.

JAX only (the kernel runs in Pallas interpret mode on the CPU); on the other
backends only the refusal of the path is checked. Sizes are small (n <= 100,
blocks of 16, head size 8) so that the interpreter stays quick.
"""

import keras
import numpy as np
import pytest

from keras_longattn.layers import BigBirdAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import LongformerAttention
from keras_longattn.layers import RoutingAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.ops import block_sparse as la_block_sparse
from keras_longattn.ops import layouts as la_layouts
from keras_longattn.ops import patterns as la_patterns
from keras_longattn.ops import sparse as la_sparse
from keras_longattn.testing import rel_error

ON_JAX = keras.backend.backend() == "jax"
jax_only = pytest.mark.skipif(not ON_JAX, reason="the Pallas kernel is JAX only")

TOL = 1e-5


def _modules():
    from keras_longattn.kernels.jax import pallas_attention

    return pallas_attention, la_block_sparse


def _dense(q, k, v, mask, scale):
    """Dense masked attention and its log-sum-exp, in jnp: ``mask``
    broadcastable to ``(B, H, T, S)``."""
    import jax.numpy as jnp

    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    s = jnp.where(mask, s, -1e30)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    seen = total > 0
    p = e / jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), -1e30)[..., 0]
    return jnp.einsum("bhts,bshd->bthd", p, v), jnp.transpose(lse, (0, 2, 1))


def _values_and_grads(fn, q, k, v, rows_seen, seed=0):
    """Output, lse and the gradients of a loss that uses both (the lse of
    rows that see a key), with respect to q, k, v."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    B, T, H = q.shape[:3]
    w_out = jnp.asarray(rng.standard_normal((B, T, H, v.shape[3])), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)

    def loss(q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(rows_seen, lse * w_lse, 0.0)), (out, lse)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, (out, lse)), grads = run(q, k, v)
    return [np.asarray(x) for x in (out, lse) + tuple(grads)]


def _random_qkv(B, T, S, H, d, dv, seed):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((B, T, H, d), (B, S, H, d), (B, S, H, dv))
    )


def _compare(kernel_fn, q, k, v, mask, scale):
    """The kernel's output, lse and input gradients equal the dense ones."""
    _, ref_lse = _dense(q, k, v, mask, scale)
    seen = np.asarray(ref_lse) > -1e29
    got = _values_and_grads(kernel_fn, q, k, v, seen)
    want = _values_and_grads(lambda q, k, v: _dense(q, k, v, mask, scale), q, k, v, seen)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(a)), f"{name}: not finite"
        if name == "lse":
            a, b = a[seen], b[seen]
        assert rel_error(a, b) < TOL, f"{name}: relative error {rel_error(a, b):.3g}"
    return got, seen


# ------------------------------------------------------------------ layouts
@jax_only
def test_default_interpret_on_cpu():
    import jax

    pa, _ = _modules()
    assert pa.default_interpret() == (jax.default_backend() == "cpu")


@jax_only
def test_layouts_cover_every_allowed_pair():
    """The layout of each arrangement holds every (query block, key block)
    pair with an allowed pair of tokens (brute force on positions), and the
    band layout holds no other."""
    pa, pl_layers = _modules()
    n, b = 37, 8

    def needed(q_pos, k_pos, allowed):
        nq, nk = -(-len(q_pos) // b), -(-len(k_pos) // b)
        out = np.zeros((nq, nk), bool)
        ok = allowed(np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :])
        for i, j in zip(*np.nonzero(ok)):
            out[i // b, j // b] = True
        return out

    band = la_layouts.band_layout(n, n, b, b, 5, 2).block_mask()[0]
    want = needed(range(n), range(n), lambda i, j: (j - i >= -5) & (j - i <= 2))
    np.testing.assert_array_equal(band, want)
    l, c = 5, 2
    cases = {
        "columns": lambda i, j: ((i - j) % l == 0) & (j <= i),
        "blocks": lambda i, j: (i // l == j // l) & (j <= i),
        "summary": lambda i, j: (j % l >= l - c) & (j <= i),
    }
    for kind, allowed in cases.items():
        q_order, k_order, layout = la_layouts.arrangement(kind, n, n, l, c, True, b)
        q_pos = np.arange(n) if q_order is None else q_order
        want = needed(q_pos, k_order, allowed)
        got = layout.block_mask()[0]
        assert not np.any(want & ~got), kind
        # Block-sparse, not dense: the arrangement pays off.
        assert got.sum() < got.size, kind


# ------------------------------------------------------------- the kernel
@jax_only
def test_kernel_causal_band_with_padding_and_empty_rows():
    """Causal band, T = S = 70 (not a multiple of the block), key padding:
    example 0 misses its first 12 keys (rows 0..11 see nothing), example 1
    has no real key at all (every row empty: zeros, finite gradients)."""
    import jax.numpy as jnp

    pa, _ = _modules()
    B, n, H, d = 2, 70, 2, 8
    q, k, v = _random_qkv(B, n, n, H, d, d, 0)
    look_back = 9
    pattern = la_patterns.LocalPattern(look_back, 0)
    valid = np.ones((B, n), bool)
    valid[0, :12] = False
    valid[1, :] = False
    layout = la_layouts.band_layout(n, n, 16, 16, look_back, 0)
    mask = np.asarray(pattern.dense_mask(n, n))[None, None] & valid[:, None, None, :]
    scale = 0.3

    def kernel(q, k, v):
        return pa.block_sparse_attention(q, k, v, layout, predicate=pattern,
                                         k_valid=jnp.asarray(valid), scale=scale)

    (out, lse, dq, dk, dv), seen = _compare(kernel, q, k, v, mask, scale)
    assert not seen[0, :12].any() and seen[0, 12:].all()
    np.testing.assert_array_equal(out[0, :12], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(lse[1], np.float32(pa.MASKED_LOGIT))
    for g in (dq[1], dk[1], dv[1], dk[0, :12], dv[0, :12]):
        np.testing.assert_array_equal(g, 0.0)


@jax_only
def test_kernel_bidirectional_cross_attention_unequal_blocks():
    """T != S, query blocks of 16 and key blocks of 32, a two-sided band
    with positions shifted (queries at 20..59 against keys at 0..74), value
    head size unlike the key's."""
    pa, _ = _modules()
    B, T, S, H = 1, 40, 75, 3
    q, k, v = _random_qkv(B, T, S, H, 8, 12, 1)
    pattern = la_patterns.LocalPattern(10, 6)
    q_pos = np.arange(20, 20 + T, dtype=np.int32)
    layout = la_layouts.band_layout(T, S, 16, 32, 10, 6, q_start=20)
    mask = np.asarray(pattern.allowed(q_pos[:, None], np.arange(S)[None, :]))[None, None]
    scale = 1 / np.sqrt(8)

    def kernel(q, k, v):
        return pa.block_sparse_attention(q, k, v, layout, predicate=pattern, q_pos=q_pos)

    _compare(kernel, q, k, v, mask, scale)


@jax_only
def test_kernel_on_reordered_tokens_keeps_positions():
    """Strided B (``(i - j) mod l == 0``, causal) on tokens sorted by column:
    the kernel sees the original positions, so it equals dense attention
    under the pattern once the output is put back in order."""
    import jax.numpy as jnp

    _, pl_layers = _modules()
    B, n, H, l = 2, 50, 1, 6
    q, k, v = _random_qkv(B, n, n, H, 8, 8, 2)
    pattern = la_sparse.StridedPattern(l) & la_patterns.CausalPattern()
    valid = np.ones((B, n), bool)
    valid[1, 31:] = False
    arranged = la_layouts.arrangement("columns", n, n, l, None, True, 16)
    mask = np.asarray(pattern.dense_mask(n, n))[None, None] & valid[:, None, None, :]
    scale = 1 / np.sqrt(8)

    def kernel(q, k, v):
        return la_block_sparse.arranged_attention(q, k, v, arranged, pattern,
                                            key_mask=jnp.asarray(valid), scale=scale)

    _compare(kernel, q, k, v, mask, scale)


def _example_block_masks(nq, nk, B, seed):
    rng = np.random.default_rng(seed)
    blocks = rng.random((B, nq, nk)) < 0.4
    blocks[0, 1, :] = False  # a query block that visits nothing
    return blocks


@jax_only
def test_kernel_per_example_layout_from_the_graph():
    """A layout made in the graph from a boolean block mask, one per example
    (as BigBird's random blocks), no predicate."""
    import jax.numpy as jnp

    pa, _ = _modules()
    B, n, H, b = 2, 64, 2, 16
    q, k, v = _random_qkv(B, n, n, H, 8, 8, 3)
    blocks = _example_block_masks(n // b, n // b, B, 3)
    layout = la_layouts.BlockLayout.from_block_mask(jnp.asarray(blocks), b, b)
    np.testing.assert_array_equal(layout.block_mask(), blocks)
    mask = np.repeat(np.repeat(blocks, b, axis=1), b, axis=2)[:, None]
    scale = 1 / np.sqrt(8)

    def kernel(q, k, v):
        return pa.block_sparse_attention(q, k, v, layout)

    (out, *_), _ = _compare(kernel, q, k, v, mask, scale)
    np.testing.assert_array_equal(out[0, b:2 * b], 0.0)


@jax_only
def test_planted_bug_dropped_key_block_is_caught():
    """The comparison can fail: a layout missing one needed key block
    (what a wrong layout builder would produce) differs from the dense
    attention by far more than the tolerance."""
    import jax.numpy as jnp

    pa, _ = _modules()
    B, n, H, b = 1, 64, 1, 16
    q, k, v = _random_qkv(B, n, n, H, 8, 8, 4)
    blocks = np.tril(np.ones((n // b, n // b), bool))[None]
    mask = np.tril(np.ones((n, n), bool))[None, None]
    causal = la_patterns.CausalPattern()

    def run(block_mask):
        layout = la_layouts.BlockLayout.from_block_mask(jnp.asarray(block_mask), b, b)
        return np.asarray(pa.block_sparse_attention(q, k, v, layout, predicate=causal)[0])

    want = np.asarray(_dense(q, k, v, mask, 1 / np.sqrt(8))[0])
    assert rel_error(run(blocks), want) < TOL
    dropped = blocks.copy()
    dropped[0, 3, 1] = False  # query block 3 no longer visits key block 1
    assert rel_error(run(dropped), want) > 1e-2


TILINGS = [
    # Query rows and key chunks of half a block in every kernel.
    dict(q_split=2, k_split=2, bwd_q_split=2, bwd_k_split=2),
    # Quarter-block key chunks forward, half-block key tiles backward.
    dict(q_split=1, k_split=4, bwd_q_split=1, bwd_k_split=2),
]


@jax_only
@pytest.mark.parametrize("splits", TILINGS, ids=["halves", "mixed"])
def test_kernel_split_tiles_equal_dense(splits):
    """Programs holding parts of a layout block (the tilings used on GPUs)
    compute the same values and gradients: a causal band with padding and
    a per-example layout from the graph."""
    import jax.numpy as jnp

    pa, _ = _modules()
    tiling = pa.Tiling(**splits)
    B, n, H, b = 2, 64, 2, 16
    q, k, v = _random_qkv(B, n, n, H, 8, 8, 7)
    pattern = la_patterns.LocalPattern(11, 0)
    valid = np.ones((B, n), bool)
    valid[0, :5] = False
    mask = np.asarray(pattern.dense_mask(n, n))[None, None] & valid[:, None, None, :]
    layout = la_layouts.band_layout(n, n, b, b, 11, 0)

    def band(q, k, v):
        return pa.block_sparse_attention(q, k, v, layout, predicate=pattern,
                                         k_valid=jnp.asarray(valid), tiling=tiling)

    _compare(band, q, k, v, mask, 1 / np.sqrt(8))
    blocks = _example_block_masks(n // b, n // b, B, 8)
    per_example = la_layouts.BlockLayout.from_block_mask(jnp.asarray(blocks), b, b)
    dense = np.repeat(np.repeat(blocks, b, axis=1), b, axis=2)[:, None]

    def graph_layout(q, k, v):
        return pa.block_sparse_attention(q, k, v, per_example, tiling=tiling)

    _compare(graph_layout, q, k, v, dense, 1 / np.sqrt(8))


@jax_only
def test_tiling_arguments_are_checked():
    pa, _ = _modules()
    with pytest.raises(ValueError, match="q_split"):
        pa.Tiling(q_split=0)
    with pytest.raises(ValueError, match="num_warps"):
        pa.Tiling(num_warps=2.5)
    q, k, v = _random_qkv(1, 32, 32, 1, 8, 8, 9)
    layout = la_layouts.band_layout(32, 32, 16, 16, 4, 4)
    with pytest.raises(ValueError, match="k_split"):
        pa.block_sparse_attention(q, k, v, layout, tiling=pa.Tiling(k_split=3))
    with pytest.raises(ValueError, match="tiling"):
        pa.block_sparse_attention(q, k, v, layout, tiling={"q_split": 2})


@jax_only
def test_layout_must_cover_the_sequence():
    pa, _ = _modules()
    q, k, v = _random_qkv(1, 40, 40, 1, 8, 8, 5)
    layout = la_layouts.band_layout(32, 40, 16, 16, 4, 4)
    with pytest.raises(ValueError, match="layout"):
        pa.block_sparse_attention(q, k, v, layout)


# ---------------------------------------------------------------- layers
LAYER_CASES = [
    (LocalAttention, {"window": 9}, 70, True),
    (LocalAttention, {"window": 9}, 70, False),
    (SparseAttention, {"pattern": "strided", "block_length": 7}, 60, True),
    (SparseAttention, {"pattern": "fixed", "block_length": 8, "summary_width": 2,
                       "combination": "merged"}, 60, False),
    (BigBirdAttention, {"block_size": 16, "window_blocks": 3, "global_blocks": 1,
                        "random_blocks": 1, "seed": 3}, 100, True),
    # Heads with dilations 1 and 2, global tokens per example from a mask
    # (one of them padded), global projections.
    (LongformerAttention, {"window": 6, "dilation": (1, 2), "max_global": 3}, 50, True),
    # One local head and two routing heads, balanced clusters in causal mode.
    (RoutingAttention, {"num_clusters": 4, "local_heads": 1, "causal_routing": "balanced"},
     60, True),
]


@jax_only
@pytest.mark.parametrize(
    "layer_cls, kwargs, n, causal", LAYER_CASES,
    ids=[f"{c.__name__}-{'-'.join(map(str, kw.values()))}-{'causal' if ca else 'bidir'}"
         for c, kw, _, ca in LAYER_CASES],
)
def test_layer_pallas_equals_reference(layer_cls, kwargs, n, causal):
    """implementation="pallas" equals "reference" on the same weights:
    outputs of real queries and gradients with respect to the input, with
    padded keys and queries (example 0 loses its first 5 tokens, example 1
    its last third)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(6)
    B, F = 2, 16
    x = rng.standard_normal((B, n, F)).astype("float32")
    mask = np.ones((B, n), bool)
    mask[0, :5] = False
    mask[1, n - n // 3:] = False
    heads = 3 if layer_cls is RoutingAttention else 2
    reference = layer_cls(num_heads=heads, key_dim=8, implementation="reference", **kwargs)
    reference(x, x)
    pallas = layer_cls(num_heads=heads, key_dim=8, implementation="pallas", **kwargs)
    pallas(x, x)
    pallas.set_weights(reference.get_weights())
    weights = jnp.asarray(rng.standard_normal((B, n, F)), jnp.float32)
    extra = {}
    if layer_cls is LongformerAttention:
        global_mask = np.zeros((B, n), bool)
        global_mask[0, [7, 30]] = True
        global_mask[1, [3, n - 2]] = True  # n - 2 is padding
        extra["global_mask"] = global_mask

    def loss(layer):
        def fn(x):
            out = layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal,
                        **extra)
            return jnp.sum(jnp.where(mask[..., None], out * weights, 0.0)), out
        # One compiled program (eager JAX would compile every small op).
        return jax.jit(jax.value_and_grad(fn, has_aux=True))(jnp.asarray(x))

    (_, out), grad = loss(pallas)
    assert pallas.last_implementation == "pallas"
    (_, want), want_grad = loss(reference)
    out, want = np.asarray(out)[mask], np.asarray(want)[mask]
    assert rel_error(out, want) < TOL
    assert rel_error(np.asarray(grad), np.asarray(want_grad)) < TOL


@jax_only
def test_auto_never_picks_pallas_on_cpu():
    import jax

    layer = LocalAttention(num_heads=2, key_dim=8, window=4)
    if jax.default_backend() == "cpu":
        assert "pallas" not in layer.auto_order()
        assert layer.select_implementation(use_causal_mask=True) != "pallas"


@jax_only
def test_auto_tries_pallas_only_where_a_device_proved_it(monkeypatch):
    """On an accelerator, "auto" puts the Pallas path first only for a
    vendor with a current proof (or where the trust variable names it).
    The trust rules in full: tests/kernels/test_trust_48.py."""
    from keras_longattn.kernels import proven

    layer = LocalAttention(num_heads=2, key_dim=8, window=4)
    monkeypatch.setattr(proven, "active_vendor", lambda backend: "testvendor")
    monkeypatch.setattr(proven, "_WARNED", set())
    monkeypatch.delenv(proven.TRUST_VARIABLE, raising=False)
    assert "pallas" not in layer.auto_order()
    current = {"sources": proven.source_hashes("pallas")}
    monkeypatch.setitem(proven.PROVEN, ("jax", "testvendor"), {"pallas": current})
    assert layer.auto_order()[0] == "pallas"
    # A proof whose sources changed since is not relied on (and says so).
    stale = dict(current["sources"], **{"keras_longattn/ops/layouts.py": "0" * 64})
    monkeypatch.setitem(proven.PROVEN, ("jax", "testvendor"), {"pallas": {"sources": stale}})
    with pytest.warns(UserWarning, match="not today's"):
        assert "pallas" not in layer.auto_order()
    monkeypatch.setitem(proven.PROVEN, ("jax", "testvendor"), {"pallas": current})
    assert layer.select_implementation(use_causal_mask=True) == "pallas"
    monkeypatch.delitem(proven.PROVEN, ("jax", "testvendor"))
    monkeypatch.setenv(proven.TRUST_VARIABLE, "pallas")
    assert layer.auto_order()[0] == "pallas"
    # Never on the CPU, whatever the variable says.
    monkeypatch.setattr(proven, "active_vendor", lambda backend: None)
    assert "pallas" not in layer.auto_order()


@pytest.mark.skipif(ON_JAX, reason="checks the refusal off the JAX backend")
@pytest.mark.parametrize("layer_cls, kwargs, n, causal", LAYER_CASES[:1])
def test_pallas_refused_off_jax(layer_cls, kwargs, n, causal):
    layer = layer_cls(num_heads=2, key_dim=8, implementation="pallas", **kwargs)
    x = np.zeros((1, n, 16), "float32")
    with pytest.raises(ValueError, match="JAX backend"):
        layer(x, x, use_causal_mask=causal)
    auto = layer_cls(num_heads=2, key_dim=8, **kwargs)
    auto(x, x, use_causal_mask=causal)
    assert auto.last_implementation != "pallas"


@jax_only
def test_routing_refuses_what_the_kernel_lacks():
    x = np.zeros((1, 16, 16), "float32")
    for kwargs, causal, reason in (
        ({"shared_qk": True}, False, "shared_qk"),
        ({"causal_routing": "token"}, True, "token"),
    ):
        layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=2,
                                 implementation="pallas", **kwargs)
        with pytest.raises(ValueError, match=reason):
            layer(x, x, use_causal_mask=causal)
