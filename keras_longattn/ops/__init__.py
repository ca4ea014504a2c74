"""Pure functions on ``keras.ops``, organised by machinery (not by paper).

* :mod:`~keras_longattn.ops.patterns`: attention patterns as predicates on
  positions, their combinators (``&``, ``|``, :class:`Difference`), padding
  masks and dense-mask helpers;
* :mod:`~keras_longattn.ops.reference`: dense masked attention (the
  specification), the masked softmax with its log-sum-exp, and the exact
  merge of attention parts computed over disjoint key sets;
* :mod:`~keras_longattn.ops.fused`: the backend's fused kernel under the
  library's contract (zero rows where no key is visible), used by every
  ``"fused"`` implementation;
* :mod:`~keras_longattn.ops.blocked`: band attention over key blocks
  (local windows, dilated windows on a column layout) and dense attention
  inside gathered blocks;
* :mod:`~keras_longattn.ops.subset`: every query against a fixed subset of
  keys (summaries, global tokens);
* :mod:`~keras_longattn.ops.segments`: gathers, scatter-mean and segment
  sums over the ``(B, n, H, d)`` token layout;
* :mod:`~keras_longattn.ops.kernelized`: kernelized (linear) attention
  ``phi(Q) (phi(K)^T V)`` with a safe normaliser, and its explicit
  quadratic form;
* :mod:`~keras_longattn.ops.kmeans`: online spherical k-means (routing as a
  pure function);
* :mod:`~keras_longattn.ops.chunked`: sorted-chunk attention over buckets;
* :mod:`~keras_longattn.ops.rotary`: rotary position embeddings;
* :mod:`~keras_longattn.ops.entmax`: α-entmax normalisers, sparse
  alternatives to the softmax with exact gradients: :func:`sparsemax`,
  :func:`entmax15` (exact, sort-based), :func:`entmax_bisect` (any α, one
  α per head) are exported here; the dispatcher on α is
  ``ops.entmax.entmax`` (the module keeps the name ``entmax``, so that
  ``from keras_longattn.ops import entmax`` stays the module);
* :mod:`~keras_longattn.ops.layouts`: block layouts of block-sparse
  attention and the token arrangements behind them (NumPy, cached per
  shape);
* :mod:`~keras_longattn.ops.block_sparse`: each layer's pattern on the
  backend's block-sparse kernel (the ``"pallas"`` paths);
* :mod:`~keras_longattn.ops.paths`: the entry points and refusals of the
  layers' backend paths (``path="band_kernel"``, ``"block_sparse"``,
  ``"flex"``, ...);
* paper modules, with only what is specific to their paper:
  :mod:`~keras_longattn.ops.sparse` (Sparse Transformer patterns) and
  :mod:`~keras_longattn.ops.routing` (balanced cluster attention),
  :mod:`~keras_longattn.ops.adamra` (compression rates, the router) and
  :mod:`~keras_longattn.ops.performer` (FAVOR+ random features),
  :mod:`~keras_longattn.ops.longformer` (window convention, per-head
  dilation, global slots), :mod:`~keras_longattn.ops.bigbird` (window,
  global and random blocks), :mod:`~keras_longattn.ops.nystrom`
  (landmarks and the iterative pseudo-inverse) and
  :mod:`~keras_longattn.ops.lsh` (angular LSH, the combination of hashing
  rounds).

Backend-specific code lives in :mod:`keras_longattn.kernels`, never here:
ops reach it through the backend table
(:func:`keras_longattn.kernels.backend_ops`), and the kernels import
nothing from ops.

Shape legend used throughout: B batch, T query length, S key length,
H heads, d head size.
"""

