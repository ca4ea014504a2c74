"""Train and evaluate one (layer, task) of the suite, for every seed, in this process.

The runner (:mod:`keras_longattn.lra.runner`) starts this module in a fresh
subprocess per (layer, task), with ``KERAS_BACKEND`` set::

    KERAS_BACKEND=jax python -m keras_longattn.lra.worker '<json job>'

and reads two kinds of lines from its stdout: progress lines after
:data:`PROGRESS_MARKER` while it trains, and the result after the
benchmark's ``RESULT_MARKER`` at the end.

For each seed: ``keras.utils.set_random_seed(seed)``; the model is built
(:func:`build_model`: the paper's two layers, width 64, feed-forward 128) and
compiled with AdamW (linear warm-up over the first 10 % of the steps, then
cosine decay) and the sparse categorical cross-entropy; ``steps`` batches are
drawn with replacement by ``numpy.random.default_rng(seed)`` and trained
with ``train_on_batch``; the accuracy is measured on the whole test set.

Reported per seed: ``accuracy``, ``final_loss`` (mean of the last 10 % of
the steps), ``step_ms`` (median wall time of a training step, the first,
compiling, step left out), ``first_step_ms``, ``peak_memory_bytes`` and
``num_params``. Peak memory uses the benchmark's method
(:mod:`keras_longattn.benchmarks.worker`): on CPU the increase of the
process's peak RSS over its RSS once the model is built, the peak counter
being reset after the first step (so compilation's transient peak is left
out, what it keeps is counted); on an accelerator the increase of the
device allocator's peak.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Mapping

from keras_longattn.benchmarks.worker import RESULT_MARKER, record_failure

__all__ = ["PROGRESS_MARKER", "MODEL_CONFIG", "build_model", "train_and_evaluate", "run_job",
           "main"]

#: Prefix of a progress line on stdout.
PROGRESS_MARKER = "@@KERAS_LONGATTN_LRA_PROGRESS@@ "

#: The paper's small configuration (AdaMRA, after Xiong et al. 2021): two
#: layers, embedding 64, feed-forward 128; 2 heads of 32 as in the
#: Nyströmformer LRA configuration that the AdaMRA paper follows (a layer
#: config that sets ``num_heads`` keeps its own).
MODEL_CONFIG = {"num_layers": 2, "dim": 64, "feedforward_dim": 128, "num_heads": 2,
                "pooling": "mean", "positions": "learned"}


def build_model(task, data, attention, size, model_config=None):
    """The uncompiled classifier of ``task``: a sequence classifier, or a
    two-tower matching model for paired tasks (both from
    :mod:`keras_longattn.models`), with ``attention`` in every layer.

    ``attention`` is a layer config or a class name, taken like the
    benchmark's (:mod:`keras_longattn.specs`): the module of its class is
    imported first (:func:`keras_longattn.specs.resolver.resolve_class`),
    since the builders resolve configs only among the modules imported
    already; or a layer instance, used as the builders' template."""
    from keras_longattn.models import build_matching_model, build_sequence_classifier
    from keras_longattn.specs.resolver import resolve_class

    if isinstance(attention, str):
        resolve_class({"class_name": attention})
    elif isinstance(attention, Mapping):
        resolve_class(attention)
    config = {**MODEL_CONFIG, **(model_config or {})}
    builder = build_matching_model if task.paired else build_sequence_classifier
    return builder(
        vocab_size=data.vocab_size,
        sequence_length=size.seq_len,
        num_classes=task.num_classes,
        attention=attention,
        dropout=size.dropout,
        name=f"lra_{task.name}",
        **config,
    )


def _take(x, index):
    return tuple(part[index] for part in x) if isinstance(x, tuple) else x[index]


def _count(x):
    return len(x[0]) if isinstance(x, tuple) else len(x)


def _inputs(x):
    return list(x) if isinstance(x, tuple) else x


