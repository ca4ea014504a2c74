"""RoutingAttention: the conformance suite against an independent NumPy
reference that fixes the layer's clusters, plus centroid training,
causality, bad input and inspection."""

import doctest

import keras
import numpy as np
import pytest
from keras import ops
from keras.ops import convert_to_numpy as to_np

import keras_longattn
from keras_longattn import ops as la_ops
from keras_longattn.layers import routing_attention as routing_module
from keras_longattn.layers.routing_attention import RoutingAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error
from keras_longattn.testing.gradients import input_gradient
from keras_longattn.testing.profiles import slow_profile
from keras_longattn.testing import sorted_chunk_mask_loop

BACKEND = keras.backend.backend()


# ------------------------------------------------------------ reference
def _softmax_rows(scores, mask):
    """float64 softmax over visible entries; rows with none give zeros."""
    s = np.where(mask, scores, -np.inf)
    top = s.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(mask, np.exp(s - top), 0.0)
    z = e.sum(-1, keepdims=True)
    return np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)


def _self_rule(mask):
    """Shared query/key: drop the diagonal of rows that see something else."""
    eye = np.eye(mask.shape[-2], mask.shape[-1], dtype=bool)
    others = mask & ~eye
    return np.where(others.any(-1, keepdims=True), others, mask)


def numpy_reference(layer, query, value, use_causal_mask=False, query_mask=None,
                    value_mask=None, key_mask=None):
    """Dense attention, in NumPy, under the clusters the layer forms for these
    inputs (taken once from ``compute_clusters``): per balanced cluster a
    dense softmax over its members, averaged over the clusters where the
    query sees a key; for token routing, the brute-force chunk timeline."""
    causal = bool(use_causal_mask)
    cl = layer.compute_clusters(query, value, query_mask=query_mask,
                                value_mask=value_mask, key_mask=key_mask,
                                use_causal_mask=causal)
    q, k, v = layer._query_dense(query), layer._key_dense(value), layer._value_dense(value)
    if layer.rotary_max_wavelength is not None:
        q = la_ops.apply_rotary(q, layer.rotary_max_wavelength)
        k = la_ops.apply_rotary(k, layer.rotary_max_wavelength)
    q, k, v = (to_np(t).astype("float64") for t in (q, k, v))
    B, T, H, d = q.shape
    S = k.shape[1]
    kmask = np.ones((B, S), bool)
    for m in (value_mask, key_mask):
        if m is not None:
            kmask &= np.asarray(m, bool)
    qmask = np.ones((B, T), bool) if query_mask is None else np.asarray(query_mask, bool)
    scale = 1.0 / np.sqrt(d)
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    window = int(cl["window"])
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    lw = layer.local_window or window
    if causal:
        local = (j <= i) & (j > i - lw)
    else:
        local = np.abs(i - j) <= lw // 2
    for h in range(layer.local_heads):
        scores = np.einsum("btd,bsd->bts", q[:, :, h], k[:, :, h]) * scale
        probs = _softmax_rows(scores, local[None] & kmask[:, None, :])
        out[:, :, h] = probs @ v[:, :, h]
    shared = layer.shared_qk
    ok = (kmask & qmask) if shared else kmask
    for r in range(layer.num_heads - layer.local_heads):
        h = layer.local_heads + r
        qh = q[:, :, h]
        kh = qh / np.maximum(np.linalg.norm(qh, axis=-1, keepdims=True), 1e-6) if shared else k[:, :, h]
        scores = np.einsum("btd,bsd->bts", qh, kh) * scale
        weights = np.zeros((B, T, S))
        for b in range(B):
            if cl["mode"] == "balanced":
                qi = to_np(cl["query_indices"])[b, r]
                ki = to_np(cl["key_indices"])[b, r]
                count = np.zeros(T)
                for c in range(qi.shape[0]):
                    m = np.zeros((T, S), bool)
                    m[np.ix_(qi[c], ki[c])] = True
                    m &= ok[b][None]
                    if causal:
                        m &= j <= i
                    if shared:
                        m = _self_rule(m)
                    weights[b] += _softmax_rows(scores[b], m)
                    count += m.any(-1)
                weights[b] /= np.maximum(count, 1)[:, None]
            else:
                cq = to_np(cl["query_clusters"])[b, r]
                ck = to_np(cl["key_clusters"])[b, r]
                m = sorted_chunk_mask_loop(cq, ck, layer.num_clusters, window, shared)
                m &= ok[b][None]
                if shared:
                    m = _self_rule(m)
                weights[b] = _softmax_rows(scores[b], m)
        out[:, :, h] = weights @ v[:, :, h]
    return to_np(layer._output_dense(out.astype("float32")))


