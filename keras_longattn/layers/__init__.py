"""Attention layers. Each is a drop-in replacement for
``keras.layers.MultiHeadAttention``."""

from keras_longattn.layers.base_attention import AttentionContext
from keras_longattn.layers.base_attention import BaseAttention
from keras_longattn.layers.full_attention import FullAttention
from keras_longattn.layers.dispatch import Implementation
from keras_longattn.layers.dispatch import implementation
from keras_longattn.layers.local_attention import LocalAttention
from keras_longattn.layers.sparse_attention import SparseAttention
from keras_longattn.layers.routing_attention import RoutingAttention
from keras_longattn.layers.adamra_attention import AdaMRAAttention
from keras_longattn.layers.linformer_attention import LinformerAttention
from keras_longattn.layers.linformer_attention import LinformerProjection
from keras_longattn.layers.synthesizer_attention import SynthesizerAttention
from keras_longattn.layers.longformer_attention import LongformerAttention
from keras_longattn.layers.bigbird_attention import BigBirdAttention
from keras_longattn.layers.nystrom_attention import NystromAttention
from keras_longattn.layers.lsh_attention import LSHAttention
from keras_longattn.layers.linear_attention import LinearAttention
from keras_longattn.layers.performer_attention import PerformerAttention
