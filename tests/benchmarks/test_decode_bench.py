"""The decode benchmark (keras_longattn.benchmarks.decode): the timed step is
the right computation (equal to the last row of the full forward pass, for
every layer and for keras-hub's peer), cache bytes come from the real cache
tensors, the report has its fields, and bad arguments are refused."""

import json
import sys

import keras
import numpy as np
import pytest

from keras_longattn import cli
from keras_longattn.benchmarks import decode

#: Largest absolute difference from the forward pass (float32).
TOL = 2e-5
WINDOW = 16
HEADS, HEAD_DIM = 2, 8


@pytest.mark.parametrize("name", decode.LAYERS)
def test_step_equals_the_last_row_of_the_forward_pass(name):
    if name == decode.PEER:
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
    peer = decode.build_layer(decode.PEER, HEADS, HEAD_DIM, WINDOW)
    x = np.random.default_rng(3).normal(size=(1, n, HEADS * HEAD_DIM)).astype("float32")
    got = keras.ops.convert_to_numpy(decode.full_forward(peer, decode.PEER, x, WINDOW))
    local = LocalAttention.from_multi_head_attention(peer, window=WINDOW)
    expected = keras.ops.convert_to_numpy(local(x, x, use_causal_mask=True))
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    # A wrong band (one position narrower) gives other outputs.
    narrower = keras.ops.convert_to_numpy(decode.full_forward(peer, decode.PEER, x, WINDOW - 1))
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
        layer = decode.build_layer(row["layer"], HEADS, HEAD_DIM, WINDOW)
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


def test_peer_without_keras_hub_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # import keras_hub fails
    report = decode.run_decode_benchmark(
        layers=[decode.PEER], contexts=[32], num_heads=HEADS, head_dim=HEAD_DIM,
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
