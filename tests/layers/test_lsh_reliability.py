"""LSHAttention's reliability: one bucket count for every call (causal
outputs of a prefix equal the first outputs of the longer sequence; an
example's outputs do not depend on its batch), hash seeds reproducible under
``keras.utils.set_random_seed`` and kept by config and ``.keras`` round
trips, float32 hashing under mixed precision (its distance to float32 on
the same weights) and the efficient paths equal to the reference."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.kernels import backend_ops
from keras_longattn.layers import LSHAttention
from keras_longattn.ops import lsh as lsh_ops
from keras_longattn.testing import rel_error

KWARGS = {"num_heads": 2, "key_dim": 8, "bucket_size": 4, "num_hashes": 2, "hash_seed": 3}
BACKEND = keras.backend.backend()
EFFICIENT = ("hashed", "hashed_torch") if BACKEND == "torch" else ("hashed",)


def _x(B=2, T=33, F=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, F)).astype("float32")


def _layer(**kwargs):
    return LSHAttention(**dict(KWARGS, **kwargs))


def _twin(layer, x, **kwargs):
    """A layer of ``layer``'s config with ``kwargs`` changed and its weights."""
    other = LSHAttention.from_config(dict(layer.get_config(), **kwargs))
    other.build(x.shape, x.shape)
    other.set_weights(layer.get_weights())
    return other


# ------------------------------------------------------- prefix consistency
@pytest.mark.parametrize("built_at", ["long", "short"])
@pytest.mark.parametrize("num_buckets", [None, 6])
@pytest.mark.parametrize("implementation", ["auto", "hashed", "reference"])
def test_causal_prefix_equals_the_longer_sequence(implementation, num_buckets, built_at):
    """The outputs of a causal call on the first ``m`` tokens equal the first
    ``m`` outputs of the call on all of them, whichever length the layer
    was built with: the bucket count does not follow the call's length."""
    x = _x(T=33)
    layer = _layer(implementation=implementation, num_buckets=num_buckets)
    first = x[:, :7] if built_at == "short" else x
    layer(first, first, use_causal_mask=True)
    full = to_np(layer(x, x, use_causal_mask=True))
    for m in (2, 7, 20, 32):
        prefix = to_np(layer(x[:, :m], x[:, :m], use_causal_mask=True))
        err = rel_error(prefix, full[:, :m])
        assert err <= 1e-5, f"prefix of {m} of 33: relative error {err:.3g}"


def test_bucket_count_is_fixed_at_build_and_reported():
    """``num_buckets=None`` becomes ``2 * ceil(n / (2 * bucket_size))`` of the
    build length, kept for every later length and in ``get_config``; a
    layer built without a known length fixes it at its first call."""
    layer = _layer(num_hashes=1)
    assert layer.get_config()["num_buckets"] is None
    layer(_x(T=37), _x(T=37))
    assert layer.get_config()["num_buckets"] == 10
    long = _x(B=1, T=200)
    buckets = to_np(layer.buckets(long))
    assert buckets.max() < 10 and len(np.unique(buckets)) > 5
    assert layer.num_buckets == 10
    late = _layer()
    late.build((None, None, 16), (None, None, 16))
    assert late.num_buckets is None
    late(_x(T=20), _x(T=20))
    assert late.get_config()["num_buckets"] == 6
    late(_x(T=64), _x(T=64))
    assert late.num_buckets == 6


@pytest.mark.parametrize("causal", [True, False])
def test_example_alone_equals_example_in_a_padded_batch(causal):
    """An example's outputs are the same alone and padded in a batch next to
    a longer example (one bucket count for both)."""
    x = _x(B=2, T=40)
    mask = np.ones((2, 40), bool)
    mask[0, 13:] = False
    layer = _layer()
    batch = to_np(layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal))
    alone = to_np(layer(x[:1, :13], x[:1, :13], use_causal_mask=causal))
    assert rel_error(batch[0, :13], alone[0]) <= 1e-5


# -------------------------------------------------------------------- seeds
def _seeded_layer(seed, x):
    keras.utils.set_random_seed(seed)
    layer = LSHAttention(num_heads=2, key_dim=8, bucket_size=4, num_hashes=2)
    layer.build(x.shape, x.shape)
    return layer


