"""An offline Long-Range-Arena-style suite: five classification tasks,
any attention layer, accuracy with time per step and peak memory.

The tasks (:mod:`keras_longattn.lra.tasks`) stand in for LRA's, built from
offline data: generated ListOps, byte-level text classification and
byte-level document matching from the Wikipedia sample shipped with gensim,
scikit-learn's digits as pixel sequences, and generated Pathfinder images.
Every model is the paper's small configuration (AdaMRA and Nyströmformer's
LRA set-up: 2 layers, embedding 64, feed-forward 128, 2 heads), with the
given attention layer in both layers. The sizes are far smaller than LRA's.

Command line::

    keras-longattn lra --size ci --layers full --seeds 1
    keras-longattn lra --size full --layers full,local,routing --seeds 3

From Python::

    from keras_longattn.lra import run_suite
    results = run_suite(layers=["full", "local"], tasks=["listops", "image"],
                        seeds=3, size="ci")
    print(results.table())          # Markdown, mean ± std over the seeds
    results.to_json("lra.json"); results.to_csv("lra.csv")

Layers are given as the benchmark takes them (registered short names, class
references, Keras layer configs as dicts or JSON; see
:mod:`keras_longattn.specs`). Every (layer, task) trains in
a fresh subprocess (:mod:`keras_longattn.lra.worker`), so that its peak
memory is its own.

This package imports no backend; only the worker subprocess does.
"""

from .report import CSV_COLUMNS, SPREADS, SuiteResults, format_table, summarize
from .runner import (
    DEFAULT_OUTPUT_DIR,
    SuiteArgumentError,
    default_window,
    parse_seeds,
    parse_tasks,
    run_suite,
)
from .tasks import SIZES, TASKS, Task, TaskData, TaskSize, available_tasks, get_task

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_OUTPUT_DIR",
    "SIZES",
    "SPREADS",
    "TASKS",
    "SuiteArgumentError",
    "SuiteResults",
    "Task",
    "TaskData",
    "TaskSize",
    "available_tasks",
    "default_window",
    "format_table",
    "get_task",
    "parse_seeds",
    "parse_tasks",
    "run_suite",
    "summarize",
]
