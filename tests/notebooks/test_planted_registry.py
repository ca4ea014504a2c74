"""The planted-variant registry itself (no training): what counts as caught,
and clear errors for a variant that names no claim or an unknown one."""

import pytest

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import planted as pl


def _claims(verdict, asserted=True):
    return [cl.Claim("beats_control", "x beats y", "paper", "0.9 vs 0.1", verdict, asserted)]


def _set(real_verdict, planted_verdict, asserted=True, targets=("beats_control",)):
    def run(variant):
        return _claims(real_verdict if variant is None else planted_verdict, asserted)
    return pl.PlantedSet("demo", run, (pl.PlantedVariant("broken", "a broken layer", targets),))


def test_caught_needs_real_pass_and_planted_failure():
    assert pl.check(_set("reproduced", "not reproduced"), "broken").caught
    assert not pl.check(_set("reproduced", "reproduced"), "broken").caught
    # The real layers must pass at the size the variant ran at.
    item = pl.check(_set("direction only", "not reproduced"), "broken")
    assert not item.caught and "real layers" in item.problems()[0]
    # A claim that is only reported cannot catch anything.
    assert not pl.check(_set("reproduced", "not reproduced", asserted=False), "broken").caught


def test_table_names_claim_variant_and_verdicts():
    table = pl.results_table([pl.check(_set("reproduced", "not reproduced"), "broken")])
    row = table.splitlines()[2]
    assert "beats_control" in row and "`broken`" in row and "not reproduced" in row
    assert row.endswith("| yes |")


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="targets no claim"):
        pl.PlantedVariant("broken", "bug", ())
    with pytest.raises(KeyError, match="no claim named"):
        pl.check(_set("reproduced", "not reproduced", targets=("missing",)), "broken")
    with pytest.raises(KeyError, match="no planted variant"):
        _set("reproduced", "reproduced").variant("other")
    with pytest.raises(ValueError, match="slugs"):
        pl.planted_sets(["nope"])
