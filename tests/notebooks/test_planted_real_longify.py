"""The planted variants of the longify guide notebook (registered in
``planted.PLANTED_MODULES`` with the paper reproductions; trained here, not
in test_planted_real.py, since they need keras_hub): each real broken
conversion, trained and measured through the notebook's own functions at a
small size, fails the claims it targets, and the real conversion passes
them."""

import pytest

import keras

pytest.importorskip("keras_hub")

from keras_longattn.reproductions import planted as pl  # noqa: E402
from tests.notebooks import planted_record  # noqa: E402

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="the planted variants train on JAX only")

(LONGIFY,) = pl.planted_sets(["longify"])


@pytest.mark.parametrize("variant", [v.name for v in LONGIFY.variants])
def test_planted_variant_is_caught(variant):
    item = planted_record.check(LONGIFY, variant)
    assert item.caught, f"longify/{variant}: " + "; ".join(item.problems()) + f" ({planted_record.source()})"


def test_every_asserted_claim_is_targeted_by_a_variant():
    asserted = planted_record.asserted(LONGIFY)
    targeted = {name for v in LONGIFY.variants for name in v.claims}
    assert asserted <= targeted, sorted(asserted - targeted)
