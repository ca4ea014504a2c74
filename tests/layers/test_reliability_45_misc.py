"""Issue #45, items 10, 11, 12 and 14, on every backend:

* 10: ``alpha`` of the entmax ops refuses booleans, strings, None and
  non-float tensors with a ValueError naming it (``True`` was taken as
  α = 1 and clipped to 1.001; strings and None gave raw backend errors);
* 11: the entmax ops take TensorFlow variables as scores (``moveaxis`` of
  a ``tf.Variable`` failed on ``ndim``);
* 12: ``KERAS_LONGATTN_TRUSTED_PATHS`` is matched case-insensitively and
  an unknown kind warns once, naming the variable and the accepted kinds;
* 14: ``TwoStreamAttention`` refuses float masks as the layers'
  ``attention_mask`` does (they were cast to bool: 0.5 attended).
"""

import warnings

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.kernels import proven
from keras_longattn.layers import EntmaxAttention
from keras_longattn.models.two_stream import TwoStreamAttention
from keras_longattn.models.two_stream import two_stream_masks
from keras_longattn.ops import entmax as em

ON_TF = keras.backend.backend() == "tensorflow"


def _scores(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


# ---------------------------------------------------- 10: entmax's alpha
BAD_ALPHAS = [True, False, np.bool_(True), "1.5", b"1.5", None, {"alpha": 1.5}]


@pytest.mark.parametrize("fn", [em.entmax, em.entmax_bisect])
@pytest.mark.parametrize("alpha", BAD_ALPHAS, ids=repr)
def test_entmax_alpha_of_a_wrong_kind_is_refused_by_name(fn, alpha):
    with pytest.raises(ValueError, match="`alpha` must be a number in .* or a "
                       "floating-point tensor") as info:
        fn(_scores(2, 5), alpha)
    message = str(info.value)
    assert "Received: alpha" in message
    if not isinstance(alpha, np.bool_):
        assert f"alpha={alpha!r}" in message
    else:
        assert "alpha.dtype=bool" in message


@pytest.mark.parametrize("fn", [em.entmax, em.entmax_bisect])
@pytest.mark.parametrize(
    "alpha, received",
    [(np.array([[2], [2]], "int32"), "alpha.dtype=int32"),
     (np.array([[True], [False]]), "alpha.dtype=bool"),
     ([[2], [2]], "alpha=[[2], [2]] (dtype int32)")],
    ids=["int32", "bool", "int-list"])
def test_entmax_alpha_tensor_of_a_non_float_dtype_is_refused(fn, alpha, received):
    with pytest.raises(ValueError, match="floating-point tensor") as info:
        fn(_scores(2, 5), alpha)
    assert f"Received: {received}" in str(info.value)


def test_entmax_numbers_and_float_tensors_keep_working():
    """What the docstrings allow still runs: α = 1 (softmax, through
    entmax only), 1.5, 2, any number in (1, 2], a float tensor per row."""
    z = _scores(2, 5)
    soft = np.exp(z - z.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    np.testing.assert_allclose(to_np(em.entmax(z, 1)), soft, atol=1e-6)
    for alpha in (1.5, 2, 1.3, np.float32(1.7)):
        p = to_np(em.entmax(z, alpha, n_iter=20))
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    per_row = to_np(em.entmax(z, np.array([1.5, 1.5], "float32"), n_iter=30))
    np.testing.assert_allclose(per_row, to_np(em.entmax15(z)), atol=1e-5)
    with pytest.raises(ValueError, match=r"`alpha` must be in \(1, 2\]"):
        em.entmax_bisect(z, 1)


@pytest.mark.parametrize("alpha", [True, "1.5", None, np.bool_(True),
                                   np.array(1.5, "float32"), "Learned"], ids=repr)
def test_entmax_attention_alpha_of_a_wrong_kind_is_refused(alpha):
    """The layer's own check (a guard: it had no hole)."""
    with pytest.raises(ValueError, match="`alpha` must be a number in") as info:
        EntmaxAttention(num_heads=2, key_dim=4, alpha=alpha)
    assert "Received: alpha=" in str(info.value)


# ---------------------------------------------- 11: TensorFlow variables
@pytest.mark.skipif(not ON_TF, reason="tf.Variable is TensorFlow's")
@pytest.mark.parametrize("alpha", [1, 1.5, 2, 1.3, "tensor"])
def test_entmax_takes_a_tf_variable_as_scores(alpha):
    import tensorflow as tf

    z = _scores(2, 5)
    mask = np.array([[True] * 5, [True, True, False, True, False]])
    if alpha == "tensor":
        alpha = tf.Variable(np.array([1.4, 1.8], "float32"))
        expected = em.entmax(z, np.array([1.4, 1.8], "float32"), mask)
    else:
        expected = em.entmax(z, alpha, mask)
    out = em.entmax(tf.Variable(z), alpha, tf.Variable(mask))
    np.testing.assert_allclose(to_np(out), to_np(expected), atol=1e-6)
    for fn in (em.sparsemax, em.entmax15):
        np.testing.assert_allclose(to_np(fn(tf.Variable(z), mask)),
                                   to_np(fn(z, mask)), atol=1e-6)
    # And a keras.Variable.
    np.testing.assert_allclose(to_np(em.sparsemax(keras.Variable(z))),
                               to_np(em.sparsemax(z)), atol=1e-6)


@pytest.mark.skipif(not ON_TF, reason="tf.Variable is TensorFlow's")
def test_entmax_gradient_reaches_tf_variables():
    import tensorflow as tf

    z = tf.Variable(_scores(2, 5))
    alpha = tf.Variable(np.array([1.4, 1.8], "float32"))
    w = tf.constant(_scores(2, 5, seed=1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * em.entmax(z, alpha, n_iter=30))
    dz, dalpha = tape.gradient(loss, [z, alpha])
    assert dz is not None and dalpha is not None
    assert np.all(np.isfinite(dz.numpy())) and np.abs(dalpha.numpy()).max() > 0


# ------------------------------------------- 12: the trust variable
@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(proven, "_WARNED", set())
    monkeypatch.delitem(proven.PROVEN, ("jax", "Test GPU 9000"), raising=False)
    monkeypatch.delitem(proven.PROVEN, ("torch", "Test GPU 9000"), raising=False)


@pytest.mark.parametrize("value, kinds", [
    ("Pallas", {"pallas"}), (" PALLAS , Flex ", {"pallas", "flex"}),
    ("flex,", {"flex"}), ("", set())])
def test_trusted_paths_match_any_case_and_spacing(monkeypatch, fresh_warnings, value, kinds):
    monkeypatch.setenv(proven.TRUST_VARIABLE, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for backend in ("jax", "torch"):
            assert proven.trusted_kinds(backend, "Test GPU 9000") == kinds
    # Never on the CPU.
    assert proven.trusted_kinds("jax", None) == frozenset()


def test_a_misspelt_trusted_path_warns_once(monkeypatch, fresh_warnings):
    monkeypatch.setenv(proven.TRUST_VARIABLE, "palas, flex")
    with pytest.warns(UserWarning) as record:
        assert proven.trusted_kinds("torch", "Test GPU 9000") == {"flex"}
    assert len(record) == 1
    message = str(record[0].message)
    assert proven.TRUST_VARIABLE in message and "'palas'" in message
    assert "'pallas'" in message and "'flex'" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert proven.trusted_kinds("jax", "Test GPU 9000") == {"flex"}


# ---------------------------------------------- 14: two-stream masks
@pytest.mark.parametrize("which", ["content_mask", "query_mask"])
@pytest.mark.parametrize("batched", [False, True])
def test_two_stream_refuses_float_masks(which, batched):
    n, b, dim = 5, 2, 8
    layer = TwoStreamAttention(num_heads=2, key_dim=4)
    content_mask, query_mask = two_stream_masks(n, b, "plm")
    masks = {"content_mask": content_mask, "query_mask": query_mask}
    if batched:
        masks = {k: np.broadcast_to(m, (1,) + m.shape) for k, m in masks.items()}
    x = np.random.default_rng(0).normal(size=(1, n, dim)).astype("float32")
    q = x[:, -b:]
    # Integer 0/1 is accepted, and equals the boolean masks.
    ref = layer(x, q, **masks)
    ints = layer(x, q, **{k: m.astype("int32") for k, m in masks.items()})
    for r, i in zip(ref, ints):
        np.testing.assert_allclose(to_np(i), to_np(r), atol=1e-6)
    masks[which] = masks[which].astype("float32")
    expected = (f"`{which}` must be boolean (True = attend) or integer 0/1. "
                f"Received: {which}.dtype=float32")
    with pytest.raises(ValueError) as info:
        layer(x, q, **masks)
    assert expected in str(info.value)
