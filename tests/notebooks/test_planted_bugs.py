"""Planted bugs: the claim checks of the reproduction notebooks must fail on
broken variants of the mechanisms, and pass on the real ones.

The checks are the notebooks' own (``keras_longattn.reproductions``). The
mechanism measurements run on tiny real layers (which keys a sparse layer's
heads really read on its training path; which cluster a routing layer puts
a query and its stored key in); the training results that the quality
claims read are synthetic per-seed numbers shaped like the notebooks'
outputs, with the broken variant's arm replaced by what that bug produces
(e.g. with random clusters the routing arm scores like the random control).
"""

import functools
from pathlib import Path

import numpy as np
import pytest

import keras

from keras_longattn.layers import AdaMRAAttention, FullAttention, RoutingAttention, SparseAttention
from keras_longattn.reproductions import adamra as ar
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import routing_transformer as rt
from keras_longattn.reproductions import sparse_transformer as st


def _failed(claims):
    return {c.name for c in claims if c.failed}


# ---------------------------------------------------------------- claims.py


def test_compare_means_verdicts():
    assert cl.compare_means("a", "", [0.9, 0.95], [0.2, 0.25], 0.3).verdict == "reproduced"
    assert cl.compare_means("a", "", [0.4, 0.45], [0.2, 0.25], 0.3).verdict == "direction only"
    assert cl.compare_means("a", "", [0.2, 0.25], [0.4, 0.45], 0.1).verdict == "not reproduced"
    # A margin not above the seed spread cannot be asserted.
    noisy = cl.compare_means("a", "", [0.5, 1.0], [0.1, 0.15], 0.3)
    assert noisy.verdict == "not testable at this scale" and noisy.failed
    # Lower is better.
    assert cl.compare_means("b", "", [1.0, 1.02], [1.5, 1.52], 0.2,
                            higher_is_better=False).passed


def test_no_worse_than_and_speedup():
    assert cl.no_worse_than("p", "", [1.05, 1.06], [1.0, 1.01], 0.1,
                            higher_is_better=False).passed
    assert not cl.no_worse_than("p", "", [1.3, 1.31], [1.0, 1.01], 0.1,
                                higher_is_better=False).passed
    assert cl.speedup_claim("s", "", [2.0, 2.1, 1.9], [1.0, 1.1, 0.9], 1.5).passed
    assert cl.speedup_claim("s", "", [1.2, 1.2], [1.0, 1.0], 1.5).verdict == "direction only"
    with pytest.raises(cl.ClaimFailure):
        cl.assert_claims([cl.speedup_claim("s", "", [1.0], [1.0], 1.5)])
    table = cl.claims_table([cl.speedup_claim("s", "x", [2.0], [1.0], 1.5)])
    assert table.splitlines()[0].startswith("| claim | paper | ours")


def test_results_file_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = cl.results_file(None, "slug")
    assert default.is_absolute() and default.name == "slug.json"
    assert default.parent.name == "notebooks" and tmp_path not in default.parents
    assert cl.results_file("x.json", "slug") == Path("x.json")


# ------------------------------------------------------------------ routing

ROUTING_MARGINS = dict(min_full_accuracy=0.8, max_local_excess=0.1, margin_random=0.3,
                       margin_local=0.3, margin_co_clustered=0.3, min_local_speedup=1.1)
CHANCE = 1 / 8


@functools.lru_cache(maxsize=None)
def _co_clustered(layer_cls, seed=0):
    """Share of recall queries that a tiny routing layer puts in the cluster
    of their stored key, on token vectors that depend on the token only."""
    keras.utils.set_random_seed(seed)
    x, _, w = rt.make_unique_recall(8, 96, 4, 4, 48, np.random.default_rng(seed))
    embedding = np.random.default_rng(seed).normal(size=(16, 16)).astype("float32")
    layer = layer_cls(num_heads=2, key_dim=8, local_heads=0, num_clusters=4, window=16,
                      shared_qk=True)
    clusters = layer.compute_clusters(embedding[x], use_causal_mask=True)["query_clusters"]
    return rt.co_clustered_share(x, keras.ops.convert_to_numpy(clusters), w, 4, 4)


