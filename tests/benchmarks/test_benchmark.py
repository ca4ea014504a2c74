"""Tests of keras_longattn.benchmarks and the ``keras-longattn bench`` command.

The suite runs once per backend; these tests use the current one. Workers
are subprocesses (several seconds each, mostly imports), so only one
end-to-end run and a few cheap failing workers are started.
"""

import csv
import io
import json
import math
import os
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_longattn import cli
from keras_longattn.benchmarks import (
    BenchmarkArgumentError,
    available_layers,
    compute_ratios,
    format_table,
    print_table,
    register,
    run_benchmark,
    unregister,
    write_reports,
)
from keras_longattn.benchmarks import config as bench_config
from keras_longattn.benchmarks import layer_config, runner, worker
from keras_longattn.benchmarks import registry as bench_registry
from keras_longattn.benchmarks.report import CSV_COLUMNS, format_notes, to_csv

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

BACKEND = keras.backend.backend()

DASH = "\u2014"


def _layers_and_baseline():
    """``(["full", "local"], "full")`` once the project layers exist, else MHA."""
    import keras_longattn.layers as layers

    if hasattr(layers, "FullAttention") and hasattr(layers, "LocalAttention"):
        return ["full", "local"], "full"
    if hasattr(layers, "FullAttention"):
        return ["full", "mha"], "full"
    return ["mha"], "mha"


def _row(layer, seq_len, status="ok", median=None, peak=None, backend="jax",
         mode="fwdbwd", message=""):
    row = {"backend": backend, "layer": layer, "seq_len": seq_len, "mode": mode,
           "status": status, "message": message}
    if status == "ok":
        row.update(median_ms=median, times_ms=[median, median], peak_memory_bytes=peak,
                   memory_method="rss-hwm")
    return row


def _synthetic_rows():
    mib = 1 << 20
    return [
        _row("full", 1024, median=100.0, peak=400 * mib),
        _row("local", 1024, median=25.0, peak=40 * mib),
        _row("full", 4096, status="oom", message="killed by the memory guard"),
        _row("local", 4096, median=90.0, peak=160 * mib),
        _row("full", 8192, status="skipped", message="full fwdbwd oom at n=4096"),
        _row("local", 8192, status="oom", message="killed by the memory guard: RSS 16.1 GiB"),
        _row("local", 1024, median=30.0, peak=50 * mib, backend="torch"),
    ]


# ---------------------------------------------------------------------------
# Ratios, table and files on synthetic results
# ---------------------------------------------------------------------------


def test_ratios_against_full():
    rows = compute_ratios(_synthetic_rows(), "full")
    full, local, full_oom, local_4k, skipped, local_oom, torch_row = rows
    assert full["time_ratio"] == 1.0 and full["memory_ratio"] == 1.0
    assert local["time_ratio"] == pytest.approx(4.0)
    assert local["memory_ratio"] == pytest.approx(0.1)
    assert local_4k["time_ratio"] is None and local_4k["memory_ratio"] is None
    assert local_4k["ratio_note"] == "full oom"
    assert full_oom["ratio_note"] == "oom"
    assert skipped["time_ratio"] is None and skipped["ratio_note"] == "skipped"
    assert local_oom["memory_ratio"] is None
    # No full on torch in this run: no ratio across backends.
    assert torch_row["time_ratio"] is None and torch_row["ratio_note"] == "full not run"
    assert all(row["baseline"] == "full" for row in rows)


def test_ratios_without_baseline_and_zero_peak():
    rows = compute_ratios(_synthetic_rows(), None)
    assert all(row["time_ratio"] is None and row["ratio_note"] == "" for row in rows)
    rows = [_row("full", 64, median=2.0, peak=0), _row("local", 64, median=1.0, peak=0)]
    compute_ratios(rows, "full")
    assert rows[1]["time_ratio"] == pytest.approx(2.0)
    assert rows[1]["memory_ratio"] is None and "peak 0" in rows[1]["ratio_note"]


