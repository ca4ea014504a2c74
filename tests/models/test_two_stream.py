"""Two-stream attention (MPNet, XLNet's PLM): the masks against the
paper's figure, and no leak by perturbation through stacked layers: the
query row of a predicted token never depends on that token's content (nor
on later predicted ones), on every backend; a query mask that lets a row
see its own content is caught."""

import keras
import numpy as np
import pytest

from keras_longattn.models.two_stream import TwoStreamAttention
from keras_longattn.models.two_stream import permute_for_prediction
from keras_longattn.models.two_stream import two_stream_masks

# MPNet, 7 tokens of which the last 3 are predicted; columns x1..x7, m5..m7
# (1 = may attend).
MPNET_CONTENT = """
1111000111
1111000111
1111000111
1111000111
1111100011
1111110001
1111111000
1111000111
1111000111
1111000111
"""
MPNET_QUERY = """
1111000111
1111100011
1111110001
"""


def _table(text):
    return np.array([[c == "1" for c in row] for row in text.split()], bool)


def test_mpnet_masks_are_the_papers():
    content, query = two_stream_masks(7, 3, "mpnet")
    np.testing.assert_array_equal(content, _table(MPNET_CONTENT))
    np.testing.assert_array_equal(query, _table(MPNET_QUERY))


def test_plm_masks():
    content, query = two_stream_masks(5, 2, "plm")
    np.testing.assert_array_equal(content, _table("11100 11100 11100 11110 11111"))
    np.testing.assert_array_equal(query, _table("11100 11110"))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_predicted"):
        two_stream_masks(3, 4)
    with pytest.raises(ValueError, match="kind"):
        two_stream_masks(3, 1, kind="mlm")
    with pytest.raises(ValueError, match="predict_ratio"):
        permute_for_prediction(np.zeros((1, 8), int), 1.5)
    with pytest.raises(ValueError, match="predict_ratio"):
        permute_for_prediction(np.zeros((1, 8), int), 0.0)
    with pytest.raises(ValueError, match="supports_attention_mask"):
        TwoStreamAttention({"class_name": "LocalAttention", "config": {
            "num_heads": 2, "key_dim": 4, "window": 4}})


N, B_PRED, DIM = 9, 3, 16


class _Encoder:
    """Two stacked two-stream layers with residuals (numpy in, numpy out):
    the query stream's output row of each predicted token."""

    def __init__(self, kind):
        keras.utils.set_random_seed(0)
        self.kind = kind
        self.layers = [TwoStreamAttention(num_heads=2, key_dim=8) for _ in range(2)]
        self.content_mask, self.query_mask = two_stream_masks(N, B_PRED, kind)
        rng = np.random.default_rng(1)
        self.mask_embedding = rng.normal(size=(DIM,)).astype("float32")
        self.position_table = rng.normal(size=(N, DIM)).astype("float32")

    def __call__(self, tokens, query_mask=None):
        # tokens: (B, N, DIM) content embeddings in permuted order, positions
        # 0..N-1 in that order (the permutation is the identity here).
        pos = self.position_table[None]
        content = tokens + pos
        predicted_pos = pos[:, N - B_PRED:]
        if self.kind == "mpnet":
            masks = self.mask_embedding + predicted_pos
            content = np.concatenate([content, np.broadcast_to(masks, (len(tokens),) + masks.shape[1:])],
                                     axis=1)
        query = np.broadcast_to(self.mask_embedding + predicted_pos,
                                (len(tokens), B_PRED, DIM)).astype("float32")
        content, query = keras.ops.convert_to_tensor(content), keras.ops.convert_to_tensor(query)
        qmask = self.query_mask if query_mask is None else query_mask
        for layer in self.layers:
            c_out, q_out = layer(content, query, self.content_mask, qmask)
            content, query = content + c_out, query + q_out
        return keras.ops.convert_to_numpy(query)


def _perturbed(x, column, seed):
    y = x.copy()
    y[:, column] += np.random.default_rng(seed).normal(size=y[:, column].shape) * 3
    return y


@pytest.mark.parametrize("kind", ["mpnet", "plm"])
def test_the_query_stream_never_sees_its_own_content(kind):
    model = _Encoder(kind)
    x = np.random.default_rng(2).normal(size=(2, N, DIM)).astype("float32")
    base = model(x)
    c = N - B_PRED
    for t in range(B_PRED):
        # The content of predicted token t and of every later one is unseen by
        # query rows 0..t.
        for column in range(c + t, N):
            moved = model(_perturbed(x, column, column))
            np.testing.assert_allclose(moved[:, :t + 1], base[:, :t + 1], atol=1e-5, rtol=0)
        # An earlier predicted token's content does reach row t.
        if t:
            moved = model(_perturbed(x, c + t - 1, 7))
            assert np.abs(moved[:, t] - base[:, t]).max() > 1e-3
    # Every row sees the non-predicted tokens.
    moved = model(_perturbed(x, 0, 9))
    assert np.abs(moved - base).max(axis=(0, 2)).min() > 1e-3


def test_a_query_row_that_sees_its_content_is_caught():
    model = _Encoder("mpnet")
    leaky = model.query_mask.copy()
    c = N - B_PRED
    for t in range(B_PRED):
        leaky[t, c + t] = True
    x = np.random.default_rng(2).normal(size=(2, N, DIM)).astype("float32")
    base = model(x, leaky)
    moved = model(_perturbed(x, c, 3), leaky)
    assert np.abs(moved[:, 0] - base[:, 0]).max() > 1e-3


def test_permuted_inputs():
    tokens = np.arange(20).reshape(2, 10)
    out = permute_for_prediction(tokens, 0.15, seed=4)
    assert out["num_predicted"] == 2
    np.testing.assert_array_equal(np.take_along_axis(tokens, out["positions"], 1), out["tokens"])
    for row in out["positions"]:
        assert sorted(row) == list(range(10))


def test_config_round_trip():
    layer = TwoStreamAttention(num_heads=2, key_dim=8)
    content_mask, query_mask = two_stream_masks(N, B_PRED)
    x = np.random.default_rng(0).normal(size=(1, N + B_PRED, DIM)).astype("float32")
    q = x[:, :B_PRED]
    c1, q1 = layer(x, q, content_mask, query_mask)
    clone = TwoStreamAttention.from_config(layer.get_config())
    clone(x, q, content_mask, query_mask)
    clone.set_weights(layer.get_weights())
    c2, q2 = clone(x, q, content_mask, query_mask)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(q1), keras.ops.convert_to_numpy(q2),
                               atol=1e-6)