def _routing_results(routing_acc, co_routing, routing_step=1.5):
    return {
        "chance": CHANCE,
        "accuracy": {"local": [0.12, 0.14], "random": [0.22, 0.27],
                     "routing": routing_acc, "full": [1.0, 0.99]},
        "co_clustered": {"routing": co_routing, "random": [0.25, 0.26]},
        "step_seconds": {"local": [0.10, 0.11, 0.10, 0.12],
                         "routing": [routing_step * v for v in (0.10, 0.11, 0.10, 0.12)]},
    }


def test_routing_real_layer_passes():
    share = _co_clustered(RoutingAttention)
    assert share == 1.0  # the same content, the same cluster
    results = _routing_results([0.97, 0.99], [share, share])
    claims = rt.routing_claims(results, ROUTING_MARGINS)
    assert not _failed(claims)
    cl.assert_claims(claims)


def test_routing_planted_random_clusters_fails():
    # Bug: the layer's clusters are random (the RandomRoutingAttention
    # control stands for it): queries rarely meet their stored key, and
    # the model scores like the random control.
    share = _co_clustered(rt.RandomRoutingAttention)
    assert share < 0.6
    results = _routing_results([0.23, 0.26], [share, share + 0.02])
    claims = rt.routing_claims(results, ROUTING_MARGINS)
    assert {"beats_random", "beats_local", "co_clustered"} <= _failed(claims)
    with pytest.raises(cl.ClaimFailure):
        cl.assert_claims(claims)


def test_routing_planted_leaky_task_or_dense_control_fails():
    # Bug: the local control reaches the answer (a task whose stored key is
    # inside the window, or the control swapped for dense attention).
    results = _routing_results([0.97, 0.99], [1.0, 1.0])
    results["accuracy"]["local"] = [0.95, 0.97]
    claims = rt.routing_claims(results, ROUTING_MARGINS)
    assert {"local_blind", "beats_local"} <= _failed(claims)


def test_routing_planted_routing_swapped_for_dense_fails_on_time():
    # Bug: the routing layer swapped for a cheap local one (no routing cost)
    # or a timing that measures the same model twice.
    results = _routing_results([0.97, 0.99], [1.0, 1.0], routing_step=1.0)
    assert "local_faster" in _failed(rt.routing_claims(results, ROUTING_MARGINS))


# ------------------------------------------------------------------- sparse

SPARSE_MARGINS = dict(image_margin=0.1, repeat_margin=0.3, text_margin=0.05,
                      min_step_speedup=1.3, min_bench_speedup=2.0,
                      min_bench_memory_ratio=2.0)


def _sparse_layer(pattern, **kwargs):
    keras.utils.set_random_seed(0)
    return SparseAttention(num_heads=2, key_dim=4, pattern=pattern, block_length=4,
                           summary_width=1 if pattern == "fixed" else None, **kwargs)


@functools.lru_cache(maxsize=None)
def _measured(pattern, causal=True):
    """Measured head masks of a tiny SparseAttention (n = 24, l = 4), once
    per pattern (the measurement is the slow part of these tests)."""
    masks = st.measured_head_masks(_sparse_layer(pattern), 24, 8, causal=causal)
    masks.flags.writeable = False
    return masks


def _coverage(pattern):
    return st.two_step_coverage(_measured(pattern))


def _coverage_without_head_b(pattern):
    masks = _measured(pattern).copy()
    masks[1:] = False  # head 1 is head B in "multihead": its output removed
    return st.two_step_coverage(masks)


def _sparse_results(coverage, repeat=None, image_steps=None, bench=None):
    repeat = repeat or {"dense": [0.05, 0.07], "strided": [0.06, 0.08],
                        "fixed": [0.5, 0.6], "local": [1.1, 1.12]}
    image_steps = image_steps or {"dense": [0.30, 0.32, 0.31], "strided": [0.1, 0.11, 0.1],
                                  "fixed": [0.1, 0.12, 0.11]}
    bench = bench or {"dense": {"median_ms": 100.0, "peak_mib": 200.0},
                      "strided": {"median_ms": 10.0, "peak_mib": 20.0},
                      "fixed": {"median_ms": 20.0, "peak_mib": 30.0}}
    return {
        "coverage": coverage,
        "image_bits": {"dense": [1.0, 1.02], "strided": [0.95, 0.97], "fixed": [1.0, 1.03],
                       "local": [1.1, 1.12]},
        "repeat_bits": repeat,
        "image_step_seconds": image_steps,
        "bench": bench,
    }


