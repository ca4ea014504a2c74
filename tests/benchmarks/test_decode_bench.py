"""The decode benchmark (keras_longattn.benchmarks.decode): the timed step is
the right computation (equal to the last row of the full forward pass, for
every layer and for keras-hub's peer), cache bytes come from the real cache
tensors, the report has its fields, and bad arguments are refused."""

import importlib.util
import json
import sys

import keras
import numpy as np
import pytest

from keras_longattn import cli
from keras_longattn.benchmarks import decode
from keras_longattn.benchmarks import decode_layers
from keras_longattn.benchmarks import decode_report

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

#: Largest absolute difference from the forward pass (float32).
TOL = 2e-5
WINDOW = 16
HEADS, HEAD_DIM = 2, 8


@pytest.mark.parametrize("name", decode_layers.LAYERS)
def test_step_equals_the_last_row_of_the_forward_pass(name):
    if name == decode_layers.PEER:
        pytest.importorskip("keras_hub")
    result = decode.check_step(name, 64, batch=2, num_heads=HEADS, head_dim=HEAD_DIM,
                               window=WINDOW)
    assert result["max_abs_error"] <= TOL, result
    assert result["output_shape"] == [2, 1, HEADS * HEAD_DIM]


def test_peer_is_a_sliding_window_of_the_same_width():
    """keras-hub's layer with the band mask attends where LocalAttention
    with the same window and weights does: the peer decodes the same model."""
    pytest.importorskip("keras_hub")
    from keras_longattn.layers import LocalAttention

    n = 40
    peer = decode_layers.build_layer(decode_layers.PEER, HEADS, HEAD_DIM, WINDOW)
    x = np.random.default_rng(3).normal(size=(1, n, HEADS * HEAD_DIM)).astype("float32")
    got = keras.ops.convert_to_numpy(decode_layers.full_forward(peer, decode_layers.PEER, x, WINDOW))
    local = LocalAttention.from_multi_head_attention(peer, window=WINDOW)
    expected = keras.ops.convert_to_numpy(local(x, x, use_causal_mask=True))
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    # A wrong band (one position narrower) gives other outputs.
    narrower = keras.ops.convert_to_numpy(decode_layers.full_forward(peer, decode_layers.PEER, x, WINDOW - 1))
    assert np.max(np.abs(narrower[:, WINDOW:] - expected[:, WINDOW:])) > 1e-3


def test_report_rows_ratios_and_cache_bytes(tmp_path):
    contexts = [64, 128]
    report = decode.run_decode_benchmark(
        layers="full,local,linear", contexts=contexts, num_heads=HEADS, head_dim=HEAD_DIM,
        window=WINDOW, warmup=0, repeats=2, output_dir=str(tmp_path), in_process=True)
    with open(report["paths"]["json"], encoding="utf-8") as handle:
        saved = json.load(handle)
    assert (tmp_path / "decode-latest.json").exists()
    assert saved["benchmark"] == "decode"
    assert saved["settings"]["contexts"] == contexts
    assert saved["machine"]["versions"]["keras"] == keras.__version__
    rows = {(r["layer"], r["context"]): r for r in saved["rows"]}
    assert set(rows) == {(layer, n) for layer in ("full", "local", "linear") for n in contexts}
    for row in saved["rows"]:
        assert row["status"] == "ok", row
        assert row["backend"] == keras.backend.backend()
        assert row["device"]
        assert len(row["times_s"]) == 2 and row["time_per_token_s"] > 0
        layer = decode_layers.build_layer(row["layer"], HEADS, HEAD_DIM, WINDOW)
        x = np.zeros((1, 4, HEADS * HEAD_DIM), "float32")
        layer(x, x, use_causal_mask=True)
        cache = keras.ops.convert_to_numpy(layer.init_cache(1, row["context"]))
        assert row["cache_bytes"] == cache.nbytes
        assert row["cache_shapes"] == [list(cache.shape)]
    for n in contexts:
        assert rows[("full", n)]["speedup"] == 1.0
        assert rows[("full", n)]["cache_bytes"] == 2 * n * HEADS * HEAD_DIM * 4
        # Local's ring holds look_back = window - 1 positions.
        assert rows[("local", n)]["cache_ratio"] <= WINDOW / n
        assert rows[("local", n)]["cache_bytes"] == rows[("local", 64)]["cache_bytes"]
    assert rows[("full", 64)]["growth"] == 1.0
    assert rows[("full", 128)]["growth"] == pytest.approx(
        rows[("full", 128)]["time_per_token_s"] / rows[("full", 64)]["time_per_token_s"])
    assert "local" in decode.format_table(saved)


