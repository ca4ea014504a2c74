"""LSHAttention: the conformance suite (derived and fixed bucket counts), a
NumPy loop of the hashing and of the multi-round attention, rotations fixed
at inference and redrawn in training, padding (fully padded rows beside
NaN peers), the self rule, mixed precision training steps and bad input."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import LSHAttention
from keras_longattn.ops import lsh as lsh_ops
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import gradients
from keras_longattn.testing import rel_error

KWARGS = {"num_heads": 2, "key_dim": 8, "bucket_size": 4, "num_hashes": 2, "hash_seed": 3}


# ---------------------------------------------------------- conformance
class TestLSHHashed(AttentionLayerConformance):
    """Buckets of 4 on average (37 tokens: 10 buckets), two rounds."""

    layer_cls = LSHAttention
    init_kwargs = KWARGS
    implementation = "hashed"
    supports_cross_attention = False  # shared queries and keys
    reference_lengths = (16, 37, 2048)


class TestLSHFixedBuckets(AttentionLayerConformance):
    """A fixed number of buckets (larger than a chunk holds), one round."""

    layer_cls = LSHAttention
    init_kwargs = dict(KWARGS, num_hashes=1, num_buckets=4)
    implementation = "hashed"
    supports_cross_attention = False  # shared queries and keys
    secondary = True
    reference_lengths = (37,)


# ------------------------------------------------------------- helpers
def _x(B=2, T=37, F=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, F)).astype("float32")


def _built(x=None, **kwargs):
    layer = LSHAttention(**dict(KWARGS, **kwargs))
    x = _x() if x is None else x
    layer(x, x)
    return layer


def numpy_buckets(layer, x):
    """argmax([x R, -x R]) of every round and head, in NumPy."""
    q = to_np(layer._query_dense(x)).astype("float64")
    B, n, H, d = q.shape
    c = lsh_ops.rotation_columns(n, layer.bucket_size, layer.num_buckets)
    rot = to_np(layer.rotations(c)).astype("float64")  # (R, c, H, d)
    out = np.zeros((B, layer.num_hashes * H, n), int)
    for r in range(layer.num_hashes):
        for h in range(H):
            proj = q[:, :, h] @ rot[r, :, h].T  # (B, n, c)
            out[:, r * H + h] = np.argmax(np.concatenate([proj, -proj], -1), -1)
    return out


def numpy_lsh(layer, x, causal, mask=None):
    """The layer in NumPy (float64) from its buckets: per round and head,
    tokens sorted by (bucket, position), ranks cut into chunks of
    bucket_size, own and previous chunk of the bucket, the self rule over
    all rounds, keys counted once per round, the output projection."""
    q = to_np(layer._query_dense(x)).astype("float64")
    v = to_np(layer._value_dense(x)).astype("float64")
    B, n, H, d = q.shape
    keep = np.ones((B, n), bool) if mask is None else np.asarray(mask, bool)
    q = q * keep[:, :, None, None]
    buckets = to_np(layer.buckets(x, query_mask=None if mask is None else keep))
    w = layer.bucket_size
    R = layer.num_hashes
    out = np.zeros((B, n, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            qh = q[b, :, h]
            norm = np.maximum(np.linalg.norm(qh, axis=-1, keepdims=True), 1e-6)
            logits = qh @ (qh / norm).T / np.sqrt(d)
            seen = np.zeros((R, n, n), bool)
            for r in range(R):
                bk = buckets[b, r * H + h]
                rank = np.zeros(n, int)
                for i in range(n):
                    rank[i] = np.sum((bk[:i] == bk[i]) & keep[b, :i])
                for i in range(n):
                    for j in range(n):
                        ok = keep[b, i] and keep[b, j] and bk[i] == bk[j]
                        ok = ok and rank[i] // w - 1 <= rank[j] // w <= rank[i] // w
                        ok = ok and (j <= i if causal else True)
                        seen[r, i, j] = ok
            others = (seen & ~np.eye(n, dtype=bool)).any(-1).any(0)  # (n,)
            count = np.where(others[None, :, None], seen & ~np.eye(n, dtype=bool), seen).sum(0)
            for i in range(n):
                if count[i].sum() == 0:
                    continue
                e = count[i] * np.exp(logits[i] - logits[i][count[i] > 0].max())
                out[b, i, h] = (e / e.sum()) @ v[b, :, h]
    kernel, bias = (to_np(t).astype("float64") for t in layer._output_dense.weights)
    return np.einsum("bthd,hdo->bto", out, kernel) + bias


# ------------------------------------------------------------ the method
def test_hashing_matches_numpy():
    x = _x(T=37)
    layer = _built(x)
    ours = to_np(layer.buckets(x))
    # Bucket j of +xR is j, of -xR is c + j: the same as argmax over the
    # concatenation.
    np.testing.assert_array_equal(ours, numpy_buckets(layer, x))
    c = lsh_ops.rotation_columns(37, 4)
    assert ours.max() < 2 * c and len(np.unique(ours)) > 2


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("implementation", ["hashed", "reference"])
def test_matches_numpy_loop(causal, implementation):
    x = _x(T=23)
    mask = np.ones((2, 23), bool)
    mask[1, :5] = False
    layer = _built(x, implementation=implementation)
    expected = numpy_lsh(layer, x, causal, mask)
    ours = to_np(layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal))
    assert rel_error(ours[mask], expected[mask]) < 1e-5


def test_numpy_loop_fails_without_the_round_combination():
    """The NumPy check can fail: one round alone is not the layer."""
    x = _x(T=23)
    layer = _built(x)
    one = _built(x, num_hashes=1)
    one.set_weights(layer.get_weights())
    ours = to_np(layer(x, x))
    assert rel_error(to_np(one(x, x)), ours) > 1e-3


def test_self_only_when_alone():
    """One round, chunks larger than the sequence: a token sees the other
    tokens of its bucket, and itself only when its bucket holds nothing
    else (bidirectional) or nothing before it (causal)."""
    x = _x(B=1, T=12)
    layer = _built(x, bucket_size=64, num_hashes=1, implementation="reference")
    buckets = to_np(layer.buckets(x))[0]  # (H, n)
    for causal in (False, True):
        _, scores = layer(x, x, return_attention_scores=True, use_causal_mask=causal)
        scores = to_np(scores)[0]
        for h in range(2):
            same = buckets[h][:, None] == buckets[h][None, :]
            if causal:
                same &= np.tril(np.ones((12, 12), bool))
            alone = same.sum(-1) == 1
            np.testing.assert_allclose(np.diagonal(scores[h]), alone.astype(float), atol=1e-6)
            off = ~np.eye(12, dtype=bool)
            assert np.all((scores[h][off] > 0) == same[off])


def test_bucket_count_does_not_follow_the_real_length():
    """A padded example hashes its real tokens into the layer's buckets,
    as alone (one bucket count, fixed at build); padding gets no bucket."""
    x = _x(B=2, T=64)
    mask = np.ones((2, 64), bool)
    mask[1, 16:] = False
    layer = _built(x, num_hashes=1)
    c = lsh_ops.rotation_columns(64, 4)  # 8 columns, 16 buckets
    assert layer.num_buckets == 2 * c
    buckets = to_np(layer.buckets(x, query_mask=mask))
    alone = to_np(layer.buckets(x[1:, :16]))
    np.testing.assert_array_equal(buckets[1][:, :16], alone[0])
    assert len(np.unique(alone % c)) > 2  # more columns than 16 tokens derive
    assert np.all(buckets[1][:, 16:] == 2 * c)  # padding: no bucket


# ---------------------------------------------------------- rotations
def test_rotations_fixed_at_inference_and_redrawn_in_training():
    x = _x()
    layer = _built(x)
    a, b = to_np(layer(x, x)), to_np(layer(x, x))
    np.testing.assert_array_equal(a, b)
    t1, t2 = to_np(layer(x, x, training=True)), to_np(layer(x, x, training=True))
    assert not np.allclose(t1, t2)
    fixed = _built(x, redraw_in_training=False)
    fixed.set_weights(layer.get_weights())
    np.testing.assert_allclose(to_np(fixed(x, x, training=True)), a, rtol=1e-6, atol=1e-6)
    other_seed = _built(x, hash_seed=4)
    other_seed.set_weights(layer.get_weights())
    assert not np.allclose(to_np(other_seed(x, x)), a)


def test_hash_seed_is_drawn_once_and_stored():
    layer = LSHAttention(num_heads=2, key_dim=8)
    config = layer.get_config()
    assert isinstance(config["hash_seed"], int)
    assert LSHAttention.from_config(config).hash_seed == layer.hash_seed


# -------------------------------------------------------------- padding
@pytest.mark.parametrize("causal", [True, False])
def test_fully_padded_row_beside_nan_peers(causal):
    """An example with no real token gets a finite (zero-attention) output,
    its NaN inputs reach neither the other example nor any gradient."""
    x = _x(T=21)
    poisoned = x.copy()
    poisoned[0] = np.nan
    mask = np.ones((2, 21), bool)
    mask[0] = False
    mask[1, 15:] = False
    poisoned[1, 15:] = np.inf
    layer = _built(x)
    out = to_np(layer(poisoned, poisoned, query_mask=mask, value_mask=mask,
                      use_causal_mask=causal))
    assert np.all(np.isfinite(out))
    alone = to_np(layer(x[1:, :15], x[1:, :15], use_causal_mask=causal))
    np.testing.assert_allclose(out[1, :15], alone[0], rtol=1e-5, atol=1e-6)

    def f(inp):
        return layer(inp, inp, query_mask=mask, value_mask=mask, use_causal_mask=causal)

    g = gradients.input_gradient(f, poisoned)
    assert np.all(np.isfinite(g))


# --------------------------------------------------- training, precision
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_training_step(policy):
    x = _x(B=4, T=40)
    mask = np.ones((4, 40), bool)
    mask[1, 30:] = False
    x_in = keras.Input((40, 16))
    m_in = keras.Input((40,), dtype="bool")
    layer = LSHAttention(**KWARGS, dtype=policy)
    h = layer(x_in, x_in, query_mask=m_in, value_mask=m_in, use_causal_mask=True)
    model = keras.Model([x_in, m_in], keras.layers.Dense(16, dtype=policy)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit([x, mask], np.roll(x, 1, axis=1), epochs=2, batch_size=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


# ------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "name, value",
    [("bucket_size", 0), ("num_hashes", 0), ("num_buckets", 3), ("num_buckets", 0),
     ("hash_seed", -1), ("redraw_in_training", 1)],
)
def test_bad_arguments_name_the_argument(name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        LSHAttention(**dict(KWARGS, **{name: value}))


def test_cross_attention_is_refused():
    layer = _built()
    with pytest.raises(ValueError, match="query length 37, key length 20"):
        layer(_x(T=37), _x(T=20))


def test_unknown_length_needs_num_buckets():
    layer = LSHAttention(**KWARGS)
    layer.build((None, None, 16), (None, None, 16))
    with pytest.raises(ValueError, match="num_buckets=None"):
        layer._columns(keras.ops.convert_to_tensor(37))
    assert _built(num_buckets=6)._columns(keras.ops.convert_to_tensor(37)) == 3