from keras_longattn.ops import adamra
from keras_longattn.ops import bigbird
from keras_longattn.ops import chunked
from keras_longattn.ops import entmax
from keras_longattn.ops import kernelized
from keras_longattn.ops import kmeans
from keras_longattn.ops import performer
from keras_longattn.ops import longformer
from keras_longattn.ops import lsh
from keras_longattn.ops import nystrom
from keras_longattn.ops import routing
from keras_longattn.ops import segments
from keras_longattn.ops import shapes
from keras_longattn.ops import sparse
from keras_longattn.ops import subset
from keras_longattn.ops.bigbird import BigBirdPattern
from keras_longattn.ops.bigbird import bigbird_attention
from keras_longattn.ops.blocked import block_attention
from keras_longattn.ops.blocked import band_part
from keras_longattn.ops.blocked import blocked_band_attention
from keras_longattn.ops.blocked import default_block_size
from keras_longattn.ops.blocked import dilated_band_attention
from keras_longattn.ops.blocked import local_attention
from keras_longattn.ops.blocked import pad_axis
from keras_longattn.ops.chunked import sorted_chunk_attention
from keras_longattn.ops.chunked import sorted_chunk_mask
from keras_longattn.ops.entmax import entmax15
from keras_longattn.ops.entmax import entmax_bisect
from keras_longattn.ops.entmax import sparsemax
from keras_longattn.ops.fused import fused_dot_product_attention
from keras_longattn.ops.kernelized import associative_attention
from keras_longattn.ops.kernelized import causal_kernel_attention
from keras_longattn.ops.kernelized import feature_map
from keras_longattn.ops.kernelized import kernel_attention
from keras_longattn.ops.kernelized import kernel_attention_reference
from keras_longattn.ops.kernelized import normalized_kernel_weights
from keras_longattn.ops.kernelized import safe_denominator
from keras_longattn.ops.kmeans import Routing
from keras_longattn.ops.kmeans import route
from keras_longattn.ops.patterns import AttentionPattern
from keras_longattn.ops.patterns import CausalPattern
from keras_longattn.ops.patterns import DilatedPattern
from keras_longattn.ops.patterns import Difference
from keras_longattn.ops.patterns import FullPattern
from keras_longattn.ops.patterns import GlobalPattern
from keras_longattn.ops.patterns import Intersection
from keras_longattn.ops.patterns import LocalPattern
from keras_longattn.ops.patterns import PaddingMask
from keras_longattn.ops.patterns import Union
from keras_longattn.ops.patterns import causal_pattern
from keras_longattn.ops.patterns import combine_dense_masks
from keras_longattn.ops.patterns import exclude_self_unless_alone
from keras_longattn.ops.patterns import local_pattern
from keras_longattn.ops.patterns import resolve_window
from keras_longattn.ops.reference import MASKED_LOGIT
from keras_longattn.ops.reference import masked_softmax
from keras_longattn.ops.reference import merge_attention_parts
from keras_longattn.ops.reference import reference_attention
from keras_longattn.ops.reference import softmax_with_lse
from keras_longattn.ops.rotary import apply_rotary
from keras_longattn.ops.segments import contiguous_segment_matrix
from keras_longattn.ops.segments import contiguous_segment_means
from keras_longattn.ops.segments import gather_tokens
from keras_longattn.ops.shapes import length
from keras_longattn.ops.segments import scatter_mean
from keras_longattn.ops.segments import segment_sum
from keras_longattn.ops.sparse import BlockPattern
from keras_longattn.ops.sparse import StridedPattern
from keras_longattn.ops.sparse import SummaryPattern
from keras_longattn.ops.sparse import default_block_length
from keras_longattn.ops.sparse import default_summary_width
from keras_longattn.ops.sparse import sparse_attention
from keras_longattn.ops.sparse import sparse_head_patterns
from keras_longattn.ops.sparse import sparse_transformer_patterns
from keras_longattn.ops.subset import key_subset_attention
from keras_longattn.ops.longformer import longformer_attention
from keras_longattn.ops.longformer import longformer_head_patterns
from keras_longattn.ops import layouts
from keras_longattn.ops import block_sparse
from keras_longattn.ops import paths