def train_and_evaluate(task, size, data, attention, seed, *, model_config=None,
                       report: Callable[[dict], None] | None = None,
                       memory_tracker=None, shuffle_labels: bool = False,
                       on_built: Callable[[Any], None] | None = None,
                       return_model: bool = False) -> dict[str, Any]:
    """Train one model on ``data`` and measure its test accuracy.

    Args:
        task: the :class:`~keras_longattn.lra.tasks.Task`.
        size: its :class:`~keras_longattn.lra.tasks.TaskSize`.
        data: its :class:`~keras_longattn.lra.tasks.TaskData`.
        attention: the attention layer config of every layer.
        seed: seed of the weights, dropout and batch order.
        model_config: overrides of :data:`MODEL_CONFIG`.
        report: called with a progress dict every tenth of the steps.
        memory_tracker: an object like the benchmark's ``HostMemory``, or
            ``None`` for one of those.
        shuffle_labels: train on randomly permuted labels (a planted broken
            model, for testing that the suite then reports chance).
        on_built: called with the model once it is built, before training.
        return_model: also return the trained model.

    Returns:
        The seed's measurements (see the module docstring), and the model
        with ``return_model``.
    """
    import keras
    import numpy as np

    from keras_longattn.benchmarks.worker import HostMemory

    keras.utils.set_random_seed(int(seed))
    model = build_model(task, data, attention, size, model_config)
    if on_built is not None:
        on_built(model)
    warmup = max(1, size.steps // 10)
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0, decay_steps=max(1, size.steps - warmup), alpha=0.0,
        warmup_target=size.learning_rate, warmup_steps=warmup)
    model.compile(optimizer=keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(int(seed))
    y_train = data.y_train
    if shuffle_labels:
        y_train = rng.permutation(y_train)
    num_train = _count(data.x_train)
    memory = memory_tracker if memory_tracker is not None else HostMemory()
    memory.start()
    every = max(1, size.steps // 10)
    times, losses = [], []
    start = time.perf_counter()
    for step in range(size.steps):
        index = rng.integers(0, num_train, size=size.batch_size)
        tic = time.perf_counter()
        loss = model.train_on_batch(_inputs(_take(data.x_train, index)), y_train[index])
        times.append((time.perf_counter() - tic) * 1e3)
        losses.append(float(np.asarray(loss).reshape(-1)[0]))
        if step == 0:
            memory.after_warmup()
        if report is not None and ((step + 1) % every == 0 or step + 1 == size.steps):
            report({"seed": int(seed), "step": step + 1, "steps": size.steps,
                    "loss": losses[-1], "elapsed_s": time.perf_counter() - start})
    peak = memory.increase()
    train_s = time.perf_counter() - start
    tic = time.perf_counter()
    logits = model.predict(_inputs(data.x_test), batch_size=max(64, size.batch_size), verbose=0)
    predictions = np.argmax(np.asarray(logits), axis=-1)
    tail = losses[-max(1, len(losses) // 10):]
    row = {
        "seed": int(seed),
        "accuracy": float(np.mean(predictions == data.y_test)),
        "final_loss": float(np.mean(tail)),
        "step_ms": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "first_step_ms": times[0],
        "train_s": train_s,
        "eval_s": time.perf_counter() - tic,
        "peak_memory_bytes": int(peak),
        "memory_method": memory.method,
        "num_params": int(model.count_params()),
    }
    return (row, model) if return_model else row


def run_job(job: dict[str, Any], emit: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one (layer, task) job for all its seeds; never raises.

    Args:
        job: ``backend``, ``task`` (a name), ``size`` (a
            :class:`~keras_longattn.lra.tasks.TaskSize` as a dict), ``seeds``,
            ``layer`` (its label), ``layer_spec`` (the resolved layer config)
            and optionally ``model_config`` and ``shuffle_labels``.
        emit: where progress lines go (stdout by default).

    Returns:
        ``status`` (``"ok"``, ``"oom"`` or ``"error"``), ``message``,
        ``seeds`` (one dict per seed, see :func:`train_and_evaluate`),
        ``data_s`` and versions.
    """
    backend = job.get("backend") or os.environ.get("KERAS_BACKEND") or "jax"
    result: dict[str, Any] = {"status": "error", "message": "", "seeds": []}
    stage = "setup"
    try:
        if "keras" not in sys.modules:
            os.environ["KERAS_BACKEND"] = backend
        import keras

        from keras_longattn.benchmarks.worker import accelerator_memory
        from keras_longattn.lra.tasks import TaskSize, get_task

        if keras.backend.backend() != backend:
            raise RuntimeError(f"Keras runs {keras.backend.backend()!r}, the job asks for "
                               f"{backend!r}: set KERAS_BACKEND={backend}")
        result["keras_version"] = keras.__version__
        task = get_task(job["task"])
        size = TaskSize(**job["size"])
        stage = "data"
        tic = time.perf_counter()
        data = task.load(size)
        result["data_s"] = time.perf_counter() - tic
        for seed in job["seeds"]:
            stage = f"seed {seed}"

            def report(info, seed=seed):
                emit(PROGRESS_MARKER + json.dumps(info))

            result["seeds"].append(train_and_evaluate(
                task, size, data, job["layer_spec"], seed,
                model_config=job.get("model_config"), report=report,
                memory_tracker=accelerator_memory(backend),
                shuffle_labels=bool(job.get("shuffle_labels", False))))
        result["status"] = "ok"
    except BaseException as exc:  # noqa: BLE001 - everything becomes a status
        record_failure(result, stage, exc)
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m keras_longattn.lra.worker '<json job>'``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        job = json.loads(argv[0])
    except ValueError as exc:
        print(f"lra worker: cannot read the job: {exc}", file=sys.stderr)
        return 2
    result = run_job(job, emit=lambda line: print(line, flush=True))
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(result, default=repr), flush=True)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