# ---------------------------------------------------------- conformance
class TestRoutingAttention(AttentionLayerConformance):
    """Half local, half routing heads; num_clusters = sqrt(n) by default."""

    layer_cls = RoutingAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "local_heads": 1}
    implementation = "routed"
    reference_lengths = (37, 2048)  # 37: not a multiple of any window

    def reference_output(self, layer, query, value, **call_kwargs):
        return numpy_reference(layer, query, value, **call_kwargs)

    def test_fit_step(self):
        """The suite's fit check on a small causal LM (Embedding ->
        RoutingAttention -> Dense, jit_compile=True on jax and tensorflow;
        on torch too under --run-slow, where the routing kernels run eagerly
        inside the torch.compile-d step, whose dynamo tracing takes about a
        minute and a half on a 2-core CPU: the property suite defers
        torch.compile the same way): the loss is finite and the weights
        train; the centroids move during fit and stay put in predict and
        evaluate."""
        V, n = 24, 32
        tokens = np.random.default_rng(0).integers(1, V, size=(16, n + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        inp = keras.Input((n,), dtype="int32")
        h = keras.layers.Embedding(V, self.features)(inp)
        attention = self.make_layer(num_clusters=4, ema_decay=0.5, commitment_weight=1e-4)
        h = attention(h, h, use_causal_mask=True)
        model = keras.Model(inp, keras.layers.Dense(V)(h))
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=keras.backend.backend() != "torch" or slow_profile(),
        )
        before = [w.copy() for w in model.get_weights()]
        c0 = _centroids(attention)
        history = model.fit(x, y, epochs=1, batch_size=8, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))
        after = model.get_weights()
        assert any(not np.allclose(a, b) for a, b in zip(before, after))
        c1 = _centroids(attention)
        assert np.abs(c1 - c0).max() > 1e-3
        if keras.backend.backend() == "torch":
            # torch.compile-ing predict and evaluate as well took another
            # ~40 s of dynamo tracing in CI for no further kernel path: the
            # compiled training step above is the check; inference runs
            # eagerly here (jax and tensorflow keep it compiled).
            model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=False)
        model.predict(x, verbose=0, batch_size=16)
        model.evaluate(x, y, verbose=0, batch_size=16)
        np.testing.assert_array_equal(_centroids(attention), c1)


class TestRoutingAttentionFused(AttentionLayerConformance):
    """The fused path: local and routing heads, clusters through
    keras.ops.dot_product_attention."""

    layer_cls = RoutingAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "local_heads": 1}
    implementation = "routed_fused"
    secondary = True
    reference_lengths = (37, 300)

    def reference_output(self, layer, query, value, **call_kwargs):
        return numpy_reference(layer, query, value, **call_kwargs)


class TestRoutingAttentionSharedQK(AttentionLayerConformance):
    """Routing heads only, shared query/key, a fixed number of clusters."""

    layer_cls = RoutingAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "num_clusters": 3, "shared_qk": True}
    reference_lengths = (37,)

    def reference_output(self, layer, query, value, **call_kwargs):
        return numpy_reference(layer, query, value, **call_kwargs)

    @pytest.mark.parametrize("policy", ["mixed_float16"])  # bfloat16: above
    def test_mixed_precision(self, policy):
        super().test_mixed_precision(policy)


# ------------------------------------------------------------- helpers
def _x(B=2, T=37, F=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, F)).astype("float32")


def _centroids(layer):
    return to_np(layer.centroids).copy()


# ------------------------------------------------------ reference paths
@pytest.mark.parametrize(
    "kwargs, causal, lengths",
    [
        # Windows smaller than n / k leave queries in no cluster.
        ({"window": 3, "local_heads": 1, "local_window": 5,
          "rotary_max_wavelength": 100.0}, False, (37, 37)),
        ({"num_clusters": 3}, False, (11, 19)),  # cross-attention
        ({"num_clusters": 3}, True, (11, 19)),
        # Overlapping clusters, the authors' (not strictly causal) routing.
        ({"num_clusters": 4, "window": 9, "causal_routing": "balanced"}, True, (23, 23)),
    ],
)
def test_routed_equals_reference_paths(kwargs, causal, lengths):
    q, kv = _x(T=lengths[0]), _x(T=lengths[1], seed=1)
    layer = RoutingAttention(num_heads=2, key_dim=8, **kwargs)
    out = to_np(layer(q, kv, use_causal_mask=causal))
    assert layer.last_implementation in ("routed", "routed_torch", "routed_fused",
                                         "routed_torch:routed_fused")
    ref = RoutingAttention(num_heads=2, key_dim=8, implementation="reference", **kwargs)
    ref(q, kv)
    ref.set_weights(layer.get_weights())
    assert rel_error(out, to_np(ref(q, kv, use_causal_mask=causal))) < 1e-5
    assert rel_error(out, numpy_reference(layer, q, kv, use_causal_mask=causal)) < 1e-5
    _, scores = layer(q, kv, use_causal_mask=causal, return_attention_scores=True)
    sums = to_np(scores).sum(-1)
    assert np.all((np.abs(sums - 1) < 1e-5) | (sums == 0))