def test_table_formatting():
    rows = compute_ratios(_synthetic_rows(), "full")
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["layer", "backend", "n", "mode", "median"]
    assert "speed-up vs full" in lines[0] and "mem ratio vs full" in lines[0]
    assert len(lines) == 2 + len(rows)
    local = lines[3]
    assert "25.0" in local and "4.00x" in local and "40.0" in local and "0.10" in local
    assert f"{DASH} (full oom)" in lines[5]
    assert lines[6].rstrip().endswith("skipped") and lines[7].rstrip().endswith("oom")
    assert f"{DASH} (full not run)" in lines[8]
    notes = format_notes(rows)
    assert "local n=8192 fwdbwd jax: oom: killed by the memory guard" in notes
    assert "full n=8192 fwdbwd jax: skipped" in notes
    no_ratio = format_table(compute_ratios(_synthetic_rows(), None))
    assert "speed-up" not in no_ratio


@pytest.mark.parametrize("use_rich", [False, None])
def test_print_table(use_rich):
    rows = compute_ratios(_synthetic_rows(), "full")
    stream = io.StringIO()
    print_table(rows, file=stream, use_rich=use_rich)
    text = stream.getvalue()
    assert "4.00x" in text and "not completed" in text and "killed by the memory guard" in text


def test_csv_and_json_files(tmp_path):
    rows = compute_ratios(_synthetic_rows(), "full")
    rows[0]["first_call_ms"] = float("nan")
    paths = write_reports(rows, {"config": {"layers": ["full", "local"]}}, tmp_path)
    assert set(paths) == {"json", "csv", "latest_json", "latest_csv"}
    assert paths["json"].name.startswith("bench-") and paths["json"].suffix == ".json"
    assert paths["json"].read_text() == paths["latest_json"].read_text()
    assert paths["csv"].read_text() == paths["latest_csv"].read_text()
    document = json.loads(paths["json"].read_text())
    assert document["config"]["layers"] == ["full", "local"]
    assert len(document["results"]) == len(rows)
    assert document["results"][0]["first_call_ms"] is None  # NaN is not JSON
    table = list(csv.DictReader(io.StringIO(paths["csv"].read_text())))
    assert list(table[0]) == list(CSV_COLUMNS)
    assert [r["status"] for r in table] == [r["status"] for r in rows]
    assert float(table[1]["time_ratio"]) == pytest.approx(4.0)
    assert table[3]["time_ratio"] == "" and table[3]["ratio_note"] == "full oom"
    assert table[0]["times_ms"] == "100.0000;100.0000"
    # A second report in the same second gets its own name.
    again = write_reports(rows, {}, tmp_path)
    assert again["json"] != paths["json"]
    assert to_csv([]).strip() == ",".join(CSV_COLUMNS)


# ---------------------------------------------------------------------------
# Settings, registry, skip-ahead
# ---------------------------------------------------------------------------


def test_parsing():
    assert bench_config.parse_lengths("4096, 1024,16k,1024") == [1024, 4096, 16384]
    assert bench_config.parse_modes("fwdbwd,fwd") == ["fwd", "fwdbwd"]
    assert bench_config.parse_option("local.block_size=128") == ("local.block_size", 128)
    assert bench_config.parse_option("dropout=0.1") == ("dropout", 0.1)
    assert bench_config.parse_option("implementation=blocked") == ("implementation", "blocked")
    assert bench_config.parse_option("use_bias=false") == ("use_bias", False)
    options = {"window": 64, "block_size": 32, "local.block_size": 128, "full.x": 1}
    assert bench_config.layer_options("local", options) == {"window": 64, "block_size": 128}
    assert bench_config.layer_options("mha", options) == {"window": 64, "block_size": 32}


