"""The Routing Transformer's planted variants (see test_planted_real.py):
its set trains the most, so CI runs it in the other lane."""

import pytest

import keras

from keras_longattn.reproductions import planted as pl
from tests.notebooks import planted_record

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="the planted variants train on JAX only")

(ROUTING,) = pl.planted_sets(["routing_transformer"])


@pytest.mark.parametrize("variant", [v.name for v in ROUTING.variants])
def test_planted_variant_is_caught(variant):
    item = planted_record.check(ROUTING, variant)
    assert item.caught, f"routing_transformer/{variant}: " + "; ".join(item.problems()) + f" ({planted_record.source()})"


def test_every_asserted_claim_is_targeted_by_a_variant():
    asserted = planted_record.asserted(ROUTING)
    targeted = {name for v in ROUTING.variants for name in v.claims}
    assert asserted <= targeted, sorted(asserted - targeted)
