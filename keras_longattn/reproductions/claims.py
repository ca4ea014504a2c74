"""Seed statistics, claim checks with stated margins, and verdicts.

The rules every reproduction notebook follows (see ``papers/README.md``):

* a quality number is measured over several seeds and reported as its mean
  and its **spread** (largest minus smallest value over the seeds);
* a comparison of two arms asserts a difference of means of at least a
  stated ``margin``, and only when that margin is larger than the spread of
  both arms; when it is not, the verdict is *not testable at this scale*
  and an asserted claim fails (the margin was chosen too small for the
  noise, or the scale cannot separate the arms);
* a timing claim is a ratio of medians (of many timed steps), asserted
  against a stated minimum ratio.

Each check returns a :class:`Claim`, whose ``verdict`` is one of
:data:`VERDICTS`; :func:`assert_claims` raises on the asserted claims that
did not come out *reproduced*; :func:`claims_table` writes the paper page's
table. Only the standard library and NumPy are used here.

**The words a table shows** (:func:`shown_verdict`, the only place that
turns a verdict into a word on a page). The stored verdict says how the
check came out; the word shown also says what kind of evidence it is:

* *reproduced* only for an **asserted** comparison of two arms (the paper's
  claim against its control, :func:`compare_means` or
  :func:`no_worse_than`) whose margin is wider than the seed spread of both
  arms, and which met the margin;
* *holds* / *does not hold* for an asserted check that is not such a
  comparison (a stated threshold, a tolerance, a probe of the mechanism);
* *measured* (*measured, direction only*, *measured, does not hold*) for
  every claim that is reported, not asserted: timings, a spectrum, a
  census. A reported claim never shows *reproduced*;
* *not testable at this scale* when the spread is not below the margin, and
  for a comparison whose two arms give one and the same value in every
  seed (at least two seeds each): a ceiling or floor of the measure (e.g.
  both arms at 100 % accuracy), where no margin can be met.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "VERDICTS",
    "Claim",
    "ClaimFailure",
    "SeedStats",
    "assert_claims",
    "at_least",
    "at_most",
    "claims_table",
    "compare_means",
    "format_stats",
    "no_worse_than",
    "ratio_of_medians",
    "report_only",
    "results_file",
    "seed_stats",
    "shown_verdict",
    "speedup_claim",
]

REPRODUCED = "reproduced"
DIRECTION_ONLY = "direction only"
NOT_REPRODUCED = "not reproduced"
NOT_TESTABLE = "not testable at this scale"
#: The verdicts a claim can get.
VERDICTS = (REPRODUCED, DIRECTION_ONLY, NOT_REPRODUCED, NOT_TESTABLE)
HOLDS = "holds"
DOES_NOT_HOLD = "does not hold"
MEASURED = "measured"
#: The words :func:`shown_verdict` gives (a table adds "(asserted)" after
#: an asserted claim's).
SHOWN_VERDICTS = (REPRODUCED, DIRECTION_ONLY, NOT_REPRODUCED, HOLDS, DOES_NOT_HOLD,
                  MEASURED, f"{MEASURED}, {DIRECTION_ONLY}", f"{MEASURED}, {DOES_NOT_HOLD}",
                  NOT_TESTABLE)
#: The detail of a comparison of two arms, as :func:`compare_means` and
#: :func:`no_worse_than` write it.
_COMPARISON = re.compile(r"^(difference|deficit) (-?[0-9.]+(?:e-?[0-9]+)?), "
                         r"margin (-?[0-9.]+(?:e-?[0-9]+)?), spread ([0-9.]+(?:e-?[0-9]+)?)")
_ONE_SEED = re.compile(r"\(1 seeds?\)")


class ClaimFailure(AssertionError):
    """An asserted claim did not come out *reproduced*."""


@dataclasses.dataclass(frozen=True)
class SeedStats:
    """One number measured over seeds."""

    values: tuple

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def spread(self) -> float:
        """Largest minus smallest value (0 for one seed)."""
        return float(np.max(self.values) - np.min(self.values))

    def as_dict(self, digits: int = 4) -> dict:
        return {
            "mean": round(self.mean, digits),
            "spread": round(self.spread, digits),
            "seeds": self.n,
            "values": [round(float(v), digits) for v in self.values],
        }


def seed_stats(values: Iterable[float]) -> SeedStats:
    """:class:`SeedStats` of finite values (at least one)."""
    values = tuple(float(v) for v in values)
    if not values:
        raise ValueError("seed_stats needs at least one value")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"seed_stats got a non-finite value: {values}")
    return SeedStats(values)


def format_stats(stats: SeedStats, digits: int = 3) -> str:
    """``"0.912 ± 0.021 (3 seeds)"``: mean ± spread (max - min)."""
    return f"{stats.mean:.{digits}f} ± {stats.spread:.{digits}f} ({stats.n} seeds)"


@dataclasses.dataclass
class Claim:
    """A claim, what the paper reports, what we measured and the verdict."""

    name: str
    statement: str
    paper: str
    ours: str
    verdict: str
    asserted: bool
    detail: str = ""

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")

    @property
    def passed(self) -> bool:
        """Whether the claim came out reproduced."""
        return self.verdict == REPRODUCED

    @property
    def failed(self) -> bool:
        """An asserted claim that did not come out reproduced."""
        return self.asserted and not self.passed

    @property
    def shown(self) -> str:
        """The word a table shows for this claim (:func:`shown_verdict`)."""
        return shown_verdict(self.verdict, self.asserted, self.detail, self.ours)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "statement": self.statement,
            "paper": self.paper,
            "ours": self.ours,
            "verdict": self.verdict,
            "asserted": self.asserted,
            "detail": self.detail,
        }


def _saturated(a: SeedStats, b: SeedStats) -> bool:
    """Both arms give one and the same value in every seed, over at least
    two seeds each: a ceiling or floor of the measure."""
    return (a.n >= 2 and b.n >= 2 and a.spread == 0.0 and b.spread == 0.0
            and a.mean == b.mean)


def shown_verdict(verdict: str, asserted: bool, detail: str = "", ours: str = "") -> str:
    """The word a table shows for a claim (see the module's docstring).

    ``verdict`` is the stored verdict (:data:`VERDICTS`), ``asserted``
    whether the notebook asserts the claim, ``detail`` the check's detail
    (a comparison of two arms starts ``difference X, margin M, spread S``
    or ``deficit X, margin M, spread S``) and ``ours`` the measured text
    (``(1 seeds)`` in it: one seed, where a zero spread says nothing). It
    reads the stored fields only, so results committed before these words
    existed show them too.

    Raises:
        ValueError: for a verdict not in :data:`VERDICTS`.
    """
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {VERDICTS}, got {verdict!r}")
    comparison = _COMPARISON.match(detail or "")
    if verdict == NOT_TESTABLE:
        return NOT_TESTABLE
    if (comparison is not None and comparison.group(1) == "difference"
            and float(comparison.group(2)) == 0.0 and float(comparison.group(4)) == 0.0
            and not _ONE_SEED.search(ours or "")):
        # both arms the same constant over the seeds: a ceiling or floor
        return NOT_TESTABLE
    if not asserted:
        return {REPRODUCED: MEASURED, DIRECTION_ONLY: f"{MEASURED}, {DIRECTION_ONLY}",
                NOT_REPRODUCED: f"{MEASURED}, {DOES_NOT_HOLD}"}[verdict]
    if comparison is None:
        return {REPRODUCED: HOLDS, NOT_REPRODUCED: DOES_NOT_HOLD}.get(verdict, verdict)
    if verdict == REPRODUCED and not float(comparison.group(3)) > float(comparison.group(4)):
        return HOLDS  # a margin the spread reaches reproduces nothing
    return verdict


def _as_stats(values) -> SeedStats:
    return values if isinstance(values, SeedStats) else seed_stats(values)


def compare_means(
    name: str,
    statement: str,
    better,
    worse,
    margin: float,
    *,
    higher_is_better: bool = True,
    paper: str = "",
    asserted: bool = True,
    digits: int = 3,
    labels: Sequence[str] = ("", ""),
) -> Claim:
    """``better`` beats ``worse`` by at least ``margin`` (difference of means).

    Verdicts: *not testable at this scale* when ``margin`` is not larger than
    the spread of either arm, or when both arms give one and the same value
    in every seed (at least two seeds each: a ceiling or floor, e.g. both at
    100 % accuracy); else *reproduced* when the difference (in the
    direction of ``higher_is_better``) is at least ``margin``, *direction
    only* when it is positive but smaller, *not reproduced* otherwise.
    """
    a, b = _as_stats(better), _as_stats(worse)
    sign = 1.0 if higher_is_better else -1.0
    diff = sign * (a.mean - b.mean)
    spread = max(a.spread, b.spread)
    la, lb = labels
    ours = (f"{la + ' ' if la else ''}{format_stats(a, digits)} vs "
            f"{lb + ' ' if lb else ''}{format_stats(b, digits)}; "
            f"difference {diff:+.{digits}f}")
    detail = f"difference {diff:.4f}, margin {margin}, spread {spread:.4f}"
    if not margin > spread:
        verdict = NOT_TESTABLE
        detail += " (the seed spread is not below the margin)"
    elif _saturated(a, b):
        verdict = NOT_TESTABLE
        detail += (" (both arms give the same value in every seed, a ceiling or floor of "
                   "the measure: no margin can be met)")
    elif diff >= margin:
        verdict = REPRODUCED
    elif diff > 0:
        verdict = DIRECTION_ONLY
    else:
        verdict = NOT_REPRODUCED
    return Claim(name, statement, paper, ours, verdict, asserted, detail)


def no_worse_than(
    name: str,
    statement: str,
    candidate,
    reference,
    margin: float,
    *,
    higher_is_better: bool = True,
    paper: str = "",
    asserted: bool = True,
    digits: int = 3,
    labels: Sequence[str] = ("", ""),
) -> Claim:
    """``candidate`` is not worse than ``reference`` by ``margin`` or more
    (a parity claim). *Not testable* when the margin is not larger than the
    spread; *reproduced* when the mean of ``candidate`` is less than
    ``margin`` worse; *not reproduced* otherwise."""
    a, b = _as_stats(candidate), _as_stats(reference)
    sign = 1.0 if higher_is_better else -1.0
    deficit = sign * (b.mean - a.mean)  # > 0: candidate worse
    spread = max(a.spread, b.spread)
    la, lb = labels
    ours = (f"{la + ' ' if la else ''}{format_stats(a, digits)} vs "
            f"{lb + ' ' if lb else ''}{format_stats(b, digits)}; "
            f"{'behind' if deficit > 0 else 'ahead'} by {abs(deficit):.{digits}f}")
    detail = f"deficit {deficit:.4f}, margin {margin}, spread {spread:.4f}"
    if not margin > spread:
        verdict = NOT_TESTABLE
        detail += " (the seed spread is not below the margin)"
    elif deficit < margin:
        verdict = REPRODUCED
    else:
        verdict = NOT_REPRODUCED
    return Claim(name, statement, paper, ours, verdict, asserted, detail)


def at_least(name, statement, values, threshold, *, paper="", asserted=True, digits=3):
    """The mean over seeds is at least ``threshold``."""
    s = _as_stats(values)
    verdict = REPRODUCED if s.mean >= threshold else NOT_REPRODUCED
    return Claim(name, statement, paper, f"{format_stats(s, digits)} (needs >= {threshold})",
                 verdict, asserted, f"mean {s.mean:.4f}, threshold {threshold}")


def at_most(name, statement, values, threshold, *, paper="", asserted=True, digits=3):
    """The mean over seeds is at most ``threshold``."""
    s = _as_stats(values)
    verdict = REPRODUCED if s.mean <= threshold else NOT_REPRODUCED
    return Claim(name, statement, paper, f"{format_stats(s, digits)} (needs <= {threshold})",
                 verdict, asserted, f"mean {s.mean:.4f}, threshold {threshold}")


def report_only(name, statement, ours, verdict, *, paper="", detail=""):
    """A claim that is reported with a verdict but not asserted."""
    return Claim(name, statement, paper, ours, verdict, False, detail)


def ratio_of_medians(slow: Sequence[float], fast: Sequence[float]) -> float:
    """``median(slow) / median(fast)``: how many times faster ``fast`` is."""
    slow, fast = np.asarray(slow, float), np.asarray(fast, float)
    if slow.size == 0 or fast.size == 0:
        raise ValueError("ratio_of_medians needs timings on both sides")
    if not (np.all(np.isfinite(slow)) and np.all(np.isfinite(fast))):
        raise ValueError("ratio_of_medians got non-finite timings")
    if np.median(fast) <= 0:
        raise ValueError("the median of the fast timings is not positive")
    return float(np.median(slow) / np.median(fast))


def speedup_claim(name, statement, slow, fast, min_ratio, *, paper="", asserted=True,
                  labels=("slow", "fast")):
    """``fast`` is at least ``min_ratio`` times faster than ``slow`` (ratio of
    the medians of the timings). *Direction only* when the ratio is above 1
    but below ``min_ratio``."""
    ratio = ratio_of_medians(slow, fast)
    if ratio >= min_ratio:
        verdict = REPRODUCED
    elif ratio > 1.0:
        verdict = DIRECTION_ONLY
    else:
        verdict = NOT_REPRODUCED
    ours = (f"{ratio:.2f}x ({labels[0]} {1000 * float(np.median(slow)):.1f} ms vs "
            f"{labels[1]} {1000 * float(np.median(fast)):.1f} ms, medians of "
            f"{len(slow)} and {len(fast)})")
    return Claim(name, statement, paper, ours, verdict, asserted,
                 f"ratio {ratio:.3f}, needs >= {min_ratio}")


def assert_claims(claims: Iterable[Claim]) -> None:
    """Raises :class:`ClaimFailure` naming every asserted claim that did not
    come out reproduced."""
    failed = [c for c in claims if c.failed]
    if failed:
        lines = [f"{c.name}: {c.verdict} ({c.statement}; ours: {c.ours}; {c.detail})"
                 for c in failed]
        raise ClaimFailure("claims that do not hold:\n" + "\n".join(lines))


def claims_table(claims: Iterable[Claim]) -> str:
    """A Markdown table: claim | paper | ours | verdict, the verdict as
    :func:`shown_verdict` words it, with "(asserted)" after an asserted
    claim's."""
    lines = ["| claim | paper | ours (mean ± spread over seeds) | verdict |",
             "|---|---|---|---|"]
    for c in claims:
        verdict = c.shown + (" (asserted)" if c.asserted else "")
        lines.append(f"| {c.statement} | {c.paper or '—'} | {c.ours} | {verdict} |")
    return "\n".join(lines)


def results_file(results_path, slug: str) -> Path:
    """Where a notebook writes its results.

    ``None`` (the notebooks' default): ``build/notebooks/<slug>.json`` of the
    source checkout this package runs from, whatever the working directory
    (or of the working directory when the package is not in a checkout). A
    given path is used as given (relative to the working directory, which is
    how ``keras-longattn reproduce`` passes it)."""
    if results_path is not None:
        return Path(os.fspath(results_path)).expanduser()
    root = Path(__file__).resolve().parents[2]
    if not (root / "notebooks").is_dir():
        root = Path.cwd()
    return root / "build" / "notebooks" / f"{slug}.json"
