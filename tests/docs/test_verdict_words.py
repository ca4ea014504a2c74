"""The words the claims tables show (`claims.shown_verdict`).

*reproduced* only for an asserted comparison of two arms whose margin is
wider than the spread; a reported claim says *measured*; a comparison
whose two arms give one and the same value in every seed (a ceiling or a
floor) is *not testable at this scale*. Checked on the rule itself, on
every committed results file and on every generated claims table of the
pages. Nothing here runs a notebook or imports Keras.
"""

import json
import re
from pathlib import Path

import pytest

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import pages

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))


def _committed_claims():
    for path in RESULTS:
        document = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(document, dict) and isinstance(document.get("claims"), list):
            for claim in document["claims"]:
                yield path.stem, claim


COMMITTED = list(_committed_claims())


@pytest.mark.parametrize("verdict", cl.VERDICTS)
@pytest.mark.parametrize("detail", ["", "difference 0.5000, margin 0.1, spread 0.0200",
                                    "deficit 0.0100, margin 0.1, spread 0.0200",
                                    "ratio 3.000, needs >= 2.0"])
def test_a_reported_claim_never_shows_reproduced(verdict, detail):
    shown = cl.shown_verdict(verdict, False, detail, "1.0 ± 0.0 (3 seeds)")
    assert "reproduced" not in shown
    assert shown.startswith("measured") or shown == cl.NOT_TESTABLE


def test_reproduced_needs_an_asserted_comparison_with_a_margin_wider_than_the_spread():
    comparison = cl.compare_means("c", "a beats b", [0.9, 0.92, 0.91], [0.5, 0.52, 0.51], 0.1)
    assert comparison.verdict == cl.REPRODUCED and comparison.shown == "reproduced"
    parity = cl.no_worse_than("p", "a is as good as b", [0.9, 0.91], [0.9, 0.92], 0.1)
    assert parity.shown == "reproduced"
    # the same comparisons reported, not asserted
    reported = cl.compare_means("c", "", [0.9, 0.92], [0.5, 0.52], 0.1, asserted=False)
    assert reported.verdict == cl.REPRODUCED and reported.shown == "measured"
    # an asserted threshold, probe or timing: a check that holds, no control arm
    assert cl.at_least("t", "", [0.9, 0.95], 0.8).shown == "holds"
    assert cl.at_most("t", "", [0.9, 0.95], 0.8).shown == "does not hold"
    assert cl.speedup_claim("s", "", [2.0, 2.1], [1.0, 1.0], 1.5).shown == "holds"
    assert cl.speedup_claim("s", "", [2.0, 2.1], [1.0, 1.0], 1.5, asserted=False).shown == "measured"
    # a stored comparison whose margin the spread reaches reproduces nothing
    assert cl.shown_verdict(cl.REPRODUCED, True, "difference 0.3000, margin 0.1, spread 0.2000") \
        == "holds"
    assert cl.shown_verdict(cl.DIRECTION_ONLY, False, "growth 1.35, needs >= 1.5") \
        == "measured, direction only"
    assert cl.shown_verdict(cl.NOT_REPRODUCED, False, "") == "measured, does not hold"


def test_a_ceiling_is_not_testable():
    """Both arms at 100 % in every seed: no margin can be met, the claim is
    not testable (not "not reproduced"), asserted or not."""
    ceiling = cl.compare_means("c", "learned beats fixed", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], 0.1)
    assert ceiling.verdict == cl.NOT_TESTABLE and "ceiling" in ceiling.detail
    assert ceiling.shown == cl.NOT_TESTABLE
    reported = cl.compare_means("c", "", [1.0, 1.0], [1.0, 1.0], 0.1, asserted=False)
    assert reported.shown == cl.NOT_TESTABLE
    # one seed per arm: a zero spread says nothing, an equal pair is a plain miss
    single = cl.compare_means("c", "", [0.6], [0.6], 0.1)
    assert single.verdict == cl.NOT_REPRODUCED and single.shown == "not reproduced"
    # a stored result written before the rule shows it too
    assert cl.shown_verdict(cl.NOT_REPRODUCED, False, "difference 0.0000, margin 0.1, "
                            "spread 0.0000", "x 1.000 ± 0.000 (3 seeds) vs y 1.000 ± 0.000 "
                            "(3 seeds)") == cl.NOT_TESTABLE


def test_the_entmax_ceiling_of_the_issue():
    """Issue #46: learned α against 1.5-entmax, both at 100 %, was shown
    "not reproduced"."""
    claim = next(c for slug, c in COMMITTED
                 if slug == "entmax" and c["name"] == "learned_beats_entmax15")
    assert cl.shown_verdict(claim["verdict"], claim["asserted"], claim["detail"],
                            claim["ours"]) == cl.NOT_TESTABLE


@pytest.mark.parametrize("slug,claim", COMMITTED,
                         ids=[f"{slug}:{claim['name']}" for slug, claim in COMMITTED])
def test_committed_claims_words(slug, claim):
    shown = cl.shown_verdict(claim["verdict"], bool(claim.get("asserted")),
                             claim.get("detail", ""), claim.get("ours", ""))
    assert shown in cl.SHOWN_VERDICTS
    if not claim.get("asserted"):
        assert "reproduced" not in shown, f"{slug}:{claim['name']} is reported"
    if shown == cl.REPRODUCED:
        match = re.match(r"(?:difference|deficit) \S+, margin (\S+), spread (\S+)", claim["detail"])
        assert match and float(match.group(1)) > float(match.group(2))


def _table_rows(text):
    for region in pages.parse_regions(text):
        if region.kind == "results-table" and region.spec.split()[0].endswith(":claims"):
            for line in region.text.strip().splitlines()[2:]:
                yield line


@pytest.mark.parametrize("page", pages.default_pages(ROOT),
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_show_reproduced_only_for_asserted_claims(page):
    for row in _table_rows(page.read_text(encoding="utf-8")):
        verdict = row.strip().strip("|").rsplit("|", 1)[1].strip()
        if "reproduced" in verdict:
            assert verdict.endswith("(asserted)"), row
        assert verdict.removesuffix(" (asserted)") in cl.SHOWN_VERDICTS, row