@pytest.mark.parametrize("implementation", ["routed", "routed_fused"])
@pytest.mark.parametrize(
    "kwargs, causal",
    [
        ({"num_clusters": 4, "local_heads": 1, "local_window": 6}, False),
        ({"num_clusters": 4, "local_heads": 1, "local_window": 6}, True),
        ({"num_clusters": 3, "shared_qk": True}, True),
        ({"num_clusters": 4, "window": 9, "causal_routing": "balanced"}, True),
    ],
)
def test_both_efficient_paths_equal_reference(implementation, kwargs, causal):
    """Explicit einsums and the fused dot_product_attention path give the
    reference's output on the same weights and clusters, with padding."""
    x = _x(T=29)
    mask = np.ones((2, 29), bool)
    mask[1, 20:] = False
    layer = RoutingAttention(num_heads=2, key_dim=8, implementation=implementation,
                             **kwargs)
    out = to_np(layer(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal))
    assert layer.last_implementation == implementation
    ref = RoutingAttention(num_heads=2, key_dim=8, implementation="reference", **kwargs)
    ref(x, x)
    ref.set_weights(layer.get_weights())
    expected = to_np(ref(x, x, query_mask=mask, value_mask=mask, use_causal_mask=causal))
    assert rel_error(out[mask], expected[mask]) < 1e-5


@pytest.mark.parametrize("implementation", ["routed", "routed_fused"])
@pytest.mark.parametrize("causal", [False, True])
def test_one_cluster_equals_full_attention_in_values_and_gradients(implementation, causal):
    """With one cluster holding every token (balanced: window n; token
    routing: a chunk of n members, so own + previous chunk hold all 2n
    queries and keys) routing attention is full attention. Values and the
    gradients with respect to the query input and the key/value input must
    match FullAttention on the same weights: an independent check that every
    projection (keys included) is differentiated through the efficient paths,
    which the reference path (built from the same routing) cannot give."""
    q, kv = _x(T=19), _x(T=19, seed=1)
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=1,
                             implementation=implementation)
    full = keras_longattn.layers.FullAttention(num_heads=2, key_dim=8)
    layer(q, kv)
    full(q, kv)
    layer.set_weights(full.get_weights())
    out = to_np(layer(q, kv, use_causal_mask=causal))
    np.testing.assert_allclose(out, to_np(full(q, kv, use_causal_mask=causal)),
                               rtol=1e-5, atol=1e-5)
    for wrt in ("query", "key/value"):
        def fn(v, l):
            if wrt == "query":
                return l(v, kv, use_causal_mask=causal)
            return l(q, v, use_causal_mask=causal)

        x = q if wrt == "query" else kv
        got = input_gradient(lambda v: fn(v, layer), x)
        want = input_gradient(lambda v: fn(v, full), x)
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=wrt)


def test_fused_path_refuses_dropout_in_training():
    """The fused path has no attention dropout: asked for explicitly, it
    refuses a training call with dropout (naming the reason) instead of
    computing something else; ``auto`` then runs ``routed`` and says so."""
    x = _x(T=24)
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3, local_heads=1,
                             local_window=4, dropout=0.5, implementation="routed_fused")
    with pytest.raises(ValueError, match="routed_fused: attention dropout"):
        layer(x, x, use_causal_mask=True, training=True)
    inference = to_np(layer(x, x, use_causal_mask=True, training=False))
    assert layer.last_implementation == "routed_fused"
    auto = RoutingAttention(num_heads=2, key_dim=8, num_clusters=3, local_heads=1,
                            local_window=4, dropout=0.5)
    auto(x, x)
    auto.set_weights(layer.get_weights())
    out = to_np(auto(x, x, use_causal_mask=True, training=True))
    assert auto.last_implementation == "routed"
    assert out.shape == (2, 24, 16) and np.all(np.isfinite(out))
    assert not np.allclose(out, inference)


