"""Every layer of keras_longattn.models is registered and its config holds
every constructor argument."""

import inspect

import keras
import pytest

from keras_longattn import models
from keras_longattn.layers import LocalAttention

LOCAL = {"class_name": "LocalAttention",
         "config": {"num_heads": 2, "key_dim": 8, "window": 4}}

CASES = [
    (models.AttentionSublayer, dict(attention=LOCAL, dropout=0.1, causal=True)),
    (models.FeedForwardSublayer, dict(feedforward_dim=12, activation="relu")),
    (models.TransformerBlock, dict(attention=LOCAL, normalize_first=False)),
    (models.PositionEmbedding, dict(sequence_length=7)),
    (models.ClassToken, dict()),
    (models.SequencePooling, dict(mode="first")),
    (models.ShiftRight, dict(start_token=3)),
    (models.ReversibleEmbedding, dict(input_dim=5, output_dim=4, mask_zero=True)),
]


@pytest.mark.parametrize("cls, kwargs", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_config_holds_every_argument(cls, kwargs):
    layer = cls(**kwargs)
    config = layer.get_config()
    params = [
        name for name, p in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    # keras.layers.Embedding leaves out `weights` and unset LoRA arguments.
    inherited = {"weights", "lora_rank", "lora_alpha"}
    missing = [name for name in params if name not in config
               and not (cls is models.ReversibleEmbedding and name in inherited)]
    assert not missing
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is cls
    assert restored.get_config() == config
    assert keras.saving.get_registered_name(cls) == f"keras_longattn>{cls.__name__}"


def test_bad_layer_arguments():
    with pytest.raises(ValueError, match="mode='max'"):
        models.SequencePooling("max")
    with pytest.raises(ValueError, match="dropout=1.0"):
        models.FeedForwardSublayer(dropout=1.0)
    with pytest.raises(ValueError, match="feedforward_dim=0"):
        models.TransformerBlock(LOCAL, feedforward_dim=0)
    with pytest.raises(ValueError, match="sequence_length=0"):
        models.PositionEmbedding(0)
    with pytest.raises(ValueError, match="attention"):
        models.TransformerBlock(lambda: LocalAttention(2, 8))
