"""The shared conformance suite that every attention layer runs.

Import it from a pytest module; it needs pytest installed (the ``dev``
extra).
"""

from keras_longattn.testing.conformance import AttentionLayerConformance
from keras_longattn.testing.conformance import rel_error
from keras_longattn.testing.gradients import input_gradient
from keras_longattn.testing.references import sorted_chunk_mask_loop
