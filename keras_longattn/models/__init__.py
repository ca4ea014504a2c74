"""Transformer blocks and model builders around any attention layer.

Blocks: :class:`TransformerBlock` (the ``"sf"`` pair), the residual
sublayers :class:`AttentionSublayer` and :class:`FeedForwardSublayer`, and
:func:`build_sublayers` for any ``layer_pattern`` (see
:func:`sandwich_pattern`); :class:`TwoStreamAttention` and
:func:`two_stream_masks` for permuted language modelling (MPNet, XLNet),
and :func:`build_pretraining_model` (MLM, PLM or MPNet on one encoder).

Builders (each returns an uncompiled ``keras.Model``):
:func:`build_causal_language_model` (a :class:`CausalLanguageModel`, which
generates with the attention layers' decoding caches and keras-hub's
samplers), :func:`build_sequence_classifier`, :func:`build_matching_model`,
:func:`build_image_density_model` (with :func:`bits_per_dim`).

Saving: models and blocks save in ``.keras`` files. Importing this package
registers its classes and those of :mod:`keras_longattn.layers` with Keras,
so ``import keras_longattn.models`` must come before
``keras.saving.load_model`` (``import keras_longattn`` alone imports no
subpackage; see the install page's "Saving and loading").
"""

# Register the attention layers before any config is deserialised.
import keras_longattn.layers  # noqa: F401
from keras_longattn.models.attention_sublayer import AttentionSublayer
from keras_longattn.models.causal_language_model import CausalLanguageModel
from keras_longattn.models.causal_language_model import build_causal_language_model
from keras_longattn.models.class_token import ClassToken
from keras_longattn.models.feedforward_sublayer import FeedForwardSublayer
from keras_longattn.models.image_density_model import bits_per_dim
from keras_longattn.models.image_density_model import build_image_density_model
from keras_longattn.models.layer_pattern import interleaved_pattern
from keras_longattn.models.layer_pattern import sandwich_pattern
from keras_longattn.models.layer_pattern import validate_layer_pattern
from keras_longattn.models.matching_model import build_matching_model
from keras_longattn.models.mpnet import PretrainingModel
from keras_longattn.models.mpnet import TwoStreamBlock
from keras_longattn.models.mpnet import build_pretraining_model
from keras_longattn.models.position_embedding import PositionEmbedding
from keras_longattn.models.reversible_embedding import ReversibleEmbedding
from keras_longattn.models.sequence_classifier import build_sequence_classifier
from keras_longattn.models.sequence_pooling import SequencePooling
from keras_longattn.models.shift_right import ShiftRight
from keras_longattn.models.sublayer_stack import build_sublayers
from keras_longattn.models.transformer_block import TransformerBlock
from keras_longattn.models.two_stream import TwoStreamAttention
from keras_longattn.models.two_stream import permute_for_prediction
from keras_longattn.models.two_stream import two_stream_masks

__all__ = [
    "AttentionSublayer",
    "CausalLanguageModel",
    "ClassToken",
    "FeedForwardSublayer",
    "PositionEmbedding",
    "PretrainingModel",
    "ReversibleEmbedding",
    "SequencePooling",
    "ShiftRight",
    "TransformerBlock",
    "TwoStreamAttention",
    "TwoStreamBlock",
    "bits_per_dim",
    "build_causal_language_model",
    "build_image_density_model",
    "build_matching_model",
    "build_pretraining_model",
    "build_sequence_classifier",
    "build_sublayers",
    "interleaved_pattern",
    "permute_for_prediction",
    "sandwich_pattern",
    "two_stream_masks",
    "validate_layer_pattern",
]
