"""BigBirdAttention: the conformance suite, the block pattern against a plain
NumPy loop, random blocks per example, short inputs and argument errors.

CI budget: one conformance class (blocks of 4: 10 blocks at n = 37, one
global block, two random blocks) and a secondary fused class; the layer
tests reuse n = 37 and batch 2 where they can (JAX compiles every new
shape).
"""

import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import BigBirdAttention
from keras_longattn.ops import bigbird as la_bigbird
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error

N = 37  # the conformance suite's short length
CONFIG = {"num_heads": 2, "key_dim": 8, "block_size": 4, "window_blocks": 3,
          "global_blocks": 1, "random_blocks": 2, "seed": 3}


# ------------------------------------------------------------ conformance
class TestBigBirdAttention(AttentionLayerConformance):
    """Blocks of 4 (37 is not a multiple), one global block, two random
    blocks per query block."""

    layer_cls = BigBirdAttention
    init_kwargs = CONFIG
    implementation = "blocked"
    reference_lengths = (37,)


class TestBigBirdAttentionFused(AttentionLayerConformance):
    """The fused path (preferred by "auto" on PyTorch)."""

    layer_cls = BigBirdAttention
    init_kwargs = CONFIG
    implementation = "blocked_fused"
    secondary = True
    reference_lengths = (37,)


@pytest.mark.slow
class TestBigBirdAttentionLong(AttentionLayerConformance):
    """The default blocks at a long length (causal only), 32 blocks of 64."""

    layer_cls = BigBirdAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "seed": 0}
    implementation = "blocked"
    secondary = True
    reference_lengths = (2048,)


# ---------------------------------------------------------------- helpers
def _inputs(n=N, batch=2, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, n, 16)).astype("float32")


def _pair(implementation="blocked", **overrides):
    """A layer and its reference on the same weights."""
    kwargs = {**CONFIG, **overrides}
    layer = BigBirdAttention(implementation=implementation, **kwargs)
    ref = BigBirdAttention(implementation="reference", **kwargs)
    x = _inputs()
    layer(x, x)
    ref(x, x)
    ref.set_weights(layer.get_weights())
    return layer, ref


def _score(seed, i, j):
    """The documented hash of ops.bigbird.block_scores, in Python ints
    wrapped to int32 (arithmetic shifts, as every backend computes them)."""
    def wrap(v):
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= 1 << 31 else v

    h = wrap(seed * 0x9E3779B1) ^ wrap(i * 0x85EBCA77) ^ wrap(j * 0xC2B2AE3D)
    h ^= h >> 16
    h = wrap(h * 0x85EBCA6B)
    h ^= h >> 13
    h = wrap(h * 0xC2B2AE35)
    h ^= h >> 16
    return ((h & 0x3FFF) << 17) + j


