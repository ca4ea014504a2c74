"""The LRA-style suite: tasks, runner, report and command line.

Training runs at the ``"tiny"`` size (two steps), in this process except for
one test of the subprocess path, on torch (``grid`` tests: every backend with
``--run-slow``); the check that a real model beats chance while a planted
broken one does not is slow (``--run-slow``).
"""

import json

import keras
import numpy as np
import pytest

from keras_longattn import cli
from keras_longattn.lra import (
    CSV_COLUMNS,
    SIZES,
    SuiteArgumentError,
    SuiteResults,
    available_tasks,
    get_task,
    parse_seeds,
    parse_tasks,
    run_suite,
)
from keras_longattn.lra.tasks import OVERRIDABLE

BACKEND = keras.backend.backend()
TASK_NAMES = ["listops", "text", "retrieval", "image", "pathfinder"]


# ---------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------


def test_registry_lists_the_five_tasks_in_table_order():
    assert available_tasks() == TASK_NAMES
    with pytest.raises(KeyError, match="unknown task 'cifar'.*listops"):
        get_task("cifar")


@pytest.mark.parametrize("name", TASK_NAMES)
def test_every_task_has_growing_sizes(name):
    task = get_task(name)
    assert tuple(task.sizes) == SIZES
    tiny, ci, full = (task.sizes[size] for size in SIZES)
    assert tiny.seq_len < ci.seq_len < full.seq_len <= task.lra_seq_len
    assert tiny.steps < ci.steps < full.steps
    for size in (tiny, ci, full):
        assert size.batch_size >= 1 and size.learning_rate > 0
        assert size.train_examples >= size.batch_size and size.test_examples >= 1
    # CI: short sequences, so that all five tasks run in a few minutes.
    assert ci.seq_len <= 256 and ci.steps <= 300
    # Full: at least 512 tokens, the lengths that separate the layers.
    assert full.seq_len >= 512


@pytest.mark.parametrize("name", TASK_NAMES)
def test_tiny_data_shapes_vocabulary_and_determinism(name):
    task = get_task(name)
    size = task.size("tiny")
    data = task.load(size)
    again = task.load("tiny")
    parts = data.x_train if task.paired else (data.x_train,)
    assert len(parts) == (2 if task.paired else 1)
    for part, other in zip(parts, again.x_train if task.paired else (again.x_train,)):
        assert part.shape == (size.train_examples, size.seq_len)
        assert part.dtype == np.int32 and 0 <= part.min() and part.max() < data.vocab_size
        np.testing.assert_array_equal(part, other)
    assert data.y_train.shape == (size.train_examples,)
    assert data.y_test.shape == (size.test_examples,)
    assert set(np.unique(data.y_train)) <= set(range(task.num_classes))


def test_pixel_and_byte_tokens_are_shifted_off_padding():
    # Value 0 is a real pixel or byte: it must not be read as padding.
    for name in ("image", "pathfinder", "text"):
        data = get_task(name).load("tiny")
        assert data.x_train.min() >= 1


def test_text_test_chunks_come_from_unseen_parts_of_the_articles():
    data = get_task("text").load("tiny")
    train = {bytes(row.astype(np.uint8)) for row in data.x_train}
    assert not train & {bytes(row.astype(np.uint8)) for row in data.x_test}


def test_size_overrides_are_validated():
    task = get_task("image")
    assert task.size("ci", {"steps": 7}).steps == 7
    with pytest.raises(ValueError, match="cannot override 'seq_len'"):
        task.size("ci", {"seq_len": 10})
    with pytest.raises(ValueError, match="steps=0"):
        task.size("ci", {"steps": 0})
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        task.size("huge")
    assert "steps" in OVERRIDABLE


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------


def test_parse_tasks_and_seeds():
    assert parse_tasks(None) == TASK_NAMES == parse_tasks("all")
    assert parse_tasks("image, listops") == ["listops", "image"]
    assert parse_seeds(3) == [0, 1, 2] == parse_seeds("3")
    assert parse_seeds("4,1") == [4, 1]
    assert parse_seeds([2]) == [2]