def test_layers_that_depend_on_the_context():
    routing = decode_layers.build_layer("routing", HEADS, HEAD_DIM, WINDOW, context=1000)
    assert routing.num_clusters == decode_layers.routing_clusters(1000) == 32
    assert routing.window == WINDOW and routing.causal_routing == "token"
    synthesizer = decode_layers.build_layer("synthesizer", HEADS, HEAD_DIM, WINDOW, context=300)
    assert synthesizer.max_length == 300 and synthesizer.kind == "dense+vanilla"
    assert decode_layers.build_layer("bigbird", HEADS, HEAD_DIM, 256).block_size == 64
    for name in ("routing", "synthesizer"):
        with pytest.raises(ValueError, match=r"context=None"):
            decode_layers.build_layer(name, HEADS, HEAD_DIM, WINDOW)


def test_longformer_cache_is_the_window_and_the_global_tokens():
    layer = decode_layers.build_layer("longformer", HEADS, HEAD_DIM, WINDOW)
    x = np.zeros((1, 20, HEADS * HEAD_DIM), "float32")
    layer(x, x, use_causal_mask=True)
    short, long = (tuple(layer.init_cache(1, n).shape) for n in (64, 1024))
    assert short == long
    # A ring of window + 1 positions, the global keys and values, and their
    # global-projection keys and values.
    assert short[2] == WINDOW + 1 + 2 * decode_layers.LONGFORMER_GLOBAL_TOKENS


@pytest.fixture(scope="module")
def tiny_run():
    """A real run at two small contexts, with the peer when keras-hub is
    installed (its criterion is then measured at the larger context)."""
    layers = ["full", "local", "linear"]
    if importlib.util.find_spec("keras_hub") is not None:
        layers.append(decode_layers.PEER)
    return decode.run_decode_benchmark(
        layers=layers, contexts=[64, 256], num_heads=HEADS, head_dim=HEAD_DIM, window=WINDOW,
        warmup=1, repeats=3, output_dir=None, in_process=True)


def _by_name(criteria):
    assert len({c["name"] for c in criteria}) == len(criteria)
    return {c["name"]: c for c in criteria}


def test_criteria_from_a_real_run(tiny_run):
    rows = {(r["layer"], r["context"]): r for r in tiny_run["rows"]}
    criteria = _by_name(decode_report.decode_criteria(tiny_run, peer_context=256))
    assert set(criteria) == {"local_time_flat", "linear_time_flat", "local_cache",
                             "local_vs_peer"}
    for name in ("local", "linear"):
        item = criteria[f"{name}_time_flat"]
        growth = rows[(name, 256)]["time_per_token_s"] / rows[(name, 64)]["time_per_token_s"]
        assert item["values"]["growth"] == pytest.approx(growth)
        assert item["verdict"] == ("passed" if growth <= decode_report.GROWTH_LIMIT else "failed")
        assert f"{growth:.2f}x" in item["measured"]
    cache = criteria["local_cache"]
    assert cache["verdict"] == "passed", cache
    for n in (64, 256):
        ratio = rows[("local", n)]["cache_bytes"] / rows[("full", n)]["cache_bytes"]
        assert cache["values"][str(n)]["ratio"] == pytest.approx(ratio)
        assert cache["values"][str(n)]["limit"] == WINDOW / n
    peer = criteria["local_vs_peer"]
    if (decode_layers.PEER, 256) in rows:
        speedup = (rows[(decode_layers.PEER, 256)]["time_per_token_s"]
                   / rows[("local", 256)]["time_per_token_s"])
        assert peer["values"]["speedup"] == pytest.approx(speedup)
        assert peer["verdict"] == ("passed" if speedup >= decode_report.PEER_SPEEDUP_LIMIT
                                   else "failed")
    else:
        assert peer["verdict"] == "not measured"
    # At the 32K the run measured nothing.
    default = _by_name(decode_report.decode_criteria(tiny_run))["local_vs_peer"]
    assert default["verdict"] == "not measured" and "32,768" in default["measured"]
    table = decode_report.criteria_table(list(criteria.values()))
    assert table.count("\n") == 1 + len(criteria) and "| passed |" in table


def test_criteria_fail_a_layer_whose_cache_grows(tiny_run):
    """Full's rows in the place of Local's: its cache is the whole context,
    far above window / context of Full's, at every context."""
    criteria = _by_name(decode_report.decode_criteria(tiny_run, local="full", peer_context=256))
    cache = criteria["local_cache"]
    assert cache["verdict"] == "failed"
    assert all(v["ratio"] == 1.0 for v in cache["values"].values())
    assert "1.00 > 0.250 at 64" in cache["measured"]


