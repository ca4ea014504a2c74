"""The five tasks of the suite, each with its sizes and its data.

Every task is a classification problem built from the offline data of
:mod:`keras_longattn.datasets`; none of it is the Long Range Arena's own
data, and every size here is far smaller than LRA's (see the table below):

| task | data | LRA length | full size |
|---|---|---|---|
| `listops` | generated ListOps expressions, value 0-9 (10 classes) | 2000 | 1024 |
| `text` | a byte chunk of one of the 10 longest Wikipedia-sample articles: which one (10 classes) | 4000 | 1024 |
| `retrieval` | two byte chunks: from the same article? (2 classes; two-tower model; test articles unseen in training) | 4000 each | 512 each |
| `image` | scikit-learn's digits resized and read as pixel sequences (10 classes) | 1024 | 1024 |
| `pathfinder` | generated dashed-path images: are the two marked dots on one path? (2 classes) | 1024 | 1024 |

Sizes: ``"tiny"`` (unit tests: a few steps, seconds), ``"ci"`` (every task
for one layer in a few minutes on two CPU cores) and ``"full"`` (several
minutes per task and layer on such a machine). The data of a task depend only
on its size, never on the training seed: as in LRA, seeds vary the model's
initialisation and the order of the batches, not the data.

This module imports numpy and the dataset generators, not a backend.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

__all__ = [
    "SIZES",
    "TASKS",
    "Task",
    "TaskData",
    "TaskSize",
    "available_tasks",
    "get_task",
    "OVERRIDABLE",
]

#: The sizes every task defines, smallest first.
SIZES = ("tiny", "ci", "full")

#: Fields of :class:`TaskSize` that ``overrides`` may replace. The sequence
#: length is not among them: for the image tasks it follows from the
#: resolution, and the generators' settings go with it.
OVERRIDABLE = ("train_examples", "test_examples", "steps", "batch_size",
               "learning_rate", "dropout")

#: Seeds of the generated data (fixed: a task's data never change).
_TRAIN_DATA_SEED = 1
_TEST_DATA_SEED = 2


@dataclass(frozen=True)
class TaskSize:
    """One size of a task: its data and its training schedule.

    Attributes:
        seq_len: tokens per example (per document for ``retrieval``).
        train_examples: training examples generated (the digits have at most
            1438).
        test_examples: test examples, on which accuracy is measured.
        steps: training steps.
        batch_size: examples per step.
        learning_rate: peak learning rate (linear warm-up over the first
            10 % of the steps, then cosine decay to 0).
        dropout: dropout rate of the model.
        params: settings of the data generator (resolution, depth, ...).
    """

    seq_len: int
    train_examples: int
    test_examples: int
    steps: int
    batch_size: int
    learning_rate: float
    dropout: float = 0.0
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy."""
        data = dataclasses.asdict(self)
        data["params"] = dict(self.params)
        return data

    def replace(self, **overrides: Any) -> "TaskSize":
        """A copy with some of :data:`OVERRIDABLE` replaced (validated).

        Raises:
            ValueError: an unknown field or a bad value, naming it.
        """
        for key, value in overrides.items():
            if key not in OVERRIDABLE:
                raise ValueError(
                    f"cannot override {key!r}; overridable: {', '.join(OVERRIDABLE)}"
                )
            if key in ("learning_rate", "dropout"):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
                ok = ok and (0 < value if key == "learning_rate" else 0 <= value < 1)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            if not ok:
                raise ValueError(f"invalid override {key}={value!r}")
        return dataclasses.replace(self, **overrides)


@dataclass
class TaskData:
    """The arrays of one task at one size.

    Attributes:
        x_train: int32 token ids ``(N, n)``, 0 = padding; for paired tasks a
            tuple of two such arrays.
        y_train: int32 labels ``(N,)``.
        x_test: like ``x_train``.
        y_test: like ``y_train``.
        vocab_size: number of token ids, padding included.
    """

    x_train: Any
    y_train: np.ndarray
    x_test: Any
    y_test: np.ndarray
    vocab_size: int


