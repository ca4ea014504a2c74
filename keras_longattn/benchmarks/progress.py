"""The progress display of a benchmark run: :mod:`keras_longattn.specs.progress`
(shared with the LRA-style suite) under the benchmark's module path."""

from __future__ import annotations

from keras_longattn.specs.progress import (
    GIB,
    MIB,
    PlainProgress,
    Progress,
    RichProgress,
    SilentProgress,
    describe_job,
    describe_outcome,
    make_progress,
)

__all__ = ["Progress", "PlainProgress", "RichProgress", "SilentProgress", "make_progress",
           "describe_job", "describe_outcome", "MIB", "GIB"]