def test_sparse_measured_patterns_match_the_pattern_objects():
    for pattern in ("strided", "fixed"):
        masks = _measured(pattern)
        a, b = _sparse_layer(pattern).head_patterns(24, 24, True)
        for measured, objects in ((masks[0], a), (masks[1], b)):
            expected = np.asarray(keras.ops.convert_to_numpy(objects.dense_mask(24, 24)), bool)
            # Off the diagonal (output i always depends on input i through
            # its query), the measured keys are the pattern's.
            off = ~np.eye(24, dtype=bool)
            assert np.array_equal(measured[off], expected[off]), pattern


def test_sparse_real_layers_pass():
    coverage = {p: _coverage(p) for p in ("strided", "fixed")}
    claims = st.sparse_claims(_sparse_results(coverage), SPARSE_MARGINS)
    assert not _failed(claims)
    cl.assert_claims(claims)


def test_sparse_planted_head_b_removed_fails():
    # Bug: no summary (fixed) or column (strided) head. Measured on the real
    # layer with that head's output removed; a model without it is local
    # attention on the repeated images.
    coverage = {p: _coverage_without_head_b(p) for p in ("strided", "fixed")}
    assert all(not complete for complete, _ in coverage.values())
    local_like = {"dense": [0.05, 0.07], "strided": [1.1, 1.13], "fixed": [1.11, 1.12],
                  "local": [1.1, 1.12]}
    claims = st.sparse_claims(_sparse_results(coverage, repeat=local_like), SPARSE_MARGINS)
    assert {"coverage_strided", "coverage_fixed", "repeat_strided_beats_local"} <= _failed(claims)


def test_sparse_planted_causal_leak_fails():
    # Bug: a pattern that reads later positions (the causal mask dropped).
    complete, causal_only = st.two_step_coverage(_measured("strided", causal=False))
    assert complete and not causal_only
    claims = st.sparse_claims(_sparse_results({"strided": (complete, causal_only)}),
                              SPARSE_MARGINS)
    assert "coverage_strided" in _failed(claims)


def test_sparse_planted_dense_swap_fails_on_cost():
    # Bug: the sparse layers swapped for dense attention. Measured patterns
    # are the whole causal triangle (coverage holds), so it is the cost
    # claims that must fail: same step time, same time and memory.
    masks = st.measured_head_masks(FullAttention(num_heads=2, key_dim=4), 24, 8)
    assert masks.all(axis=0)[np.tril_indices(24)].all()
    coverage = {"strided": st.two_step_coverage(masks), "fixed": st.two_step_coverage(masks)}
    same = [0.30, 0.31, 0.32]
    steps = {"dense": same, "strided": list(same), "fixed": list(same)}
    row = {"median_ms": 100.0, "peak_mib": 200.0}
    bench = {"dense": row, "strided": dict(row), "fixed": dict(row)}
    claims = st.sparse_claims(_sparse_results(coverage, image_steps=steps, bench=bench),
                              SPARSE_MARGINS)
    assert {"image_step_strided", "image_step_fixed", "bench_strided",
            "bench_fixed"} <= _failed(claims)


# ------------------------------------------------------------------- adamra

ADAMRA_MARGINS = dict(max_head_share=0.9, probe_tolerance=1e-4, accuracy_margin=3.0,
                      min_above_chance=10.0, min_bench_speedup=5.0,
                      max_bench_memory_ratio=0.25, bench_length=4096)
ADAMRA_LENGTH, ADAMRA_DIM = 32, 16


def _adamra_layer(cls=AdaMRAAttention, **kwargs):
    keras.utils.set_random_seed(0)
    kwargs.setdefault("compression_rates", (1 / 2, 1 / 4, 1 / 8, 1 / 16))
    return cls(num_heads=4, key_dim=8, **kwargs)


def _adamra_inputs():
    return np.random.default_rng(1).normal(
        size=(2, ADAMRA_LENGTH, ADAMRA_DIM)).astype("float32")