def test_set_random_seed_reproduces_the_hashes():
    """``hash_seed=None`` draws from a source ``keras.utils.set_random_seed``
    seeds: two layers built after the same seed hash alike (and give the
    same outputs on the same weights); another seed hashes differently."""
    x = _x(T=40)
    a = _seeded_layer(11, x)
    b = _seeded_layer(11, x)
    c = _seeded_layer(12, x)
    assert a.hash_seed == b.hash_seed
    assert a.hash_seed != c.hash_seed
    b.set_weights(a.get_weights())
    c.set_weights(a.get_weights())
    np.testing.assert_array_equal(to_np(a.buckets(x)), to_np(b.buckets(x)))
    np.testing.assert_array_equal(to_np(a(x, x)), to_np(b(x, x)))
    assert np.mean(to_np(a.buckets(x)) != to_np(c.buckets(x))) > 0.2


@pytest.mark.parametrize("value", [2**31, 2**40, True, 1.0, "1"])
def test_hash_seed_out_of_range_is_refused_at_construction(value):
    """A seed a training call could not put in an int32 tensor is refused
    when the layer is made, naming the argument."""
    with pytest.raises(ValueError, match=f"hash_seed={value!r}"):
        _layer(hash_seed=value)


def test_config_round_trip_keeps_the_hashes():
    """The drawn seed and the fixed bucket count are in the config: a layer
    from it hashes and attends exactly as the original, at another length
    too. A config without a bucket count (saved before the layer was
    built) still loads and fixes it at build."""
    x = _x(T=40)
    layer = _seeded_layer(5, x)
    config = layer.get_config()
    assert isinstance(config["hash_seed"], int) and config["num_buckets"] == 10
    keras.utils.set_random_seed(99)  # the copy must not draw anything
    copy = _twin(layer, x)
    assert copy.hash_seed == layer.hash_seed and copy.num_buckets == 10
    for T in (40, 23, 64):
        xt = _x(T=T, seed=T)
        np.testing.assert_array_equal(to_np(copy.buckets(xt)), to_np(layer.buckets(xt)))
        np.testing.assert_array_equal(
            to_np(copy(xt, xt, use_causal_mask=True)), to_np(layer(xt, xt, use_causal_mask=True))
        )
    unbuilt = dict(config, num_buckets=None)
    old = LSHAttention.from_config(unbuilt)
    old.build(x.shape, x.shape)
    old.set_weights(layer.get_weights())
    assert old.num_buckets == 10
    np.testing.assert_array_equal(to_np(old(x, x)), to_np(layer(x, x)))


def test_keras_file_round_trip_keeps_the_hashes(tmp_path):
    x = _x(T=40)
    keras.utils.set_random_seed(8)
    x_in = keras.Input((40, 16))
    out = LSHAttention(num_heads=2, key_dim=8, bucket_size=4, num_hashes=2)(
        x_in, x_in, use_causal_mask=True
    )
    model = keras.Model(x_in, out)
    want = to_np(model(x))
    path = str(tmp_path / "lsh.keras")
    model.save(path)
    keras.utils.set_random_seed(9)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(to_np(loaded(x)), want)
    saved, restored = model.layers[-1], loaded.layers[-1]
    assert restored.hash_seed == saved.hash_seed and restored.num_buckets == 10


# ---------------------------------------------------------- mixed precision
def _numpy_buckets(q, rotations):
    """argmax([q R, -q R]) in float64 of queries ``q`` ``(B, n, H, d)``."""
    q = np.asarray(q, np.float64)
    rot = np.asarray(rotations, np.float64)  # (R, c, H, d)
    R, c, H, _ = rot.shape
    out = np.zeros((q.shape[0], R * H, q.shape[1]), int)
    for r in range(R):
        for h in range(H):
            proj = q[:, :, h] @ rot[r, :, h].T  # (B, n, c)
            out[:, r * H + h] = np.argmax(np.concatenate([proj, -proj], -1), -1)
    return out


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_hash_is_float32_under_mixed_precision(policy):
    """The buckets of a low-precision layer are the float32 (here float64)
    argmax of its own compute-dtype queries: the products with the
    rotations are not rounded to the compute dtype (ties and flipped
    buckets). The torch kernel's hash equals the portable one."""
    x = _x(B=2, T=64)
    layer = _layer(dtype=policy)
    layer(x, x)
    q = layer._query_dense(x)
    assert keras.backend.standardize_dtype(q.dtype) == policy.split("_")[1]
    c = layer.num_buckets // 2
    want = _numpy_buckets(to_np(keras.ops.cast(q, "float32")), to_np(layer.rotations(c)))
    np.testing.assert_array_equal(to_np(layer.buckets(x)), want)
    if BACKEND == "torch":
        got = backend_ops().lsh.hash_buckets(q, layer.rotations(c))
        np.testing.assert_array_equal(to_np(got), want)
        portable = lsh_ops.hash_buckets(q, layer.rotations(c))
        np.testing.assert_array_equal(to_np(portable), want)


