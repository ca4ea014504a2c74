"""Useful FLOPs of the benchmark (keras_longattn.benchmarks.efficiency):
the allowed pairs against the layers' own dense patterns, the FLOP count,
the annotation of rows and the matmul peak."""

import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.benchmarks import efficiency
from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import SparseAttention

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _dense_pairs(layer, n, causal):
    if hasattr(layer, "head_patterns"):
        patterns = layer.head_patterns(n, n, causal)
    else:
        patterns = (layer.attention_pattern(n, n, causal),) * layer.num_heads
    return sum(int(to_np(p.dense_mask(n, n)).sum()) for p in patterns)


LAYERS = [
    ("FullAttention", {}),
    ("LocalAttention", {"window": 7}),
    ("LocalAttention", {"window": 6, "look_back": 4, "look_ahead": 9}),
    ("LocalAttention", {"window": 50}),
    ("SparseAttention", {"pattern": "strided", "block_length": 5}),
    ("SparseAttention", {"pattern": "strided", "block_length": 4, "combination": "merged"}),
    ("SparseAttention", {"pattern": "fixed", "block_length": 6, "summary_width": 2}),
    ("SparseAttention", {"pattern": "fixed", "block_length": 8, "combination": "merged"}),
    ("SparseAttention", {"pattern": "fixed", "block_length": 8, "combination": "second"}),
]
CLASSES = {"FullAttention": FullAttention, "LocalAttention": LocalAttention,
           "SparseAttention": SparseAttention}


@pytest.mark.parametrize("name,config", LAYERS)
@pytest.mark.parametrize("n", [1, 13, 40])
@pytest.mark.parametrize("causal", [True, False])
def test_allowed_pairs_equal_the_layers_dense_patterns(name, config, n, causal):
    heads = 3
    layer = CLASSES[name](num_heads=heads, key_dim=4, **config)
    expected = _dense_pairs(layer, n, causal)
    assert efficiency.allowed_pairs(name, config, n, heads, causal) == expected


def test_useful_flops_of_a_row():
    row = {"layer_spec": {"class_name": "LocalAttention", "config": {"window": 256}},
           "seq_len": 16384, "num_heads": 4, "head_dim": 64, "batch": 2, "causal": True,
           "scope": "attention", "mode": "fwdbwd"}
    pairs = 4 * (16384 * 256 - 255 * 256 // 2)
    assert efficiency.useful_flops(row) == 2 * 6.0 * pairs * 128
    assert efficiency.useful_flops({**row, "mode": "fwd"}) == 2 * 2.0 * pairs * 128
    layer_scope = efficiency.useful_flops({**row, "mode": "fwd", "scope": "layer"})
    assert layer_scope == 2 * 2.0 * pairs * 128 + 2 * 2.0 * 16384 * 256 * 256 * 4
    unknown = {**row, "layer_spec": {"class_name": "RoutingAttention", "config": {}}}
    assert efficiency.useful_flops(unknown) is None


def test_annotate_and_format():
    rows = [{"layer": "local", "backend": "torch", "status": "ok", "median_ms": 500.0,
             "layer_spec": {"class_name": "LocalAttention", "config": {"window": 4}},
             "seq_len": 100, "num_heads": 2, "head_dim": 8, "causal": True,
             "scope": "attention", "mode": "fwd", "matmul_peak_gflops": 1e-5},
            {"layer": "x", "status": "oom"}]
    efficiency.annotate(rows)
    flops = 2 * 2 * (100 * 4 - 6) * 16
    assert rows[0]["useful_gflop"] == pytest.approx(flops / 1e9)
    assert rows[0]["useful_gflops_per_s"] == pytest.approx(flops / 0.5 / 1e9)
    assert rows[0]["peak_fraction"] == pytest.approx(flops / 0.5 / 1e9 / 1e-5)
    assert rows[1]["useful_gflop"] is None and rows[1]["peak_fraction"] is None
    text = efficiency.format_efficiency(rows)
    assert "local" in text and "%" in text
    assert efficiency.format_efficiency([rows[1]]) == ""


def test_matmul_peak_is_measured_on_the_active_backend():
    import keras

    peak = efficiency.measure_matmul_peak(keras.backend.backend(), size=256, repeats=2)
    assert np.isfinite(peak) and peak > 0
    with pytest.raises(ValueError, match="backend"):
        efficiency.measure_matmul_peak("numpy", size=8)