def test_queries_in_no_cluster_get_zero_routing_output():
    x = _x(T=12)
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=2, window=1,
                             use_bias=False)
    out = to_np(layer(x, x))
    cl = layer.compute_clusters(x)
    covered = np.zeros((2, 12), bool)  # by a cluster of either head
    for b in range(2):
        covered[b, to_np(cl["query_indices"])[b].ravel()] = True
    assert np.all(out[~covered] == 0.0)
    assert np.all(np.abs(out[covered]).sum(-1) > 0)


# ------------------------------------------------------------ causality
def test_token_routing_is_causal_and_balanced_causal_routing_leaks():
    """Balanced top-w membership depends on later tokens (the reason causal
    calls default to token routing)."""
    x = _x(B=1, T=40)
    leaked = False
    for routing in ("token", "balanced"):
        layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=5,
                                 causal_routing=routing, seed=1)
        y = to_np(layer(x, x, use_causal_mask=True))
        for t in (10, 20, 30):
            x2 = x.copy()
            x2[:, t + 1:] = np.random.default_rng(t).standard_normal(x2[:, t + 1:].shape)
            y2 = to_np(layer(x2, x2, use_causal_mask=True))
            same = np.allclose(y2[:, : t + 1], y[:, : t + 1], rtol=1e-6, atol=1e-6)
            if routing == "token":
                assert same
            else:
                leaked |= not same
    assert leaked


# -------------------------------------------------------------- clusters
def test_compute_clusters_matches_numpy_routing():
    x = _x()
    mask = np.ones((2, 37), bool)
    mask[1, 30:] = False
    layer = RoutingAttention(num_heads=2, key_dim=8, local_heads=1)
    layer(x, x)
    cl = layer.compute_clusters(x, query_mask=mask, value_mask=mask)
    assert cl["mode"] == "balanced" and cl["window"] == 7
    assert tuple(cl["query_indices"].shape) == (2, 1, 6, 7)
    assert tuple(cl["query_clusters"].shape) == (2, 1, 37)
    mu = _centroids(layer)
    mu = mu / np.linalg.norm(mu, axis=-1, keepdims=True)
    for name, proj in (("query", layer._query_dense), ("key", layer._key_dense)):
        z = to_np(proj(x))[:, :, 1:].astype("float64")  # the routing head
        z = z - z.mean(-1, keepdims=True)
        z = z / np.sqrt(z.var(-1, keepdims=True) + 1e-6) / np.sqrt(8)
        sim = np.einsum("bnhd,hkd->bhkn", z, mu)
        near = np.where(mask[:, None, :], sim.argmax(2), 6)
        np.testing.assert_array_equal(to_np(cl[f"{name}_clusters"]), near)
        sim = np.where(mask[:, None, None, :], sim, -np.inf)
        top = np.sort(np.argsort(-sim, axis=-1, kind="stable")[..., :7], axis=-1)
        np.testing.assert_array_equal(to_np(cl[f"{name}_indices"]), top)
    causal = layer.compute_clusters(x, use_causal_mask=True)
    assert causal["mode"] == "token" and causal["window"] == 7


# -------------------------------------------------------------- centroids
def _pooled_ema(layer, x, mask, decay):
    """NumPy EMA step from the layer's projections and clusters."""
    cl = layer.compute_clusters(x, query_mask=mask, value_mask=mask)
    mu = _centroids(layer)
    k = layer.num_clusters
    sums = np.zeros_like(mu, dtype="float64")
    counts = np.zeros(mu.shape[:2])
    for proj, name in ((layer._query_dense, "query_clusters"), (layer._key_dense, "key_clusters")):
        z = to_np(proj(x))[:, :, layer.local_heads:].astype("float64")
        z = z - z.mean(-1, keepdims=True)
        z = z / np.sqrt(z.var(-1, keepdims=True) + 1e-6) / np.sqrt(z.shape[-1])
        near = to_np(cl[name])  # (B, H, n), k = padding
        for b, h, t in np.ndindex(*near.shape):
            if near[b, h, t] < k:
                sums[h, near[b, h, t]] += z[b, t, h]
                counts[h, near[b, h, t]] += 1
    means = sums / np.maximum(counts, 1)[..., None]
    return np.where(counts[..., None] > 0, decay * mu + (1 - decay) * means, mu)