@pytest.mark.parametrize(
    "kwargs, argument, text",
    [
        ({"tasks": "listops,cifar"}, "tasks", "unknown task 'cifar'"),
        ({"seeds": 0}, "seeds", "must be >= 1, got 0"),
        ({"seeds": "-1,2"}, "seeds", "must be >= 0, got -1"),
        ({"seeds": "x"}, "seeds", "'x'"),
        ({"size": "medium"}, "size", "unknown size 'medium'"),
        ({"layers": "nope"}, "layers", "unknown layer 'nope'"),
        ({"backend": "numpy"}, "backend", "unknown backend 'numpy'"),
        ({"overrides": {"seq_len": 3}}, "overrides", "cannot override 'seq_len'"),
        ({"window": 0}, "window", "got 0"),
        ({"options": ["other.window=3"]}, "option", "names no layer"),
    ],
)
def test_run_suite_refuses_bad_arguments(kwargs, argument, text):
    with pytest.raises(SuiteArgumentError, match=text) as info:
        run_suite(**{"size": "tiny", "backend": BACKEND, **kwargs})
    assert info.value.argument == argument


def test_all_layers_expands_to_every_registered_name():
    from keras_longattn.benchmarks import available_layers
    from keras_longattn.lra.runner import resolve_layers

    labels, specs = resolve_layers(["full", "local"], tasks=["image"], size="ci")
    assert labels == ["full", "local"]
    # "${window}" is evaluated per task: n / 8, at least 8.
    assert specs["local"]["image"]["config"] == {"window": 8, "num_heads": 2, "key_dim": 32}
    labels, _ = resolve_layers("all", tasks=["image"], size="ci")
    assert labels == available_layers()
    with pytest.raises(SuiteArgumentError, match="unknown layer 'nope'"):
        run_suite(layers=["all", "nope"], size="tiny", backend=BACKEND)


def test_unknown_layer_option_is_an_error_naming_it():
    with pytest.raises(SuiteArgumentError, match="'windoww'") as info:
        run_suite(layers='{"class_name": "LocalAttention", "config": {"windoww": 4}}',
                  tasks="image", size="tiny", backend=BACKEND, isolate=False)
    assert info.value.argument == "layers"
    with pytest.raises(SuiteArgumentError, match="'bogus'") as info:
        run_suite(layers="full", tasks="image", size="tiny", backend=BACKEND,
                  options=["bogus=1"], isolate=False)
    assert info.value.argument == "option"