@dataclass(frozen=True)
class Task:
    """One task of the suite.

    Attributes:
        name: short name (``--tasks``).
        title: column title of the table.
        description: one line for ``--list-tasks`` and the docs.
        num_classes: number of classes (chance is ``1 / num_classes`` on
            balanced test sets).
        paired: two inputs (a two-tower matching model) instead of one.
        lra_seq_len: the sequence length of the task in LRA, for comparison.
        sizes: :data:`SIZES` to :class:`TaskSize`.
    """

    name: str
    title: str
    description: str
    num_classes: int
    paired: bool
    lra_seq_len: int
    sizes: Mapping[str, TaskSize]
    _load: Callable[[TaskSize], TaskData] = field(repr=False, compare=False, default=None)

    def size(self, size: str, overrides: Mapping[str, Any] | None = None) -> TaskSize:
        """The :class:`TaskSize` called ``size``, with ``overrides`` applied."""
        if size not in self.sizes:
            raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
        return self.sizes[size].replace(**dict(overrides or {}))

    def load(self, size: TaskSize | str) -> TaskData:
        """Generate or load the data of this task at ``size``."""
        if isinstance(size, str):
            size = self.size(size)
        return self._load(size)


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


def _load_listops(size: TaskSize) -> TaskData:
    from keras_longattn.datasets import make_listops

    p = size.params
    kwargs = dict(min_length=p["min_length"], max_length=size.seq_len,
                  max_depth=p["max_depth"], max_args=p["max_args"])
    x_train, y_train = make_listops(size.train_examples, seed=_TRAIN_DATA_SEED, **kwargs)
    x_test, y_test = make_listops(size.test_examples, seed=_TEST_DATA_SEED, **kwargs)
    return TaskData(x_train, y_train, x_test, y_test, vocab_size=16)


def _article_chunks(num, seq_len, num_articles, part, seed):
    """Byte chunks of the ``num_articles`` longest Wikipedia articles,
    labelled by article: training chunks from the first 80 % of each
    article's bytes, test chunks from the last 20 % (never overlapping)."""
    from keras_longattn.datasets import load_wiki_articles

    articles = sorted(load_wiki_articles(), key=lambda item: (-len(item[1]), item[0]))
    texts = [np.frombuffer(text, dtype=np.uint8) for _, text in articles[:num_articles]]
    rng = np.random.default_rng(seed)
    labels = np.arange(num) % num_articles
    rng.shuffle(labels)
    x = np.zeros((num, seq_len), dtype=np.int32)
    for i, label in enumerate(labels):
        text = texts[label]
        cut = int(0.8 * len(text))
        low, high = (0, cut - seq_len) if part == "train" else (cut, len(text) - seq_len)
        if high <= low:
            raise ValueError(f"seq_len={seq_len} is too long for the text task")
        start = int(rng.integers(low, high + 1))
        x[i] = text[start:start + seq_len].astype(np.int32) + 1  # 0 is padding
    return x, labels.astype(np.int32)


def _load_text(size: TaskSize) -> TaskData:
    k = size.params["num_articles"]
    x_train, y_train = _article_chunks(size.train_examples, size.seq_len, k, "train",
                                       _TRAIN_DATA_SEED)
    x_test, y_test = _article_chunks(size.test_examples, size.seq_len, k, "test",
                                     _TEST_DATA_SEED)
    return TaskData(x_train, y_train, x_test, y_test, vocab_size=257)


def _load_retrieval(size: TaskSize) -> TaskData:
    from keras_longattn.datasets import make_document_matching

    def pairs(num, split, seed):
        a, b, y = make_document_matching(num, chunk_length=size.seq_len, split=split,
                                         seed=seed)
        return (a.astype(np.int32) + 1, b.astype(np.int32) + 1), y

    x_train, y_train = pairs(size.train_examples, "train", _TRAIN_DATA_SEED)
    x_test, y_test = pairs(size.test_examples, "test", _TEST_DATA_SEED)
    return TaskData(x_train, y_train, x_test, y_test, vocab_size=257)


def _load_image(size: TaskSize) -> TaskData:
    from keras_longattn.datasets import load_digits_sequences

    levels = size.params["levels"]
    (x_train, y_train), (x_test, y_test) = load_digits_sequences(
        resolution=size.params["resolution"], levels=levels, seed=0)
    return TaskData(x_train[:size.train_examples] + 1, y_train[:size.train_examples],
                    x_test[:size.test_examples] + 1, y_test[:size.test_examples],
                    vocab_size=levels + 1)


def _load_pathfinder(size: TaskSize) -> TaskData:
    from keras_longattn.datasets import make_pathfinder

    kwargs = dict(size.params)  # resolution, and path settings if any
    x_train, y_train = make_pathfinder(size.train_examples, seed=_TRAIN_DATA_SEED, **kwargs)
    x_test, y_test = make_pathfinder(size.test_examples, seed=_TEST_DATA_SEED, **kwargs)
    return TaskData(x_train + 1, y_train, x_test + 1, y_test, vocab_size=4)