def test_centroids_move_by_ema_in_training_only_and_padding_never_moves_them():
    x = _x()
    mask = np.ones((2, 37), bool)
    mask[0, 25:] = False
    mask[1, :5] = False
    layer = RoutingAttention(num_heads=2, key_dim=8, local_heads=1, ema_decay=0.5)
    layer(x, x)
    c0 = _centroids(layer)
    layer(x, x, value_mask=mask, query_mask=mask, training=False)
    layer(x, x, value_mask=mask, query_mask=mask)
    np.testing.assert_array_equal(_centroids(layer), c0)
    expected = _pooled_ema(layer, x, mask, 0.5)
    layer(x, x, value_mask=mask, query_mask=mask, training=True)
    c1 = _centroids(layer)
    assert not np.allclose(c1, c0)
    np.testing.assert_allclose(c1, expected, rtol=1e-5, atol=1e-6)
    # The content of padded tokens does not matter.
    layer.centroids.assign(c0)
    x2 = np.where(mask[..., None], x, 50.0).astype("float32")
    layer(x2, x2, value_mask=mask, query_mask=mask, training=True)
    np.testing.assert_allclose(_centroids(layer), c1, rtol=1e-6, atol=1e-6)
    # An all-padding batch leaves the centroids unchanged (and finite).
    for causal in (False, True):
        none = np.zeros((2, 37), bool)
        y = to_np(layer(x2, x2, value_mask=none, query_mask=none, training=True,
                        use_causal_mask=causal))
        np.testing.assert_array_equal(_centroids(layer), c1)
        assert np.all(np.isfinite(y))


@pytest.mark.parametrize("policy", ["mixed_float16"])
def test_empty_clusters_in_mixed_precision_stay_finite_and_still(policy):
    # Every token is the same vector: one cluster takes all, the others
    # are empty for the whole batch.
    x = np.tile(_x(B=1, T=1), (2, 37, 1))
    layer = RoutingAttention(num_heads=2, key_dim=8, local_heads=1, ema_decay=0.5,
                             dtype=policy)
    layer(x, x)
    assert keras.backend.standardize_dtype(layer.centroids.dtype) == "float32"
    c0 = _centroids(layer)
    for causal in (False, True):
        y = layer(x, x, use_causal_mask=causal, training=True)
        assert np.all(np.isfinite(to_np(ops.cast(y, "float32"))))
    c1 = _centroids(layer)
    assert np.all(np.isfinite(c1))
    moved = np.abs(c1 - c0).max(-1) > 0  # (heads, clusters)
    assert 1 <= moved.sum() <= 2  # the queries' and the keys' cluster


def test_no_gradient_reaches_centroids():
    x = _x()
    layer = RoutingAttention(num_heads=2, key_dim=8, local_heads=1,
                             commitment_weight=1.0)
    layer(x, x)
    assert all(w is not layer.centroids for w in layer.trainable_weights)
    assert any(w is layer.centroids for w in layer.non_trainable_weights)
    if BACKEND == "jax":
        import jax

        trainable = [v.value for v in layer.trainable_variables]
        non_trainable = [v.value for v in layer.non_trainable_variables]

        def f(nt):
            out, _ = layer.stateless_call(trainable, nt, x, x, training=True)
            return (out ** 2).sum()

        grads = jax.grad(f)(non_trainable)
        assert all(np.all(np.asarray(g) == 0) for g in grads)
    elif BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(layer.centroids.value)
            out = layer(x, x)
            loss = tf.reduce_sum(out ** 2) + sum(layer.losses)
        grad = tape.gradient(loss, layer.centroids.value)
        assert grad is None or np.all(grad.numpy() == 0)
    else:
        out = layer(x, x, training=True)
        loss = (out ** 2).sum() + sum(layer.losses)
        loss.backward()
        assert not layer.centroids.value.requires_grad
        assert layer.centroids.value.grad is None


