"""The reference attention against a plain numpy transcription of the
definition, and the blocked path against the reference."""

import numpy as np
from keras.ops import convert_to_numpy as to_np
import pytest

from keras_longattn import ops as la_ops
from keras_longattn.testing import rel_error


def numpy_attention(q, k, v, mask):
    B, T, H, d = q.shape
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(B):
        for h in range(H):
            s = q[b, :, h] @ k[b, :, h].T / np.sqrt(d)
            m = np.broadcast_to(mask[b] if mask.ndim == 3 else mask, s.shape)
            for t in range(T):
                if not m[t].any():
                    continue
                e = np.exp(s[t][m[t]] - s[t][m[t]].max())
                out[b, t, h] = (e / e.sum()) @ v[b, :, h][m[t]]
    return out


def random_qkv(B=2, T=11, S=11, H=2, d=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype("float32") for s in ((B, T, H, d), (B, S, H, d), (B, S, H, d))]


def test_reference_matches_numpy_definition():
    q, k, v = random_qkv()
    rng = np.random.default_rng(3)
    mask = rng.random((2, 11, 11)) > 0.4
    mask[0, 3] = False  # a row with no visible key gives zeros
    out = to_np(la_ops.reference_attention(q, k, v, mask=mask))
    np.testing.assert_allclose(out, numpy_attention(q, k, v, mask), rtol=1e-5, atol=1e-6)
    assert np.all(out[0, 3] == 0)


def test_reference_returns_weights():
    q, k, v = random_qkv()
    mask = np.tril(np.ones((11, 11), bool))
    out, w = la_ops.reference_attention(q, k, v, mask=mask, return_scores=True)
    w = to_np(w)
    assert w.shape == (2, 2, 11, 11)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    assert np.all(w[..., ~mask] == 0)


def test_masked_softmax_fully_masked_row_is_zero():
    scores = np.zeros((2, 3), "float32")
    mask = np.array([[True, False, True], [False, False, False]])
    p = to_np(la_ops.masked_softmax(scores, mask))
    np.testing.assert_allclose(p, [[0.5, 0, 0.5], [0, 0, 0]])


@pytest.mark.parametrize("T, back, ahead, block", [(1, 3, 0, None), (17, 4, 0, 4), (17, 4, 2, 3), (33, 0, 0, 8), (20, 7, 7, None)])
def test_local_attention_equals_reference(T, back, ahead, block):
    q, k, v = random_qkv(T=T, S=T, seed=T)
    key_mask = np.ones((2, T), bool)
    key_mask[1, : T // 2] = False
    out = to_np(la_ops.local_attention(q, k, v, back, ahead, block_size=block, key_mask=key_mask))
    mask = to_np(la_ops.LocalPattern(back, ahead).dense_mask(T, T))[None] & key_mask[:, None, :]
    ref = to_np(la_ops.reference_attention(q, k, v, mask=mask))
    assert rel_error(out, ref) < 1e-5


def test_blocked_band_rejects_non_pattern():
    q, k, v = random_qkv()
    with pytest.raises(TypeError, match="pattern"):
        la_ops.blocked_band_attention(q, k, v, "local", 1, 1)


def test_rotary_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(0)
    q = np.repeat(rng.standard_normal((1, 1, 1, 8)), 12, axis=1).astype("float32")
    k = np.repeat(rng.standard_normal((1, 1, 1, 8)), 12, axis=1).astype("float32")
    rq = to_np(la_ops.apply_rotary(q, 100.0))[0, :, 0]
    rk = to_np(la_ops.apply_rotary(k, 100.0))[0, :, 0]
    s = rq @ rk.T
    np.testing.assert_allclose(s[5, 2], s[9, 6], rtol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q[0, :, 0], axis=-1), rtol=1e-5)