@pytest.mark.parametrize(
    "kwargs, argument, text",
    [
        ({"layers": "full,nope"}, "layers",
         "known layers: " + ", ".join(bench_registry.available_layers())),
        ({"lengths": [1024, 0]}, "lengths", ">= 1"),
        ({"lengths": "12x"}, "lengths", "not an integer"),
        ({"backends": "mxnet"}, "backends", "jax, tensorflow, torch"),
        ({"modes": "bwd"}, "modes", "fwd, fwdbwd"),
        ({"repeats": 0}, "repeats", ">= 1"),
        ({"memory_limit_gb": -1}, "memory_limit_gb", "> 0"),
        ({"options": ["window"]}, "option", "name=value"),
        ({"baseline": "nope"}, "baseline", "unknown layer 'nope'"),
        ({"layers": '{"class_name": "LocalAttention", "config": {"window": 8}'},
         "layers", "invalid JSON layer config"),
        ({"layers": [{"class_name": "LocalAttention", "config": {"windw": 8}}]},
         "layers", "LocalAttention) does not accept the option 'windw'; accepted options: "),
        ({"layers": "local", "options": ["local.blocksize=3"]},
         "option", "layer 'local' (keras_longattn.layers.local_attention.LocalAttention) "
                   "does not accept the option 'blocksize'"),
        ({"layers": "local", "options": ["lcoal.window=3"]},
         "option", "option 'lcoal.window' names no layer of this run"),
        ({"layers": [{"class_name": "LocalAttention", "config": {"window": "${sqr(seq_len)}"}}]},
         "layers", "unknown function"),
        ({"layers": [{"class_name": "NoSuchAttention"}]}, "layers", "NoSuchAttention"),
        ({"layers": [{"class_name": "LocalAttention", "config": {"num_heads": 8}}],
          "num_heads": 2},
         "layers", "sets num_heads=8 in its config, but the benchmark's num_heads (--heads) is 2"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, argument, text):
    arguments = {"layers": "full", "lengths": [64], "backends": [BACKEND], **kwargs}
    with pytest.raises(BenchmarkArgumentError) as info:
        run_benchmark(**arguments)
    assert info.value.argument == argument
    assert argument in str(info.value) and text in str(info.value)


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--layers", "full,nope"], "argument --layers: unknown layer 'nope'; known layers:"),
        (["--lengths", "0"], "argument --lengths: sequence lengths must be >= 1"),
        (["--option", "oops"], "argument --option: expected name=value"),
        (["--repeats", "0"], "argument --repeats: must be >= 1"),
        (["--baseline", "nope"], "argument --baseline: unknown layer 'nope'"),
        (["--option", "blocksize=3"],
         "argument --option: layer 'full' (keras_longattn.layers.full_attention.FullAttention) "
         "does not accept the option 'blocksize'; accepted options: "),
        (["--layers", '{"class_name": "LocalAttention", "config": {"key_dim": 32}}'],
         "argument --layers: layer 'LocalAttention' sets key_dim=32 in its config, but the "
         "benchmark's head_dim (--head-dim) is 64"),
    ],
)
def test_cli_bad_arguments(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", *argv])
    assert info.value.code == 2
    assert text in capsys.readouterr().err


def test_cli_list_layers_and_help(capsys):
    assert cli.main(["bench", "--list-layers"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == available_layers()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench" in capsys.readouterr().out


def test_register_and_build():
    assert {"full", "local", "mha"} <= set(available_layers())
    with pytest.raises(ValueError, match="must be a Keras layer config dict"):
        register("lam", lambda h, d, n, o: None)
    with pytest.raises(ValueError, match="already registered"):
        register("mha", {"class_name": "MultiHeadAttention"})
    with pytest.raises(ValueError, match="unknown name 'n'"):
        register("bad", {"class_name": "LocalAttention", "config": {"window": "${n // 2}"}})
    assert "bad" not in available_layers()
    entry = register("mha2", {"class_name": "MultiHeadAttention",
                              "config": {"dropout": 0.0, "value_dim": "${key_dim // 2}"}})
    try:
        assert "mha2" in available_layers()
        config = bench_config.BenchmarkConfig.create(layers="mha2", lengths=[32],
                                                     num_heads=2, head_dim=8, baseline=None)
        spec = config.layer_spec("mha2", 32)
        assert spec == {"class_name": "MultiHeadAttention",
                        "config": {"dropout": 0.0, "value_dim": 4, "num_heads": 2, "key_dim": 8}}
        layer = layer_config.build_layer(spec)
        assert isinstance(layer, keras.layers.MultiHeadAttention)
        assert layer.get_config()["value_dim"] == 4
        assert entry.config["config"]["value_dim"] == "${key_dim // 2}"
    finally:
        unregister("mha2")
    assert "mha2" not in available_layers()
    with pytest.raises(layer_config.LayerUnavailableError, match="no attribute"):
        layer_config.build_layer({"class_name": "keras_longattn.benchmarks:nope"})


def test_placeholders():
    variables = {"seq_len": 4096, "window": 256, "num_heads": 4, "key_dim": 64}
    assert layer_config.evaluate_placeholder("max(1, round(sqrt(seq_len)))", variables) == 64
    assert layer_config.evaluate_placeholder("seq_len // window - 2 ** 3", variables) == 8
    for expression, text in [("__import__('os')", "unknown function"),
                             ("seq_len.bit_length()", "unknown function"),
                             ("'a' * 3", "only numbers"), ("n + 1", "unknown name 'n'"),
                             ("2 ** 1000", "too large"), ("seq_len +", "invalid placeholder")]:
        with pytest.raises(layer_config.LayerConfigError, match=text):
            layer_config.evaluate_placeholder(expression, variables)
    assert layer_config.substitute_placeholders(
        {"a": ["${window}", {"b": "${seq_len / 2}"}], "c": "text"}, variables
    ) == {"a": [256, {"b": 2048.0}], "c": "text"}
    with pytest.raises(layer_config.LayerConfigError, match="the whole value"):
        layer_config.substitute_placeholders("w${window}", variables)


def test_skip_ahead_rule():
    skip = runner._SkipAhead()
    job = {"backend": "jax", "layer": "full"}
    skip.record({**job, "seq_len": 4096, "mode": "fwd"}, "ok")
    skip.record({**job, "seq_len": 8192, "mode": "fwdbwd"}, "oom")
    assert skip.reason({**job, "seq_len": 16384, "mode": "fwdbwd"}) == "full fwdbwd oom at n=8192"
    assert skip.reason({**job, "seq_len": 16384, "mode": "fwd"}) is None
    skip.record({**job, "seq_len": 16384, "mode": "fwd"}, "timeout")
    assert "timeout" in skip.reason({**job, "seq_len": 32768, "mode": "fwd"})
    assert skip.reason({**job, "layer": "local", "seq_len": 32768, "mode": "fwd"}) is None
    assert skip.reason({**job, "backend": "torch", "seq_len": 32768, "mode": "fwd"}) is None


def test_worker_failures_become_statuses():
    assert worker._is_oom(MemoryError())
    assert worker._is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating"))
    assert not worker._is_oom(ValueError("shapes do not match"))
    result = worker.run_config({"backend": BACKEND, "layer": "x", "layer_spec": {
        "class_name": "keras_longattn.benchmarks.registry:nope"}})
    assert result["status"] == "error"
    assert "build" in result["message"] and "no attribute" in result["message"]
    other = "torch" if BACKEND != "torch" else "jax"
    result = worker.run_config({"backend": other, "layer": "mha"})
    assert result["status"] == "error" and f"KERAS_BACKEND={other}" in result["message"]


# ---------------------------------------------------------------------------
# Subprocesses
# ---------------------------------------------------------------------------


def test_memory_guard_kills_worker_as_oom(tmp_path):
    layers, baseline = _layers_and_baseline()
    rows = run_benchmark(layers=layers[:1], lengths=[64, 128], backends=[BACKEND],
                         modes=["fwd", "fwdbwd"], memory_limit_gb=0.03, repeats=1,
                         baseline=baseline, output_dir=tmp_path)
    assert [(row["seq_len"], row["mode"], row["status"]) for row in rows] == [
        (64, "fwd", "oom"), (64, "fwdbwd", "skipped"),
        (128, "fwd", "skipped"), (128, "fwdbwd", "skipped"),
    ]
    assert "memory guard" in rows[0]["message"]
    assert rows[0]["observed_max_rss_bytes"] > 0.03 * (1 << 30)
    assert "oom at n=64" in rows[3]["message"]
    assert all(row["time_ratio"] is None for row in rows)
    assert (tmp_path / "latest.json").exists()


def test_timeout_kills_worker():
    layers, baseline = _layers_and_baseline()
    rows = run_benchmark(layers=layers[:1], lengths=[64, 128], backends=[BACKEND],
                         modes=["fwd"], timeout=0.2, baseline=baseline)
    assert [row["status"] for row in rows] == ["timeout", "skipped"]
    assert "0.2 s" in rows[0]["message"] and "stderr_tail" in rows[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page-fault counts")
def test_page_fault_count_sees_fresh_memory():
    """Touching 64 MiB of new memory (mmap-backed, never touched before)
    faults in thousands of pages; re-touching it faults none."""
    import mmap

    buf = mmap.mmap(-1, 64 << 20)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # 4 KiB pages even where THP is "always"
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    before = worker._minor_faults()
    for offset in range(0, len(buf), 4096):
        buf[offset] = 1
    first = worker._minor_faults() - before
    before = worker._minor_faults()
    for offset in range(0, len(buf), 4096):
        buf[offset] = 2
    again = worker._minor_faults() - before
    buf.close()
    assert first >= 4096, first
    assert again < 256, again


_CHURN = """
import numpy as np
from keras_longattn.benchmarks import worker
if {settle}:
    assert worker.settle_allocator()
faults = []
for _ in range(6):
    before = worker._minor_faults()
    blocks = [np.ones(2 << 20, dtype=np.float32) for _ in range(4)]  # 4 x 8 MiB
    del blocks
    faults.append(worker._minor_faults() - before)
print(faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_settled_allocator_keeps_freed_memory():
    """Four 8 MiB blocks made and freed six times, in fresh processes: as
    glibc starts, every round gives part of them back to the system and
    faults it in again; settled, the rounds after the first reuse them."""
    import ast
    import platform
    import subprocess

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the settling is for glibc's malloc")
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "LD_PRELOAD"))}
    counts = {}
    for settle in (False, True):
        run = subprocess.run([sys.executable, "-c", _CHURN.format(settle=settle)], env=env,
                             capture_output=True, text=True, check=True)
        counts[settle] = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    # Unsettled, each later round faults in over 4 MiB again (about 10 MiB
    # here); settled, (almost) nothing.
    assert min(counts[False][2:]) > 1024, counts
    assert max(counts[True][2:]) < 256, counts


def test_worker_records_the_allocator_settings(monkeypatch):
    """glibc's malloc tunables and a preloaded allocator are part of a row;
    other variables are not."""
    import os

    for name in list(os.environ):
        if name.startswith("MALLOC_") or name in ("GLIBC_TUNABLES", "LD_PRELOAD"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4294967295")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so.2")
    monkeypatch.setenv("NOT_AN_ALLOCATOR", "1")
    settings = worker.allocator_settings()
    assert settings == {"MALLOC_TRIM_THRESHOLD_": "4294967295",
                        "LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.delenv("LD_PRELOAD")
    assert "MALLOC_TRIM_THRESHOLD_" not in worker.allocator_settings()


def test_worker_forward_in_process():
    """The forward step of the current backend, measured in this process."""
    layers, _ = _layers_and_baseline()
    result = worker.run_config({"backend": BACKEND, "layer": layers[-1], "mode": "fwd",
                                "seq_len": 32, "num_heads": 2, "head_dim": 8,
                                "repeats": 2, "options": {"window": 8}})
    assert result["status"] == "ok", result.get("traceback")
    assert len(result["times_ms"]) == 2 and result["median_ms"] > 0
    # One fault count per timed call.
    assert len(result["page_faults"]) == 2
    assert all(isinstance(f, int) and f >= 0 for f in result["page_faults"])
    assert result["first_call_ms"] > 0 and result["peak_memory_bytes"] >= 0
    assert result["memory_method"] in ("rss-hwm", "ru_maxrss", "device")
    assert result["num_params"] > 0 and result["device"]


def test_cli_end_to_end(tmp_path, capsys):
    """One run of the command line, forward+backward, n=64: the baseline by
    its short name and a LocalAttention given only as a layer config.

    (Each worker is a fresh process importing Keras and the backend, several
    seconds; the forward mode is covered in-process above.)
    """
    local = {"class_name": "LocalAttention", "config": {"window": 16, "look_back": 1}}
    assert "LocalAttention" not in available_layers()
    argv = ["bench", "--layers", "full", "--layers", json.dumps(local), "--lengths", "64",
            "--backends", BACKEND, "--modes", "fwdbwd", "--repeats", "2", "--heads", "2",
            "--head-dim", "16", "--timeout", "300", "--output-dir", str(tmp_path), "--plain"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    layers = ["full", "LocalAttention"]
    assert f"[1/2] full n=64 fwdbwd {BACKEND} ..." in captured.err
    assert "speed-up vs full" in captured.out and "LocalAttention" in captured.out

    document = json.loads((tmp_path / "latest.json").read_text())
    rows = document["results"]
    assert [row["layer"] for row in rows] == layers
    assert document["config"]["backends"] == [BACKEND]
    assert document["config"]["layer_specs"]["LocalAttention"] == local
    assert document["layer_classes"]["LocalAttention"].endswith("LocalAttention")
    assert document["machine"]["cpu_count"] >= 1
    assert document["machine"]["versions"]["keras"] == keras.__version__
    for row in rows:
        assert row["status"] == "ok", row.get("message")
        assert row["backend"] == BACKEND and row["seq_len"] == 64 and row["mode"] == "fwdbwd"
        assert len(row["times_ms"]) == 2
        assert all(math.isfinite(t) and t > 0 for t in row["times_ms"])
        assert min(row["times_ms"]) <= row["median_ms"] <= max(row["times_ms"])
        assert row["peak_memory_bytes"] >= 0 and row["memory_method"]
        assert row["time_ratio"] is not None and row["time_ratio"] > 0
        assert row["keras_version"] == keras.__version__
    assert rows[0]["layer"] == "full" and rows[0]["time_ratio"] == 1.0
    assert rows[0]["memory_ratio"] in (1.0, None)
    assert rows[0]["layer_spec"] == {"class_name": "FullAttention",
                                     "config": {"num_heads": 2, "key_dim": 16}}
    # The row says what ran: the config asked for, the class and its get_config().
    row = rows[1]
    assert row["layer_spec"] == {"class_name": "LocalAttention", "config": {
        "window": 16, "look_back": 1, "num_heads": 2, "key_dim": 16}}
    assert row["layer_class"] == "keras_longattn.layers.local_attention.LocalAttention"
    assert row["layer_config"]["window"] == 16 and row["layer_config"]["look_back"] == 1
    assert row["layer_config"]["num_heads"] == 2 and row["layer_config"]["key_dim"] == 16
    assert row["options"] == {}
    # ... the path the timed calls ran, and the sources the workers imported.
    assert row["implementation"] == _auto_path(row)
    assert "modules" not in row
    record = document["provenance"]
    assert record["backend"] == BACKEND
    assert "keras_longattn/layers/local_attention.py" in record["source_files"]
    assert "keras_longattn/benchmarks/worker.py" in record["source_files"]

    table = list(csv.DictReader(io.StringIO((tmp_path / "latest.csv").read_text())))
    assert [r["layer"] for r in table] == layers
    assert json.loads(table[1]["layer_spec"]) == row["layer_spec"]
    assert all(float(r["median_ms"]) > 0 for r in table)
    assert float(table[0]["time_ratio"]) == 1.0
    assert sorted(path.suffix for path in tmp_path.glob("bench-*")) == [".csv", ".json"]


def _auto_path(row):
    """The path ``implementation="auto"`` takes here for the row's layer."""
    from keras_longattn.layers import LocalAttention

    layer = LocalAttention.from_config(row["layer_config"])
    x = np.zeros((1, row["seq_len"], row["num_heads"] * row["head_dim"]), "float32")
    layer(x, x, use_causal_mask=row["causal"])
    return layer.last_implementation


def test_merged_benchmark_files_keep_each_runs_provenance(tmp_path):
    """scripts/merge_bench.py: each run keeps its record; the merged record
    is their union, and a file two runs saw with different bytes matches
    neither (so the merged file is stale); a run without one leaves none."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "merge_bench", Path(__file__).resolve().parents[2] / "scripts" / "merge_bench.py")
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)

    def run(name, backend, files, commit="c1"):
        document = {"config": {"backends": [backend], "lengths": [64], "modes": ["fwd"],
                               "layers": [name]},
                    "started": "s", "finished": "f",
                    "results": [{"backend": backend, "layer": name, "seq_len": 64,
                                 "mode": "fwd"}]}
        if files is not None:
            document["provenance"] = {"commit": commit, "backend": backend,
                                      "source_files": files, "source_sha256": "x"}
        path = tmp_path / f"{name}-{backend}.json"
        path.write_text(json.dumps(document))
        return str(path)

    a = run("full", "jax", {"a.py": "1", "b.py": "2"})
    b = run("local", "torch", {"a.py": "1", "b.py": "3", "c.py": "4"})
    out = tmp_path / "merged.json"
    merge.main(str(out), a, b, command="bash x.sh")
    merged = json.loads(out.read_text())
    assert [r["provenance"]["backend"] for r in merged["runs"]] == ["jax", "torch"]
    record = merged["provenance"]
    assert record["source_files"] == {"a.py": "1", "b.py": "differs between runs",
                                      "c.py": "4"}
    assert record["commit"] is None and record["backend"] == "jax,torch"
    assert "source_sha256" not in record and merged["command"] == "bash x.sh"

    merge.main(str(out), a, run("local", "torch", {"a.py": "1"}, commit="c2"))
    record = json.loads(out.read_text())["provenance"]
    assert record["commit"] == "c2" and record["commits"] == ["c1", "c2"]

    merge.main(str(out), a, run("local", "tensorflow", None))
    assert "provenance" not in json.loads(out.read_text())


@pytest.mark.parametrize("layer", ["sparse-strided", "sparse-fixed", "routing", "longformer",
                                   "bigbird"])
@pytest.mark.parametrize("scope", ["layer", "attention"])
def test_worker_new_layers_and_scopes_in_process(layer, scope):
    """The registry's sparse, routing, longformer and bigbird entries run in
    both scopes."""
    result = worker.run_config({"backend": BACKEND, "layer": layer, "mode": "fwdbwd",
                                "seq_len": 64, "num_heads": 2, "head_dim": 8,
                                "repeats": 1, "scope": scope, "options": {}})
    assert result["status"] == "ok", result.get("traceback")
    assert result["median_ms"] > 0
    expected = {"sparse-strided": "SparseAttention", "sparse-fixed": "SparseAttention",
                "routing": "RoutingAttention", "longformer": "LongformerAttention",
                "bigbird": "BigBirdAttention"}[layer]
    assert result["layer_class"].endswith(expected)


def test_scope_is_validated():
    with pytest.raises(BenchmarkArgumentError, match="scope"):
        bench_config.BenchmarkConfig.create(layers=["full"], lengths=[64], scope="projections")


def test_short_names_resolve_to_the_configs_measured_before():
    """The short names give the configurations of the former factories."""
    config = bench_config.BenchmarkConfig.create(
        layers="full,local,sparse-strided,sparse-fixed,routing,longformer,mha",
        lengths=[1024, 4096, 8192, 16384], backends=[BACKEND])
    head = {"num_heads": 4, "key_dim": 64}
    expected = {
        "full": {"class_name": "FullAttention", "config": head},
        "local": {"class_name": "LocalAttention", "config": {"window": 256, **head}},
        "sparse-strided": {"class_name": "SparseAttention",
                           "config": {"pattern": "strided", "block_length": 128, **head}},
        "sparse-fixed": {"class_name": "SparseAttention",
                         "config": {"pattern": "fixed", "block_length": 128, **head}},
        "longformer": {"class_name": "LongformerAttention",
                       "config": {"window": 512, "global_tokens": 16, **head}},
        "mha": {"class_name": "MultiHeadAttention", "config": head},
    }
    for name, spec in expected.items():
        assert config.layer_spec(name, 4096) == spec
    clusters = {1024: 32, 4096: 64, 8192: 91, 16384: 128}
    for seq_len, num_clusters in clusters.items():
        assert config.layer_spec("routing", seq_len) == {
            "class_name": "RoutingAttention", "config": {"num_clusters": num_clusters, **head}}
    # --window and --option reach the configs of short names.
    config = bench_config.BenchmarkConfig.create(
        layers="local,routing", lengths=[64], window=32, baseline=None,
        options=["routing.num_clusters=4", "routing.window=16"])
    assert config.layer_spec("local", 64)["config"]["window"] == 32
    assert config.layer_spec("routing", 64)["config"] == {
        "num_clusters": 4, "window": 16, "num_heads": 4, "key_dim": 64}
    routing = layer_config.build_layer(config.layer_spec("routing", 64))
    assert routing.num_clusters == 4 and routing.window == 16


def test_short_names_rebuild_the_committed_results():
    """Every layer of docs/benchmarks/results.json, rebuilt from its short name
    and the row's settings, has the row's get_config() (but its name)."""
    path = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "results.json"
    if not path.exists():
        pytest.skip("no committed benchmark results")
    rows = [row for row in json.loads(path.read_text())["results"]
            if row["status"] == "ok" and row.get("scope", "layer") == "layer"
            and row["layer"] in available_layers()]
    assert rows
    for row in rows:
        config = bench_config.BenchmarkConfig.create(
            layers=row["layer"], lengths=[row["seq_len"]], num_heads=row["num_heads"],
            head_dim=row["head_dim"], baseline=None)
        layer = layer_config.build_layer(config.layer_spec(row["layer"], row["seq_len"]))
        # Built at the row's length, as the benchmark does: sizes derived from
        # the length (routing's window, sparse block lengths) are fixed then.
        x = np.zeros((1, row["seq_len"], row["num_heads"] * row["head_dim"]), "float32")
        layer.build(x.shape, x.shape)
        built = {k: v for k, v in layer.get_config().items() if k != "name"}
        recorded = {k: v for k, v in row["layer_config"].items() if k != "name"}
        # Rows measured before sizes were fixed at build record them as None.
        for key in ("window", "block_length"):
            if recorded.get(key, 0) is None:
                built[key] = None
        assert built == recorded, (row["layer"], row["seq_len"])


def test_layer_references_and_serialized_configs(tmp_path, monkeypatch):
    """Classes by registered name, by import path (a layer outside the
    package, with no registry entry), and the serialize_keras_object form."""
    (tmp_path / "bench_user_layers.py").write_text(
        "import keras_longattn\n\n"
        "class HalfWindow(keras_longattn.layers.LocalAttention):\n"
        "    def __init__(self, num_heads, key_dim, half_window=4, **kwargs):\n"
        "        super().__init__(num_heads, key_dim, window=2 * half_window, **kwargs)\n"
        "        self.half_window = half_window\n\n"
        "    def get_config(self):\n"
        "        config = super().get_config()\n"
        "        config.pop('window')\n"
        "        return {**config, 'half_window': self.half_window}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import keras_longattn.layers as project

    serialized = keras.saving.serialize_keras_object(
        project.LocalAttention(num_heads=2, key_dim=8, window=8, name="local8"))
    assert serialized["module"] == "keras_longattn.layers.local_attention"
    serialized["build_config"] = {"input_shape": [1, 7, 16]}  # not the benchmark's shapes
    layers = ["keras_longattn>RoutingAttention",
              '{"class_name": "bench_user_layers:HalfWindow", "config": {"half_window": 3}}',
              serialized]
    config = bench_config.BenchmarkConfig.create(layers=layers, lengths=[32], num_heads=2,
                                                 head_dim=8, baseline="full")
    assert config.layers == ["full", "RoutingAttention", "HalfWindow", "local8"]
    classes = runner.check_layers(config, in_process=True)
    assert classes["HalfWindow"] == "bench_user_layers.HalfWindow"
    assert classes["local8"].endswith("LocalAttention")
    half = layer_config.build_layer(config.layer_spec("HalfWindow", 32))
    assert type(half).__name__ == "HalfWindow" and half.window == 6
    local8 = layer_config.build_layer(config.layer_spec("local8", 32))
    assert local8.window == 8 and local8.name == "local8" and not local8.built
    with pytest.raises(BenchmarkArgumentError, match="'windw'; accepted options: "):
        bad = bench_config.BenchmarkConfig.create(
            layers=layers[1], lengths=[32], options=["HalfWindow.windw=3"], baseline=None)
        runner.check_layers(bad, in_process=True)

    # The worker builds and measures the user layer from its config alone.
    result = worker.run_config({"backend": BACKEND, "layer": "HalfWindow", "mode": "fwd",
                                "seq_len": 32, "num_heads": 2, "head_dim": 8, "repeats": 1,
                                "layer_spec": config.layer_spec("HalfWindow", 32)})
    assert result["status"] == "ok", result.get("traceback")
    assert result["layer_class"] == "bench_user_layers.HalfWindow"
    assert result["layer_config"]["half_window"] == 3


def test_layer_check_in_a_subprocess():
    """The runner's check when Keras is not imported: one worker subprocess."""
    items = [
        {"label": "local", "layer_spec": {"class_name": "LocalAttention",
                                          "config": {"window": 8, "num_heads": 2, "key_dim": 8}}},
        {"label": "mha", "layer_spec": {"class_name": "MultiHeadAttention",
                                        "config": {"window": 8, "num_heads": 2, "key_dim": 8}}},
    ]
    local, mha = runner._check_in_subprocess(items, BACKEND, None, 300)
    assert local["error"] is None and local["layer_class"].endswith("LocalAttention")
    assert mha["unknown_options"] == ["window"]
    assert "layer 'mha'" in mha["error"] and "does not accept the option 'window'" in mha["error"]
    assert "accepted options: " in mha["error"] and "sliding_window" in mha["error"]