# ---------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------


def _listops_size(seq_len, depth, args, **schedule):
    return TaskSize(seq_len=seq_len, params={"min_length": seq_len // 4, "max_depth": depth,
                                             "max_args": args}, **schedule)


def _pixels_size(resolution, extra=None, **schedule):
    return TaskSize(seq_len=resolution * resolution,
                    params={"resolution": resolution, **(extra or {})}, **schedule)


_TINY = dict(train_examples=64, test_examples=32, steps=2, batch_size=8, learning_rate=1e-3)

TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            name="listops", title="ListOps", num_classes=10, paired=False, lra_seq_len=2000,
            description="value (0-9) of a generated nested MAX/MIN/MED/SM expression",
            sizes={
                "tiny": _listops_size(32, 2, 3, **_TINY),
                "ci": _listops_size(128, 3, 5, train_examples=2000, test_examples=500,
                                    steps=150, batch_size=16, learning_rate=1e-3),
                "full": _listops_size(1024, 10, 10, train_examples=8000, test_examples=1000,
                                      steps=500, batch_size=16, learning_rate=5e-4,
                                      dropout=0.1),
            },
            _load=_load_listops,
        ),
        Task(
            name="text", title="Text", num_classes=10, paired=False, lra_seq_len=4000,
            description="which of the 10 longest Wikipedia-sample articles a byte chunk "
                        "comes from (test chunks from unseen parts of the articles)",
            sizes={
                "tiny": TaskSize(seq_len=32, params={"num_articles": 10}, **_TINY),
                "ci": TaskSize(seq_len=128, params={"num_articles": 10}, train_examples=2000,
                               test_examples=500, steps=150, batch_size=16,
                               learning_rate=1e-3),
                "full": TaskSize(seq_len=1024, params={"num_articles": 10},
                                 train_examples=8000, test_examples=1000, steps=500,
                                 batch_size=16, learning_rate=5e-4, dropout=0.1),
            },
            _load=_load_text,
        ),
        Task(
            name="retrieval", title="Retrieval", num_classes=2, paired=True, lra_seq_len=4000,
            description="whether two byte chunks come from the same Wikipedia-sample "
                        "article (two-tower model; test articles unseen in training)",
            sizes={
                "tiny": TaskSize(seq_len=32, **_TINY),
                "ci": TaskSize(seq_len=64, train_examples=2000, test_examples=500, steps=150,
                               batch_size=16, learning_rate=1e-3),
                "full": TaskSize(seq_len=512, train_examples=8000, test_examples=1000,
                                 steps=500, batch_size=16, learning_rate=5e-4, dropout=0.1),
            },
            _load=_load_retrieval,
        ),
        Task(
            name="image", title="Image", num_classes=10, paired=False, lra_seq_len=1024,
            description="scikit-learn's 8x8 digits resized and read as a pixel sequence "
                        "(17 grey levels), which digit",
            sizes={
                "tiny": _pixels_size(4, {"levels": 17}, **_TINY),
                "ci": _pixels_size(8, {"levels": 17}, train_examples=1438, test_examples=359,
                                   steps=150, batch_size=32, learning_rate=1e-3),
                "full": _pixels_size(32, {"levels": 17}, train_examples=1438,
                                     test_examples=359, steps=500, batch_size=16,
                                     learning_rate=5e-4, dropout=0.1),
            },
            _load=_load_image,
        ),
        Task(
            name="pathfinder", title="Pathfinder", num_classes=2, paired=False,
            lra_seq_len=1024,
            description="generated dashed-path images as pixel sequences: are the two "
                        "marked end points on one path",
            sizes={
                "tiny": _pixels_size(8, {"num_distractors": 0, "path_length": 4}, **_TINY),
                "ci": _pixels_size(12, train_examples=1000, test_examples=500, steps=150,
                                   batch_size=16, learning_rate=1e-3),
                "full": _pixels_size(32, train_examples=8000, test_examples=1000, steps=500,
                                     batch_size=16, learning_rate=5e-4, dropout=0.1),
            },
            _load=_load_pathfinder,
        ),
    )
}


def available_tasks() -> list[str]:
    """The task names, in the order of the table's columns."""
    return list(TASKS)


def get_task(name: str) -> Task:
    """The :class:`Task` called ``name``.

    Raises:
        KeyError: an unknown name; the message lists the known ones.
    """
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(
            f"unknown task {name!r}; known tasks: {', '.join(available_tasks())}"
        ) from None
