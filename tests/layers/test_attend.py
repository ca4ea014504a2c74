"""``BaseAttention.attend``: the attention between the projections."""

import numpy as np
import pytest
from keras import ops

from keras_longattn.layers import FullAttention, LocalAttention, RoutingAttention
from keras_longattn.layers import SparseAttention


def _np(x):
    return np.asarray(ops.convert_to_numpy(x))


LAYERS = [
    lambda: FullAttention(num_heads=2, key_dim=4),
    lambda: LocalAttention(num_heads=2, key_dim=4, window=5),
    lambda: SparseAttention(num_heads=2, key_dim=4, block_length=4),
    lambda: RoutingAttention(num_heads=2, key_dim=4, num_clusters=3),
]


@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize("causal", [False, True])
def test_attend_is_call_between_the_projections(make, causal):
    """call(x) == output_dense(attend(q(x), k(x), v(x))) on the same weights."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 13, 8)).astype("float32")
    layer = make()
    expected = _np(layer(x, x, use_causal_mask=causal))
    q = layer._query_dense(x)
    k = layer._key_dense(x)
    v = layer._value_dense(x)
    heads = layer.attend(q, k, v, use_causal_mask=causal)
    out = _np(layer._output_dense(heads))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_attend_checks_its_inputs():
    layer = FullAttention(num_heads=2, key_dim=4)
    q = np.zeros((1, 5, 2, 4), "float32")
    with pytest.raises(ValueError, match="built layer"):
        layer.attend(q, q, q)
    layer(np.zeros((1, 5, 8), "float32"), np.zeros((1, 5, 8), "float32"))
    with pytest.raises(ValueError, match=r"`key` must have shape .*Received: key.shape=\(1, 5, 3, 4\)"):
        layer.attend(q, np.zeros((1, 5, 3, 4), "float32"), q)
