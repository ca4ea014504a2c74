"""Every planted variant of the reproductions is caught: a real broken layer
or model, trained through the notebook's own functions at a small size,
fails each claim it targets, and the real layers pass them at that size.

The variants train models, so they run on one backend (JAX, the backend the
committed full-size runs used); ``python -m keras_longattn.reproductions.planted``
runs the same checks and writes their table. When that committed run
describes today's code by bytes, its checks are read instead of trained
again (``planted_record``; ``KERAS_LONGATTN_PLANTED_TRAIN=1`` trains).
"""

import pytest

import keras

from keras_longattn.reproductions import planted as pl
from tests.notebooks import planted_record

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="the planted variants train on JAX only")

#: Trained elsewhere: routing in test_planted_real_routing.py (the longest
#: set: CI runs the two files in different lanes), longify in
#: test_planted_real_longify.py (it needs keras_hub).
ELSEWHERE = ("routing_transformer", "longify")
CASES = [(s.slug, v.name) for s in pl.planted_sets() for v in s.variants
         if s.slug not in ELSEWHERE]


@pytest.mark.parametrize("slug,variant", CASES, ids=[f"{s}-{v}" for s, v in CASES])
def test_planted_variant_is_caught(slug, variant):
    (planted,) = pl.planted_sets([slug])
    item = planted_record.check(planted, variant)
    assert item.caught, f"{slug}/{variant}: " + "; ".join(item.problems()) + f" ({planted_record.source()})"


def test_every_reproduction_declares_planted_variants():
    declared = {s.slug for s in pl.planted_sets()}
    assert declared == set(pl.PLANTED_MODULES)


@pytest.mark.parametrize("slug", sorted({s for s, _ in CASES}))
def test_every_asserted_claim_is_targeted_by_a_variant(slug):
    # After the variants above: the real run's arms are cached by then.
    (planted,) = pl.planted_sets([slug])
    asserted = planted_record.asserted(planted)
    targeted = {name for v in planted.variants for name in v.claims}
    assert asserted <= targeted, (
        f"{slug}: asserted claims that no planted variant targets: "
        f"{sorted(asserted - targeted)}")
