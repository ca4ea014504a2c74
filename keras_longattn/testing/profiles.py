"""Hypothesis profiles of the property suite, and its known failures.

``"ci"`` (derandomised, no deadline, few examples, no shrinking) is the
default; ``"slow"`` (random, 10x the examples, shrinking) is loaded by the
root ``conftest.py`` under ``--run-slow`` (:func:`load_profile`). A test's
number of examples is scaled by the active profile (:func:`example_budget`).
"""

import os

import pytest
from hypothesis import HealthCheck
from hypothesis import Phase
from hypothesis import settings

#: ``max_examples`` of the "ci" profile; tests scale their own counts by the
#: active profile's ``max_examples`` divided by this.
CI_MAX_EXAMPLES = 10
SLOW_MAX_EXAMPLES = 100

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=CI_MAX_EXAMPLES,
    database=None,
    # No shrinking: every new shape compiles again on JAX, and the suite's
    # strict xfails fail on every run.
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.register_profile(
    "slow",
    derandomize=False,
    deadline=None,
    max_examples=SLOW_MAX_EXAMPLES,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


def load_profile(run_slow=False):
    """Loads ``"slow"`` when asked, else ``"ci"``; ``HYPOTHESIS_PROFILE``
    names another registered profile."""
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("slow" if run_slow else "ci")
    settings.load_profile(name)
    return name


def slow_profile():
    """Whether the active profile is longer than "ci" (``--run-slow``)."""
    return settings.default.max_examples > CI_MAX_EXAMPLES


def example_budget(n):
    """``n`` examples under "ci", scaled by the active profile."""
    scale = settings.default.max_examples / CI_MAX_EXAMPLES
    return max(1, int(round(n * scale)))


def apply_known_failures(items):
    """Marks the tests listed in their class's ``known_failures`` as
    ``xfail(strict=True)`` (for ``pytest_collection_modifyitems``)."""
    for item in items:
        known = getattr(getattr(item, "cls", None), "known_failures", None)
        if not known:
            continue
        name = item.name
        base = getattr(item, "originalname", None) or name.split("[", 1)[0]
        reason = known.get(name, known.get(base))
        if reason is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