@functools.lru_cache(maxsize=None)
def _adamra_probes(variant):
    """(head shares, segment probe) measured on a tiny real layer: the real
    one, or a planted variant."""
    if variant == "real":
        layer = _adamra_layer()
    elif variant == "constant_router":
        layer = _adamra_layer(ar.ConstantRouterAdaMRA)
    elif variant == "uncompressed":
        keras.utils.set_random_seed(0)
        layer = ar.uncompressed_adamra(num_heads=4, key_dim=8)
    else:  # dense swap
        keras.utils.set_random_seed(0)
        layer = AdaMRAAttention(num_heads=4, key_dim=8, compression_rates=(1.0,) * 4,
                                routing="all", attention="softmax")
    shares = ar.head_shares(layer, _adamra_inputs())
    probe = ar.segment_mean_probe(layer, ADAMRA_LENGTH, ADAMRA_DIM)
    return tuple(float(s) for s in shares), probe


def _adamra_results(shares, probe, ablation=None, bench=None):
    return {
        "head_shares": list(shares),
        "segment_probe": probe,
        "suite": {"full": {"image": [40.0, 41.0], "listops": [30.0, 38.0]},
                  "adamra": {"image": [45.0, 46.0], "listops": [31.0, 36.0]}},
        "chance": {"image": 10.0, "listops": 10.0},
        "ablation_task": "image",
        "ablation": ablation or {"learned": [45.0, 46.0], "random": [41.0, 42.0],
                                 "softmax": [41.0, 43.0], "rates:1/2,1/2,1/2,1/2": [39.0, 40.0]},
        "bench": bench or {"full": {"median_ms": 200.0, "peak_mib": 400.0},
                           "adamra": {"median_ms": 10.0, "peak_mib": 40.0}},
    }


def test_adamra_real_layer_passes():
    shares, probe = _adamra_probes("real")
    assert probe["inside"] < 1e-4 < probe["across"]
    claims = ar.adamra_claims(_adamra_results(shares, probe), ADAMRA_MARGINS)
    assert not _failed(claims)
    cl.assert_claims(claims)
    # Accuracy comparisons are asserted only where the seeds separate them.
    by_name = {c.name: c for c in claims}
    assert by_name["ablation_task_parity"].asserted
    assert not by_name["image_adamra_beats_full"].asserted


def test_adamra_parity_not_asserted_when_seeds_do_not_separate():
    shares, probe = _adamra_probes("real")
    results = _adamra_results(shares, probe)
    results["suite"]["full"]["image"] = [30.0, 50.0]  # spread 20 > margin 3
    claims = {c.name: c for c in ar.adamra_claims(results, ADAMRA_MARGINS)}
    parity = claims["ablation_task_parity"]
    assert parity.verdict == cl.NOT_TESTABLE and not parity.asserted


def test_adamra_planted_constant_router_fails():
    # Bug: the router replaced by a constant (every query to head 0).
    shares, probe = _adamra_probes("constant_router")
    assert shares[0] == 1.0
    claims = ar.adamra_claims(_adamra_results(shares, probe), ADAMRA_MARGINS)
    assert "router_spreads" in _failed(claims)
    with pytest.raises(cl.ClaimFailure):
        cl.assert_claims(claims)


def test_adamra_planted_compression_disabled_fails():
    # Bug: compression switched off (every key its own landmark): a change
    # inside a segment now reaches the other queries.
    shares, probe = _adamra_probes("uncompressed")
    assert probe["inside"] > 1e-2
    claims = ar.adamra_claims(_adamra_results(shares, probe), ADAMRA_MARGINS)
    assert "segment_means" in _failed(claims)


def test_adamra_planted_dense_swap_fails():
    # Bug: the layer swapped for dense multi-head attention (rate 1, every
    # head for every query, softmax): every probe and the cost claim fail.
    shares, probe = _adamra_probes("dense")
    bench = {"full": {"median_ms": 200.0, "peak_mib": 400.0},
             "adamra": {"median_ms": 190.0, "peak_mib": 410.0}}
    claims = ar.adamra_claims(_adamra_results(shares, probe, bench=bench), ADAMRA_MARGINS)
    assert {"router_spreads", "segment_means", "bench"} <= _failed(claims)


def test_adamra_planted_no_learning_fails():
    # Bug: a model that does not learn the ablation task (e.g. labels
    # shuffled, or the attention output dropped) stays at chance.
    shares, probe = _adamra_probes("real")
    ablation = {"learned": [10.5, 11.0], "random": [10.0, 11.0]}
    claims = ar.adamra_claims(_adamra_results(shares, probe, ablation=ablation),
                              ADAMRA_MARGINS)
    assert {"ablation_task_learned", "ablation_task_parity"} <= _failed(claims)
