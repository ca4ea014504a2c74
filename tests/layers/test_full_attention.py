import keras
import numpy as np
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import FullAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error


class TestFullAttention(AttentionLayerConformance):
    layer_cls = FullAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8}
    implementation = "fused"
    compare_with_mha = True
    reference_lengths = (16, 37, 2048)


def test_dense_attention_mask_matches_mha():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 13, 16)).astype("float32")
    mask = rng.random((2, 13, 13)) > 0.3
    mask[:, :, 0] = True  # every query sees a key: MHA's rows are then defined
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    mha(x, x)
    layer = FullAttention.from_multi_head_attention(mha)
    for causal in (False, True):
        ours = to_np(layer(x, x, attention_mask=mask, use_causal_mask=causal))
        theirs = to_np(mha(x, x, attention_mask=mask, use_causal_mask=causal))
        assert layer.last_implementation == "fused"
        assert rel_error(ours, theirs) < 1e-5


def test_dropout_uses_reference_path_in_training_only():
    x = np.random.default_rng(0).standard_normal((2, 9, 16)).astype("float32")
    layer = FullAttention(num_heads=2, key_dim=8, dropout=0.5, seed=1)
    layer(x, x, training=True)
    assert layer.last_implementation == "reference"
    layer(x, x, training=False)
    assert layer.last_implementation == "fused"