def test_commitment_loss():
    x = _x()
    layer = RoutingAttention(num_heads=2, key_dim=8, local_heads=1,
                             commitment_weight=0.5)
    layer(x, x)
    assert len(layer.losses) == 1
    cl = layer.compute_clusters(x)
    mu = _centroids(layer)
    mu = mu / np.linalg.norm(mu, axis=-1, keepdims=True)
    parts = []
    for proj, name in ((layer._query_dense, "query_clusters"), (layer._key_dense, "key_clusters")):
        z = to_np(proj(x))[:, :, 1:].astype("float64")
        z = z - z.mean(-1, keepdims=True)
        z = z / np.sqrt(z.var(-1, keepdims=True) + 1e-6) / np.sqrt(8)
        near = to_np(cl[name])
        d = [((z[b, t, h] - mu[h, near[b, h, t]]) ** 2).sum()
             for b, h, t in np.ndindex(*near.shape)]
        parts.append(np.mean(d))
    expected = 0.5 * 0.5 * (parts[0] + parts[1])
    np.testing.assert_allclose(float(to_np(layer.losses[0])), expected, rtol=1e-4)
    plain = RoutingAttention(num_heads=2, key_dim=8, local_heads=1)
    plain(x, x)
    assert not plain.losses


# ------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_clusters": 0}, "num_clusters=0"),
        ({"num_clusters": 2.5}, "num_clusters=2.5"),
        ({"window": 0}, "window=0"),
        ({"ema_decay": 0.0}, "ema_decay=0.0"),
        ({"ema_decay": 1.0}, "ema_decay=1.0"),
        ({"ema_decay": 1.5}, "ema_decay=1.5"),
        ({"local_heads": -1}, "local_heads=-1"),
        ({"local_heads": 3}, "local_heads=3"),
        ({"local_window": 0}, "local_window=0"),
        ({"commitment_weight": -1.0}, "commitment_weight=-1.0"),
        ({"shared_qk": "yes"}, "shared_qk='yes'"),
        ({"causal_routing": "greedy"}, "causal_routing='greedy'"),
    ],
)
def test_bad_routing_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoutingAttention(num_heads=2, key_dim=8, **kwargs)


def test_bad_call_arguments():
    x = _x(T=5)
    layer = RoutingAttention(num_heads=2, key_dim=8, num_clusters=8)
    with pytest.raises(ValueError, match="num_clusters=8"):
        layer(x, x)
    # Token routing (causal) has no such limit.
    assert tuple(layer(x, x, use_causal_mask=True).shape) == x.shape
    shared = RoutingAttention(num_heads=2, key_dim=8, num_clusters=2, shared_qk=True)
    with pytest.raises(ValueError, match="shared_qk"):
        shared(x, _x(T=7))
    inp = keras.Input((None, 16))
    with pytest.raises(ValueError, match="num_clusters=None"):
        RoutingAttention(num_heads=2, key_dim=8)(inp, inp)


def test_default_num_clusters_and_window_are_fixed_at_build_and_reported():
    layer = RoutingAttention(num_heads=2, key_dim=8)
    assert layer.get_config()["num_clusters"] is None
    assert layer.get_config()["window"] is None
    x = _x(T=37)
    layer(x, x)
    assert layer.num_clusters == 6  # round(sqrt(37))
    assert layer.get_config()["num_clusters"] == 6
    assert tuple(layer.centroids.shape) == (2, 6, 8)
    # ceil(37 / 6) = 7, fixed: a longer (padded) call keeps it.
    assert layer.get_config()["window"] == 7
    assert layer.routing_window(37) == 7 and layer.routing_window(100) == 7
    assert layer.routing_window(5) == 5  # capped at the length
    local_only = RoutingAttention(num_heads=2, key_dim=8, local_heads=2)
    local_only(x, x)
    assert local_only.centroids is None


def test_from_multi_head_attention():
    x = _x()
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    mha(x, x)
    layer = RoutingAttention.from_multi_head_attention(mha, num_clusters=6, local_heads=1)
    for a, b in zip(layer.get_weights(), mha.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert np.all(np.isfinite(to_np(layer(x, x, use_causal_mask=True))))


def test_docstring_example(monkeypatch):
    monkeypatch.setattr(keras_longattn.layers, "RoutingAttention", RoutingAttention,
                        raising=False)
    result = doctest.testmod(routing_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_fused_path_with_a_different_value_size():
    """value_dim != key_dim through the fused kernel (JAX's needs equal
    sizes: the library pads) equals the reference."""
    x = _x(T=20)
    layer = RoutingAttention(num_heads=2, key_dim=8, value_dim=5, num_clusters=3,
                             local_heads=1, local_window=4, implementation="routed_fused")
    out = to_np(layer(x, x, use_causal_mask=True))
    ref = RoutingAttention(num_heads=2, key_dim=8, value_dim=5, num_clusters=3,
                           local_heads=1, local_window=4, implementation="reference")
    ref(x, x)
    ref.set_weights(layer.get_weights())
    assert rel_error(out, to_np(ref(x, x, use_causal_mask=True))) < 1e-5
