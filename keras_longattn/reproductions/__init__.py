"""Claim checks of the reproduction notebooks (``notebooks/<slug>.ipynb``).

Every notebook keeps its claims in importable functions here, so that the
notebook's assert cell, the paper page and the planted-bug tests
(``tests/notebooks/``) run the same code:

* :mod:`keras_longattn.reproductions.claims`: seed statistics (mean and
  spread over seeds), comparisons of means with a stated margin, ratios of
  medians for timings, and the :class:`Claim` record that carries a verdict;
* :mod:`keras_longattn.reproductions.routing_transformer`: the random-routing
  control layer, the unique-key recall task and the claims of the Routing
  Transformer notebook;
* :mod:`keras_longattn.reproductions.sparse_transformer`: the attention
  pattern *measured on the layer's training path* (which inputs each output
  depends on), two-step coverage, and the claims of the Sparse Transformer
  notebook.

Only :mod:`~keras_longattn.reproductions.claims` is imported here; the two
paper modules import Keras when they are imported.
"""

from keras_longattn.reproductions.claims import (  # noqa: F401
    Claim,
    ClaimFailure,
    SeedStats,
    assert_claims,
    claims_table,
    compare_means,
    ratio_of_medians,
    results_file,
    seed_stats,
    speedup_claim,
)
