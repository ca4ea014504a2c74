"""Every planted variant of the reproductions is caught: a real broken layer
or model, trained through the notebook's own functions at a small size,
fails each claim it targets, and the real layers pass them at that size.

The variants train models, so they run on one backend (JAX, the backend the
committed full-size runs used); ``python -m keras_longattn.reproductions.planted``
runs the same checks and writes their table.
"""

import pytest

import keras

from keras_longattn.reproductions import planted as pl

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="the planted variants train on JAX only")

#: Trained in test_planted_real_routing.py (the longest set: CI runs the two
#: files in different lanes).
ELSEWHERE = ("routing_transformer",)
CASES = [(s.slug, v.name) for s in pl.planted_sets() for v in s.variants
         if s.slug not in ELSEWHERE]


@pytest.mark.parametrize("slug,variant", CASES, ids=[f"{s}-{v}" for s, v in CASES])
def test_planted_variant_is_caught(slug, variant):
    (planted,) = pl.planted_sets([slug])
    item = pl.check(planted, variant)
    assert item.caught, f"{slug}/{variant}: " + "; ".join(item.problems())


def test_every_reproduction_declares_planted_variants():
    declared = {s.slug for s in pl.planted_sets()}
    assert declared == set(pl.PLANTED_MODULES)
