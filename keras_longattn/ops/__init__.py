"""Pure functions on ``keras.ops``: attention patterns, the dense reference
attention (the specification) and blocked attention paths.

Shape legend used throughout: B batch, T query length, S key length,
H heads, d head size.
"""

from keras_longattn.ops.blocked import blocked_band_attention
from keras_longattn.ops.blocked import default_block_size
from keras_longattn.ops.blocked import local_attention
from keras_longattn.ops.blocked import pad_axis
from keras_longattn.ops.patterns import AttentionPattern
from keras_longattn.ops.patterns import CausalPattern
from keras_longattn.ops.patterns import FullPattern
from keras_longattn.ops.patterns import Intersection
from keras_longattn.ops.patterns import LocalPattern
from keras_longattn.ops.patterns import PaddingMask
from keras_longattn.ops.patterns import Union
from keras_longattn.ops.patterns import causal_pattern
from keras_longattn.ops.patterns import combine_dense_masks
from keras_longattn.ops.patterns import local_pattern
from keras_longattn.ops.patterns import resolve_window
from keras_longattn.ops.rotary import apply_rotary
from keras_longattn.ops.reference import MASKED_LOGIT
from keras_longattn.ops.reference import masked_softmax
from keras_longattn.ops.reference import reference_attention
from keras_longattn.ops.sparse import BlockPattern
from keras_longattn.ops.sparse import Difference
from keras_longattn.ops.sparse import StridedPattern
from keras_longattn.ops.sparse import SummaryPattern
from keras_longattn.ops.sparse import default_block_length
from keras_longattn.ops.sparse import default_summary_width
from keras_longattn.ops.sparse import sparse_attention
from keras_longattn.ops.sparse import sparse_head_patterns
from keras_longattn.ops.sparse import sparse_transformer_patterns
from keras_longattn.ops import routing
from keras_longattn.ops.routing import balanced_assignment
from keras_longattn.ops.routing import balanced_cluster_attention
from keras_longattn.ops.routing import cluster_statistics
from keras_longattn.ops.routing import clustered_window_attention
from keras_longattn.ops.routing import ema_update
from keras_longattn.ops.routing import gather_tokens
from keras_longattn.ops.routing import nearest_centroid
from keras_longattn.ops.routing import scatter_mean
from keras_longattn.ops.routing import segment_means
from keras_longattn.ops.routing import sphere_normalize