def _cli_error(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        cli.main(["lra", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--tasks", "listops,cifar"], "argument --tasks: unknown task 'cifar'"),
        (["--seeds", "0"], "argument --seeds: the number of seeds must be >= 1, got 0"),
        (["--size", "medium"], "argument --size: invalid choice: 'medium'"),
        (["--layers", "nope", "--size", "tiny"], "argument --layers: unknown layer 'nope'"),
        (["--set", "seq_len=4"], "argument --set: expected NAME=VALUE"),
        (["--layers", '{"class_name": "FullAttention", "config": {"windoww": 1}}',
          "--tasks", "image", "--size", "tiny"], "argument --layers:"),
    ],
)
def test_cli_errors_name_the_argument(capsys, argv, text):
    assert text in _cli_error(capsys, *argv)


def test_cli_lists_tasks(capsys):
    assert cli.main(["lra", "--list-tasks"]) == 0
    out = capsys.readouterr().out
    for name in TASK_NAMES:
        assert name in out


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


#: Training the five tasks is Keras model code that the model tests cover on
#: every backend; here it runs on torch (the fastest on a CPU) and on every
#: backend with --run-slow.
trains = pytest.mark.grid


@pytest.fixture(scope="module")
def tiny_results():
    """Every task, one layer, one seed, two steps each, in this process."""
    return run_suite(layers="full", size="tiny", seeds=1, backend=BACKEND, isolate=False)


@trains
def test_tiny_run_fills_every_column(tiny_results):
    assert [(row["task"], row["status"]) for row in tiny_results] == [
        (name, "ok") for name in TASK_NAMES]
    for row in tiny_results:
        assert 0.0 <= row["accuracy"] <= 1.0
        assert row["step_ms"] > 0 and row["first_step_ms"] > 0
        assert row["peak_memory_bytes"] >= 0 and row["num_params"] > 0
        assert np.isfinite(row["final_loss"])
    (entry,) = tiny_results.summary()
    assert entry["layer"] == "full" and entry["speedup"] == pytest.approx(1.0)
    assert entry["average"] == pytest.approx(
        np.mean([row["accuracy"] for row in tiny_results]))
    table = tiny_results.table()
    header = table.splitlines()[0]
    for title in ("ListOps", "Text", "Retrieval", "Image", "Pathfinder", "Avg", "ms/step",
                  "Peak MiB", "Speed-up vs full", "Memory vs full"):
        assert title in header
    assert table.splitlines()[2].startswith("| full |")
    assert "sample standard deviation over 1 seed(s) [0]" in table


@trains
def test_json_and_csv_round_trip(tiny_results, tmp_path):
    paths = tiny_results.write(tmp_path)
    assert (tmp_path / "latest.json").exists() and (tmp_path / "latest.csv").exists()
    back = SuiteResults.from_json(paths["json"])
    assert list(back) == json.loads(json.dumps(list(tiny_results)))
    assert back.table() == tiny_results.table()
    from_csv = SuiteResults.from_csv(paths["csv"], tiny_results.metadata)
    assert len(from_csv) == len(tiny_results)
    for row, original in zip(from_csv, tiny_results):
        for key in CSV_COLUMNS:
            if isinstance(original.get(key), float):
                assert row[key] == pytest.approx(original[key])
            else:
                assert row[key] == original.get(key)
    assert from_csv.table() == tiny_results.table()


@trains
def test_same_seed_same_accuracy_and_loss(tiny_results):
    (again,) = run_suite(layers="full", tasks="image", size="tiny", seeds=[0],
                         backend=BACKEND, isolate=False)
    (first,) = [row for row in tiny_results if row["task"] == "image"]
    assert again["accuracy"] == first["accuracy"]
    assert again["final_loss"] == pytest.approx(first["final_loss"], rel=1e-6)


def test_spread_over_seeds_and_ratio_rows():
    rows = [
        {"layer": layer, "task": "image", "seed": seed, "status": "ok", "accuracy": accuracy,
         "step_ms": step_ms, "peak_memory_mib": mib}
        for layer, step_ms, mib, accuracies in (("full", 10.0, 100.0, (0.5, 0.7)),
                                                ("local", 5.0, 50.0, (0.4, 0.6)))
        for seed, accuracy in enumerate(accuracies)
    ] + [{"layer": "local", "task": "text", "seed": 0, "status": "oom", "message": "x"}]
    results = SuiteResults(rows, {"tasks": ["image", "text"], "layers": ["full", "local"],
                                  "seeds": [0, 1]})
    table = results.table()
    assert "| full | 60.0 ± 14.1 | missing |" in table
    assert "| local | 50.0 ± 14.1 | oom |" in table
    assert "2.00× | 0.50× |" in table
    assert "[50.0–70.0]" in results.table(spread="range")


@trains
def test_subprocess_run_streams_progress(capsys):
    from keras_longattn.benchmarks.progress import PlainProgress

    results = run_suite(layers="local", tasks="pathfinder", size="tiny", backend=BACKEND,
                        progress=PlainProgress())
    assert results[0]["status"] == "ok", results[0].get("detail")
    err = capsys.readouterr().err
    assert "[1/1] pathfinder local" in err and "step 2/2 loss" in err


@trains
def test_the_command_trains_and_writes_its_reports(tmp_path, capsys):
    # The command end to end (argument parsing, a fresh subprocess per
    # (layer, task), the JSON and CSV reports and the table).
    code = cli.main(["lra", "--size", "tiny", "--layers", "full", "--tasks", "image",
                     "--seeds", "1", "--backend", BACKEND, "--output", str(tmp_path),
                     "--quiet"])
    assert code == 0
    report = json.loads((tmp_path / "latest.json").read_text())
    assert [(row["task"], row["status"], row["backend"]) for row in report["rows"]] == [
        ("image", "ok", BACKEND)]
    csv_lines = (tmp_path / "latest.csv").read_text().splitlines()
    assert csv_lines[0].startswith("layer,task,seed,backend") and len(csv_lines) == 2
    assert csv_lines[1].startswith(f"full,image,0,{BACKEND},")
    assert "| full |" in capsys.readouterr().out


@pytest.mark.slow
def test_real_labels_beat_chance_shuffled_labels_do_not():
    # The easiest task: digits at 8x8. A planted broken run (labels
    # permuted) must come out near chance (10 %), the real one well above.
    kwargs = dict(layers="full", tasks="image", size="ci", backend=BACKEND, isolate=False,
                  overrides={"steps": 150})
    real = run_suite(**kwargs)[0]["accuracy"]
    broken = run_suite(shuffle_labels=True, **kwargs)[0]["accuracy"]
    assert real > 0.5, real
    assert broken < 0.2, broken