#: Relative error (max |a - b| / max |b|) allowed against float32 on the
#: same weights when both hash every token alike: a few units of the
#: compute dtype's rounding (2**-8 = 3.9e-3 for bfloat16, 2**-11 = 4.9e-4
#: for float16, on the inputs, the projections and the weights). Measured
#: at n = 19-64, 5 seeds, causal and bidirectional, on all three backends:
#: at most 7.7e-3 (bfloat16) and 9e-4 (float16).
PRECISION_RTOL = {"bfloat16": 2e-2, "float16": 3e-3}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_close_to_float32_on_the_same_buckets(policy):
    """Under a mixed policy the output is within a few rounding units of
    the float32 layer on the same weights whenever the buckets are the
    same. The inputs themselves are rounded to the compute dtype, so a
    token whose two largest ``|x R|`` are that close changes bucket (and the
    chunks of its bucket move): such calls are left out here, and at least
    one call of the loop must keep every bucket."""
    compute = policy.split("_")[1]
    compared = 0
    for seed in range(4):
        for T, causal in ((19, True), (40, False)):
            x = _x(B=2, T=T, seed=seed)
            mask = np.ones((2, T), bool)
            mask[0, T - 5:] = False
            kwargs = dict(query_mask=mask, value_mask=mask, use_causal_mask=causal)
            keras.utils.set_random_seed(seed)
            full = _layer(hash_seed=seed)
            want = to_np(full(x, x, **kwargs))
            low = _twin(full, x, dtype=policy)
            got = low(x, x, **kwargs)
            assert keras.backend.standardize_dtype(got.dtype) == compute
            got = to_np(got).astype("float32")
            assert np.all(np.isfinite(got))
            same = np.array_equal(
                to_np(low.buckets(x, query_mask=mask)), to_np(full.buckets(x, query_mask=mask))
            )
            if not same:
                continue
            compared += 1
            err = rel_error(got[mask], want[mask])
            assert err <= PRECISION_RTOL[compute], (
                f"seed {seed}, n={T}, causal={causal}: {err:.3g}"
            )
    assert compared >= 1


# ------------------------------------------------------------ reference
@pytest.mark.parametrize("num_buckets", [None, 6])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("implementation", EFFICIENT)
def test_efficient_paths_equal_the_reference(implementation, causal, num_buckets):
    """Every efficient path (``"hashed_torch"`` too on PyTorch) equals the
    reference on the same weights, with padding, at the build length and
    at longer and shorter ones (the same bucket count)."""
    x = _x(B=2, T=30)
    layer = _layer(implementation=implementation, num_buckets=num_buckets)
    layer(x, x)
    ref = _twin(layer, x, implementation="reference")
    for T in (30, 45, 11):
        xt = _x(B=2, T=T, seed=T)
        mask = np.ones((2, T), bool)
        mask[1, T - T // 3:] = False
        kwargs = dict(query_mask=mask, value_mask=mask, use_causal_mask=causal)
        got = to_np(layer(xt, xt, **kwargs))
        assert layer.last_implementation == implementation
        want = to_np(ref(xt, xt, **kwargs))
        assert rel_error(got[mask], want[mask]) <= LSHAttention.reference_tolerance


@pytest.mark.parametrize("implementation", EFFICIENT)
def test_efficient_paths_equal_the_reference_in_mixed_bfloat16(implementation):
    """Under mixed_bfloat16 the efficient paths hash the same bfloat16
    queries as the reference (float32 products): the same buckets, and
    outputs within bfloat16 rounding of each other."""
    x = _x(B=2, T=40)
    layer = _layer(implementation=implementation, dtype="mixed_bfloat16")
    layer(x, x)
    ref = _twin(layer, x, implementation="reference")
    for causal in (True, False):
        got = to_np(layer(x, x, use_causal_mask=causal)).astype("float32")
        want = to_np(ref(x, x, use_causal_mask=causal)).astype("float32")
        assert rel_error(got, want) <= 2e-2
