"""TransformerBlock and the residual sublayers."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.models import AttentionSublayer
from keras_longattn.models import FeedForwardSublayer
from keras_longattn.models import TransformerBlock

DIM, N = 16, 24


def local_config(window=6):
    return keras.saving.serialize_keras_object(
        LocalAttention(num_heads=2, key_dim=8, window=window)
    )


def token_model(block_factory, num_blocks=2, vocab=30):
    tokens = keras.Input((N,), dtype="int32")
    x = keras.layers.Embedding(vocab, DIM, mask_zero=True, name="embedding")(tokens)
    for _ in range(num_blocks):
        x = block_factory()(x)
    return keras.Model(tokens, x)


def random_tokens(batch=2, seed=0, vocab=30):
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(batch, N)).astype("int32")


def test_output_shape_and_defaults():
    block = TransformerBlock(local_config())
    x = np.random.default_rng(0).standard_normal((2, N, DIM)).astype("float32")
    assert tuple(block(x).shape) == (2, N, DIM)
    # Feed-forward width defaults to 4 * dim.
    assert block.feedforward_sublayer.hidden_dense.units == 4 * DIM
    assert isinstance(block.attention, LocalAttention)
    assert block.supports_masking


def test_config_blocks_get_their_own_attention():
    config = local_config()
    a, b = TransformerBlock(config), TransformerBlock(config)
    assert a.attention is not b.attention
    # The short form of a config works too.
    c = TransformerBlock({"class_name": "FullAttention",
                          "config": {"num_heads": 2, "key_dim": 8}})
    assert isinstance(c.attention, FullAttention)


def test_shared_instance_is_refused():
    attention = LocalAttention(num_heads=2, key_dim=8, window=4)
    first = TransformerBlock(attention)
    assert first.attention is attention  # an instance is used as is
    with pytest.raises(ValueError, match="share their weights"):
        TransformerBlock(attention)
    with pytest.raises(ValueError, match="share their weights"):
        AttentionSublayer(attention)


def test_causal_flag_reaches_attention():
    model = token_model(lambda: TransformerBlock(local_config(), causal=True))
    x = random_tokens()
    y = random_tokens(seed=1)
    cut = 10
    x2 = x.copy()
    x2[:, cut:] = y[:, cut:]
    out1, out2 = to_np(model(x)), to_np(model(x2))
    np.testing.assert_allclose(out1[:, :cut], out2[:, :cut], atol=1e-5)
    assert np.abs(out1[:, cut:] - out2[:, cut:]).max() > 1e-3


@pytest.mark.parametrize("normalize_first", [True, False])
def test_padding_mask_reaches_attention(normalize_first):
    """Values embedded at padded positions (token 0) do not change the
    outputs at unpadded positions."""
    model = token_model(
        lambda: TransformerBlock(local_config(window=40),
                                 normalize_first=normalize_first))
    x = random_tokens()
    x[0, 15:] = 0
    x[1, :5] = 0
    valid = x != 0
    out1 = to_np(model(x))
    table = model.get_layer("embedding").embeddings
    new = to_np(table).copy()
    new[0] = np.random.default_rng(3).standard_normal(DIM) * 50.0  # padding row
    table.assign(new)
    out2 = to_np(model(x))
    np.testing.assert_allclose(out1[valid], out2[valid], atol=1e-4)


def test_multi_head_attention_works():
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    block = TransformerBlock(mha, causal=True, normalize_first=False)
    x = np.ones((2, N, DIM), "float32")
    assert tuple(block(x).shape) == (2, N, DIM)
    restored = TransformerBlock.from_config(block.get_config())
    assert isinstance(restored.attention, keras.layers.MultiHeadAttention)


def test_get_config_round_trip():
    block = TransformerBlock(
        local_config(), feedforward_dim=24, dropout=0.1, activation="relu",
        normalize_first=False, causal=True, layer_norm_epsilon=1e-6)
    config = block.get_config()
    for key in ("attention", "feedforward_dim", "dropout", "activation",
                "normalize_first", "causal", "layer_norm_epsilon"):
        assert key in config
    assert config["attention"]["class_name"] == "LocalAttention"
    assert config["attention"]["config"]["window"] == 6
    restored = TransformerBlock.from_config(config)
    assert restored.get_config() == config
    assert restored.attention is not block.attention
    for cls in (AttentionSublayer, FeedForwardSublayer):
        layer = block.attention_sublayer if cls is AttentionSublayer else (
            block.feedforward_sublayer)
        again = cls.from_config(layer.get_config())
        assert again.get_config() == layer.get_config()


def test_functional_model_keras_round_trip(tmp_path):
    model = token_model(lambda: TransformerBlock(local_config(), causal=True,
                                                 feedforward_dim=20))
    x = random_tokens()
    x[0, 20:] = 0
    expected = to_np(model(x))
    path = tmp_path / "block.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_np(loaded(x)), expected, rtol=0, atol=1e-6)
