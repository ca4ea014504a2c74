"""Planted bugs: the claim checks of the reproduction notebooks must fail on
broken variants of the mechanisms, and pass on the real ones.

The checks are the notebooks' own (``keras_longattn.reproductions``). The
mechanism measurements run on tiny real layers (which keys a sparse layer's
heads really read on its training path; which cluster a routing layer puts
a query and its stored key in); the training results that the quality
claims read are synthetic per-seed numbers shaped like the notebooks'
outputs, with the broken variant's arm replaced by what that bug produces
(e.g. with random clusters the routing arm scores like the random control).
"""

from pathlib import Path

import pytest


from keras_longattn.reproductions import claims as cl

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _failed(claims):
    return {c.name for c in claims if c.failed}



# ---------------------------------------------------------------- claims.py


def test_compare_means_verdicts():
    assert cl.compare_means("a", "", [0.9, 0.95], [0.2, 0.25], 0.3).verdict == "reproduced"
    assert cl.compare_means("a", "", [0.4, 0.45], [0.2, 0.25], 0.3).verdict == "direction only"
    assert cl.compare_means("a", "", [0.2, 0.25], [0.4, 0.45], 0.1).verdict == "not reproduced"
    # A margin not above the seed spread cannot be asserted.
    noisy = cl.compare_means("a", "", [0.5, 1.0], [0.1, 0.15], 0.3)
    assert noisy.verdict == "not testable at this scale" and noisy.failed
    # Lower is better.
    assert cl.compare_means("b", "", [1.0, 1.02], [1.5, 1.52], 0.2,
                            higher_is_better=False).passed


def test_no_worse_than_and_speedup():
    assert cl.no_worse_than("p", "", [1.05, 1.06], [1.0, 1.01], 0.1,
                            higher_is_better=False).passed
    assert not cl.no_worse_than("p", "", [1.3, 1.31], [1.0, 1.01], 0.1,
                                higher_is_better=False).passed
    assert cl.speedup_claim("s", "", [2.0, 2.1, 1.9], [1.0, 1.1, 0.9], 1.5).passed
    assert cl.speedup_claim("s", "", [1.2, 1.2], [1.0, 1.0], 1.5).verdict == "direction only"
    with pytest.raises(cl.ClaimFailure):
        cl.assert_claims([cl.speedup_claim("s", "", [1.0], [1.0], 1.5)])
    table = cl.claims_table([cl.speedup_claim("s", "x", [2.0], [1.0], 1.5)])
    assert table.splitlines()[0].startswith("| claim | paper | ours")


def test_results_file_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = cl.results_file(None, "slug")
    assert default.is_absolute() and default.name == "slug.json"
    assert default.parent.name == "notebooks" and tmp_path not in default.parents
    assert cl.results_file("x.json", "slug") == Path("x.json")
