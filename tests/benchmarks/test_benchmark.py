"""Tests of keras_longattn.benchmarks and the ``keras-longattn bench`` command.

The suite runs once per backend; these tests use the current one. Workers
are subprocesses (several seconds each, mostly imports), so only one
end-to-end run and a few cheap failing workers are started.
"""

import csv
import io
import json
import math

import keras
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
from keras_longattn.benchmarks import registry, runner, worker
from keras_longattn.benchmarks.report import CSV_COLUMNS, format_notes, to_csv

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
    assert registry.layer_options("local", options) == {"window": 64, "block_size": 128}
    assert registry.layer_options("mha", options) == {"window": 64, "block_size": 32}


@pytest.mark.parametrize(
    "kwargs, argument, text",
    [
        ({"layers": "full,nope"}, "layers", "known layers: full, local, sparse-strided, sparse-fixed, routing, mha"),
        ({"lengths": [1024, 0]}, "lengths", ">= 1"),
        ({"lengths": "12x"}, "lengths", "not an integer"),
        ({"backends": "mxnet"}, "backends", "jax, tensorflow, torch"),
        ({"modes": "bwd"}, "modes", "fwd, fwdbwd"),
        ({"repeats": 0}, "repeats", ">= 1"),
        ({"memory_limit_gb": -1}, "memory_limit_gb", "> 0"),
        ({"options": ["window"]}, "option", "name=value"),
        ({"baseline": "nope"}, "baseline", "unknown layer 'nope'"),
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
    with pytest.raises(ValueError, match="cannot be imported"):
        register("lam", lambda h, d, n, o: None)
    with pytest.raises(ValueError, match="already registered"):
        register("mha", registry.keras_multi_head_attention)
    entry = register("mha2", "keras_longattn.benchmarks.registry:keras_multi_head_attention")
    try:
        assert "mha2" in available_layers()
        layer = registry.build_layer("mha2", 2, 8, 32, {"window": 16, "dropout": 0.0})
        assert isinstance(layer, keras.layers.MultiHeadAttention)
        assert registry.ignored_options() == ["window"]
        assert entry.factory.endswith(":keras_multi_head_attention")
    finally:
        unregister("mha2")
    assert "mha2" not in available_layers()
    with pytest.raises(registry.LayerUnavailableError, match="no attribute"):
        registry.build_layer("x", 2, 8, 32, {}, factory="keras_longattn.benchmarks:nope")


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
    result = worker.run_config({"backend": BACKEND, "layer": "x",
                                "factory": "keras_longattn.benchmarks.registry:nope"})
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


def test_worker_forward_in_process():
    """The forward step of the current backend, measured in this process."""
    layers, _ = _layers_and_baseline()
    result = worker.run_config({"backend": BACKEND, "layer": layers[-1], "mode": "fwd",
                                "seq_len": 32, "num_heads": 2, "head_dim": 8,
                                "repeats": 2, "options": {"window": 8}})
    assert result["status"] == "ok", result.get("traceback")
    assert len(result["times_ms"]) == 2 and result["median_ms"] > 0
    assert result["first_call_ms"] > 0 and result["peak_memory_bytes"] >= 0
    assert result["memory_method"] in ("rss-hwm", "ru_maxrss", "device")
    assert result["num_params"] > 0 and result["device"]


def test_cli_end_to_end(tmp_path, capsys):
    """One run of the command line: two layers, forward+backward, n=64.

    (Each worker is a fresh process importing Keras and the backend, several
    seconds; the forward mode is covered in-process above.)
    """
    layers, baseline = _layers_and_baseline()
    argv = ["bench", "--layers", ",".join(layers), "--lengths", "64", "--backends", BACKEND,
            "--modes", "fwdbwd", "--repeats", "2", "--heads", "2", "--head-dim", "16",
            "--window", "16", "--baseline", baseline, "--timeout", "300",
            "--output-dir", str(tmp_path), "--plain"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    total = len(layers)
    assert f"[1/{total}] {layers[0]} n=64 fwdbwd {BACKEND} ..." in captured.err
    assert f"speed-up vs {baseline}" in captured.out

    document = json.loads((tmp_path / "latest.json").read_text())
    rows = document["results"]
    assert [row["layer"] for row in rows] == layers
    assert document["config"]["backends"] == [BACKEND]
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
    assert rows[0]["layer"] == baseline and rows[0]["time_ratio"] == 1.0
    assert rows[0]["memory_ratio"] in (1.0, None)
    if "local" in layers:
        local = rows[layers.index("local")]
        assert local["options"]["window"] == 16
        assert local["layer_config"]["window"] == 16

    table = list(csv.DictReader(io.StringIO((tmp_path / "latest.csv").read_text())))
    assert [r["layer"] for r in table] == layers
    assert all(float(r["median_ms"]) > 0 for r in table)
    assert float(table[0]["time_ratio"]) == 1.0
    assert sorted(path.suffix for path in tmp_path.glob("bench-*")) == [".csv", ".json"]


@pytest.mark.parametrize("layer", ["sparse-strided", "sparse-fixed", "routing"])
@pytest.mark.parametrize("scope", ["layer", "attention"])
def test_worker_new_layers_and_scopes_in_process(layer, scope):
    """The registry's sparse and routing entries run in both scopes."""
    result = worker.run_config({"backend": BACKEND, "layer": layer, "mode": "fwdbwd",
                                "seq_len": 64, "num_heads": 2, "head_dim": 8,
                                "repeats": 1, "scope": scope, "options": {}})
    assert result["status"] == "ok", result.get("traceback")
    assert result["median_ms"] > 0
    expected = {"sparse-strided": "SparseAttention", "sparse-fixed": "SparseAttention",
                "routing": "RoutingAttention"}[layer]
    assert result["layer_class"].endswith(expected)


def test_scope_is_validated():
    with pytest.raises(BenchmarkArgumentError, match="scope"):
        bench_config.BenchmarkConfig.create(layers=["full"], lengths=[64], scope="projections")


def test_registry_defaults_for_sparse_and_routing():
    strided = registry.sparse_strided_attention(4, 16, 1024, {"window": 256})
    assert strided.pattern == "strided" and strided.block_length == 128
    fixed = registry.sparse_fixed_attention(4, 16, 1024, {})
    assert fixed.pattern == "fixed"
    routing = registry.routing_attention(4, 16, 4096, {"window": 256})
    assert routing.num_clusters == 64 and routing.window is None
