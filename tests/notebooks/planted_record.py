"""The planted variants' checks for tests/notebooks/test_planted_real*.py:
those of the committed planted run (``docs/results/planted_bugs.json``) when
it describes today's code by bytes (``planted.recorded_run``: every file it
recorded unchanged, every variant of the registry in it), else trained now
through the notebooks' own functions (``planted.check``). A check's
``caught`` is derived from the claim verdicts either way.

``KERAS_LONGATTN_PLANTED_TRAIN=1`` trains them even when the committed run
is current; ``python -m keras_longattn.reproductions.planted --write``
re-runs and records them all.
"""

import os

from keras_longattn.reproductions import planted as pl

RECORD = None if os.environ.get("KERAS_LONGATTN_PLANTED_TRAIN", "") not in ("", "0") \
    else pl.recorded_run()


def check(planted, variant):
    """What the targeted claims' checks saw (recorded, or trained now)."""
    if RECORD is not None:
        return RECORD["checks"][(planted.slug, variant)]
    return pl.check(planted, variant)


def asserted(planted):
    """The claims the real layers' run asserts at the planted size."""
    if RECORD is not None:
        return set(RECORD["asserted"][planted.slug])
    return set(pl.asserted_claims(planted))


def source():
    """Where the checks come from, for assertion messages."""
    if RECORD is not None:
        return f"the committed planted run at {str(RECORD['commit'])[:7]}"
    return "trained now"