def _loop_pattern(T, S, b, w, g, r, seed, causal, used=None):
    """The specification as plain loops: which keys each query sees."""
    nq, nk = -(-T // b), -(-S // b)
    used = nk if used is None else used
    half = w // 2
    blocks = np.zeros((nq, nk), bool)
    for i in range(nq):
        if i < g:
            blocks[i, :] = True
            continue
        for j in range(nk):
            if j < g or abs(j - i) <= half:
                blocks[i, j] = True
        scores = [_score(seed, i, j) for j in range(nk)]
        candidates = [
            j for j in range(min(used, nk))
            if j >= g and (j < i - half if causal else abs(j - i) > half)
        ]
        candidates.sort(key=lambda j: -scores[j])
        for j in candidates[:r]:
            blocks[i, j] = True
    mask = np.zeros((T, S), bool)
    for t in range(T):
        for s in range(S):
            mask[t, s] = blocks[t // b, s // b] and (s <= t or not causal)
    return mask


# ---------------------------------------------------------------- pattern
@pytest.mark.parametrize("causal", [False, True])
def test_pattern_matches_numpy_loop(causal):
    """The pattern object, the dense mask of the reference with padding
    (random blocks from each example's real length) and a plain loop."""
    for T, S, b, w, g, r, seed in ((37, 37, 4, 3, 1, 2, 3), (13, 21, 2, 5, 2, 3, 7),
                                   (20, 20, 3, 1, 0, 4, 0)):
        pattern = la_bigbird.BigBirdPattern(b, w, g, r, seed, causal, T, S)
        expected = _loop_pattern(T, S, b, w, g, r, seed, causal)
        np.testing.assert_array_equal(to_np(pattern.dense_mask(T, S)), expected)
    key_mask = np.ones((2, N), bool)
    key_mask[1, 25:] = False  # 7 blocks in use
    dense = to_np(la_bigbird.dense_mask(N, N, 4, 3, 1, 2, 3, causal, key_mask=key_mask))
    np.testing.assert_array_equal(dense[0], _loop_pattern(N, N, 4, 3, 1, 2, 3, causal))
    np.testing.assert_array_equal(
        dense[1], _loop_pattern(N, N, 4, 3, 1, 2, 3, causal, used=7))


def test_pattern_is_sparse_and_seeded():
    pattern = la_bigbird.BigBirdPattern(4, 3, 1, 2, 3, False, 64, 64)
    blocks = pattern.block_mask()
    assert blocks.sum(axis=1)[1:].max() <= 3 + 1 + 2  # window + global + random
    assert not blocks.all()
    other = la_bigbird.BigBirdPattern(4, 3, 1, 2, 4, False, 64, 64).block_mask()
    assert not np.array_equal(blocks, other)  # another seed, other random blocks
    np.testing.assert_array_equal(
        blocks, la_bigbird.BigBirdPattern(4, 3, 1, 2, 3, False, 64, 64).block_mask())


def test_seed_is_drawn_once_and_kept_in_the_config():
    layer = BigBirdAttention(num_heads=2, key_dim=8)
    seed = layer.get_config()["seed"]
    assert isinstance(seed, int) and seed >= 0
    again = BigBirdAttention.from_config(layer.get_config())
    assert again.seed == seed


# -------------------------------------------------------------- behaviour
def test_example_is_the_same_alone_and_padded_in_a_batch():
    """Random blocks come from the example's own number of blocks: its
    outputs do not depend on the padding of its batch (both modes)."""
    layer, _ = _pair()
    x = _inputs()
    n = 25
    mask = np.ones((2, N), bool)
    mask[0, n:] = False
    for causal in (False, True):
        batch = to_np(layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal))
        alone = to_np(layer(x[:1, :n], x[:1, :n], use_causal_mask=causal))
        assert rel_error(batch[0, :n], alone[0]) < 1e-5


@pytest.mark.parametrize("implementation", ["blocked", "blocked_fused"])
def test_short_inputs_take_the_same_path(implementation, monkeypatch):
    """Fewer blocks than window + global + random: the block path still
    runs (no silent full attention) and equals the reference."""
    calls = []
    original = la_bigbird.bigbird_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("fused"))
        return original(*args, **kwargs)

    layer, ref = _pair(implementation=implementation)
    monkeypatch.setattr(la_bigbird, "bigbird_attention", spy)
    x = _inputs(n=5)
    for causal in (False, True):
        out = to_np(layer(x, x, use_causal_mask=causal))
        assert layer.last_implementation == implementation
        np.testing.assert_allclose(out, to_np(ref(x, x, use_causal_mask=causal)),
                                   rtol=1e-5, atol=1e-5)
    assert calls == [implementation == "blocked_fused"] * 2
    # A short sequence is not full attention when its pattern is not.
    pattern = la_bigbird.BigBirdPattern(4, 3, 0, 0, 0, False, 13, 13)
    assert not to_np(pattern.dense_mask(13, 13)).all()


def test_auto_runs_a_block_path():
    layer, _ = _pair(implementation="auto")
    x = _inputs()
    layer(x, x)
    assert layer.last_implementation in ("blocked", "blocked_fused")


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "name, value",
    [("block_size", 0), ("block_size", 2.5), ("window_blocks", 0),
     ("window_blocks", 2), ("window_blocks", True), ("global_blocks", -1),
     ("random_blocks", -1), ("random_blocks", 1.0), ("seed", -1), ("seed", "a")],
)
def test_bad_arguments_name_the_argument(name, value):
    with pytest.raises(ValueError, match=f"Received: {name}={value!r}"):
        BigBirdAttention(**{**CONFIG, name: value})
