"""Running the layers on several devices with ``keras.distribution``.

* :mod:`keras_longattn.parallel.layouts`: the ``LayoutMap`` that shards the
  attention heads and the feed-forward of the builders' models across a
  ``"model"`` mesh axis (``keras.distribution.ModelParallel``).
* :class:`ContextParallel`: a distribution that also splits the inputs'
  sequence axis across a ``"sequence"`` mesh axis.
* :mod:`keras_longattn.parallel.context`: context (sequence) parallelism on
  JAX: ring attention for full attention, a halo exchange for sliding
  windows (Local, Longformer, strided Sparse). Under a
  :class:`ContextParallel` in scope the layers run them by themselves
  (their ``"context_parallel"`` paths).
* :mod:`keras_longattn.parallel.measure`: per-device memory and collective
  traffic of a compiled program.

Not imported by ``import keras_longattn``; import it as
``keras_longattn.parallel``.
"""

from keras_longattn.parallel.context import causal_schedule
from keras_longattn.parallel.context import context_parallel_refusal
from keras_longattn.parallel.context import halo_local_attention
from keras_longattn.parallel.context import halo_longformer_attention
from keras_longattn.parallel.context import halo_strided_attention
from keras_longattn.parallel.context import ring_attention
from keras_longattn.parallel.context import zigzag_order
from keras_longattn.parallel.layouts import LAYOUT_RULES
from keras_longattn.parallel.layouts import ContextParallel
from keras_longattn.parallel.layouts import layout_map

__all__ = [
    "ContextParallel",
    "LAYOUT_RULES",
    "causal_schedule",
    "context_parallel_refusal",
    "halo_local_attention",
    "halo_longformer_attention",
    "halo_strided_attention",
    "layout_map",
    "ring_attention",
    "zigzag_order",
]