def test_criteria_fail_a_layer_that_ran_out_of_memory(tiny_run):
    report = json.loads(json.dumps(tiny_run))
    for row in report["rows"]:
        if row["layer"] == "local" and row["context"] == 256:
            row.update(status="oom", message="timing: RESOURCE_EXHAUSTED")
    criteria = _by_name(decode_report.decode_criteria(report, peer_context=256))
    assert criteria["local_time_flat"]["verdict"] == "failed"
    assert "oom" in criteria["local_time_flat"]["measured"]
    assert criteria["local_cache"]["verdict"] == "failed"
    assert criteria["local_vs_peer"]["verdict"] == "failed"
    assert criteria["linear_time_flat"]["verdict"] != "not measured"


def test_committed_results_file(tiny_run, tmp_path):
    from keras_longattn.reproductions import pages, provenance

    path = tmp_path / "docs" / "benchmarks" / "decode.json"
    written = decode_report.write_decode_results(tiny_run, path, command="keras-longattn decode-bench")
    saved = json.loads(path.read_text())
    assert written == str(path)
    assert saved["rows"] == json.loads(json.dumps(tiny_run["rows"]))
    assert saved["criteria"] == decode_report.decode_criteria(tiny_run)
    assert saved["command"] == "keras-longattn decode-bench"
    assert "| local | 256 |" in saved["table"] and "window 16" in saved["table"]
    files = saved["provenance"]["source_files"]
    assert {"keras_longattn/benchmarks/decode.py",
            "keras_longattn/layers/local_attention.py"} <= set(files)
    assert saved["provenance"]["backend"] == keras.backend.backend()
    assert not provenance.check_results(path).stale
    # The guide's regions read it as the source "decode".
    assert pages.NAMED_SOURCES["decode"] == pages.Path("docs/benchmarks/decode.json")
    text = ("<!-- results-table decode:criteria_table -->\n<!-- /results-table -->\n"
            "<!-- results-table decode:table -->\n<!-- /results-table -->\n")
    rendered = pages.render_page(text, pages.Sources(tmp_path))
    assert saved["criteria_table"] in rendered and saved["table"] in rendered


def test_cli_write(tmp_path, monkeypatch, capsys):
    """``decode-bench --write PATH`` writes the results file and prints the
    criteria (the run itself in this process)."""
    run = decode.run_decode_benchmark
    monkeypatch.setattr(decode, "run_decode_benchmark",
                        lambda **kwargs: run(in_process=True, **kwargs))
    path = tmp_path / "decode.json"
    status = cli.main(["decode-bench", "--layers", "full,local,linear", "--contexts", "32,64",
                       "--window", "16", "--heads", "2", "--head-dim", "8", "--warmup", "0",
                       "--repeats", "1", "--output-dir", str(tmp_path), "--write", str(path),
                       "--quiet"])
    assert status == 0
    out = capsys.readouterr().out
    assert "local_cache: passed" in out
    saved = json.loads(path.read_text())
    assert saved["settings"]["contexts"] == [32, 64] and "provenance" in saved
    assert {c["name"] for c in saved["criteria"]} >= {"local_cache", "linear_time_flat"}


def test_peer_without_keras_hub_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # import keras_hub fails
    report = decode.run_decode_benchmark(
        layers=[decode_layers.PEER], contexts=[32], num_heads=HEADS, head_dim=HEAD_DIM,
        window=WINDOW, warmup=0, repeats=1, output_dir=None, in_process=True)
    (row,) = report["rows"]
    assert row["status"] == "unavailable"
    assert "keras-hub" in row["message"]


@pytest.mark.parametrize("kwargs,match", [
    ({"layers": "full,nope"}, r"layers=.*nope"),
    ({"layers": ""}, "layers"),
    ({"contexts": "8", "window": 16}, r"window \(16\).*contexts='8'"),
    ({"contexts": "abc"}, "contexts"),
    ({"contexts": "1"}, "at least 2"),
    ({"backends": "mxnet"}, "backends='mxnet'"),
    ({"repeats": 0}, "repeats=0"),
    ({"warmup": -1}, "warmup=-1"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        decode.run_decode_benchmark(output_dir=None, in_process=True, **kwargs)


@pytest.mark.parametrize("argv,message", [
    (["--layers", "nope"], "nope"),
    (["--contexts", "abc"], "contexts"),
    (["--contexts", "64", "--window", "128"], "window (128)"),
    (["--repeats", "0"], "must be >= 1"),
])
def test_cli_parse_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["decode-bench", "--output-dir", str(tmp_path)] + argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_lists_the_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.main(["decode-bench", "--help"])
    assert "--contexts" in capsys.readouterr().out
