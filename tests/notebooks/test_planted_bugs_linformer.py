"""Unit tests of the Linformer notebook's claim checks
(``keras_longattn.reproductions.linformer.linformer_claims``).

The probes run on tiny real layers (the limit ``k = n`` against
FullAttention, a padded example against the example alone, the number of
directions one head's outputs span). The accuracies and the benchmark grids
that the other claims read are synthetic numbers shaped like the notebook's
outputs. The planted bugs that count, real broken layers trained and
measured through the notebook's own functions, are
``keras_longattn.reproductions.linformer.PLANTED``
(``tests/notebooks/test_planted_real.py``).
"""

import functools

import numpy as np
import pytest

import keras

from keras_longattn.layers import FullAttention, LinformerAttention
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import linformer as lf

MARGINS = dict(probe_tolerance=1e-4, min_above_chance=10.0, control_margin=5.0,
               parity_margin=3.0, min_speedup=5.0, min_memory_saving=10.0,
               min_trend_factor=1.5, min_flop_ratio=3.0, min_temp_ratio=5.0)
RANK_K = 3


def _failed(claims):
    return {c.name for c in claims if c.failed}


def _linformer(cls=LinformerAttention, **kwargs):
    keras.utils.set_random_seed(0)
    return cls(**{"num_heads": 2, "key_dim": 8, "k": 8, "max_length": 32, **kwargs})


@functools.lru_cache(maxsize=None)
def _probes(variant):
    """(limit, padding, slot rank) measured on tiny real layers: the real
    layer or a planted variant."""
    limit_cls = lf.UnscaledLinformer if variant == "unscaled" else None
    limit = lf.limit_probe(n=24, layer_cls=limit_cls)
    if variant == "unmasked":
        padding = lf.padding_probe(_linformer(lf.UnmaskedLinformer))
    else:
        padding = lf.padding_probe(_linformer())
    keras.utils.set_random_seed(0)
    if variant == "zero":
        layer = lf.zero_projection_linformer(num_heads=1, key_dim=16, k=RANK_K,
                                             max_length=32)
    elif variant == "dense":
        layer = FullAttention(num_heads=1, key_dim=16)
    else:
        layer = LinformerAttention(num_heads=1, key_dim=16, k=RANK_K, max_length=32)
    keras.utils.set_random_seed(0)
    full_rank = lf.slot_rank_probe(FullAttention(num_heads=1, key_dim=16))
    return limit, padding, {"k": RANK_K, "linformer": lf.slot_rank_probe(layer),
                            "full": full_rank}


def _bench(speed=(1.3, 2.0, 3.5, 6.0), memory=(2.5, 5.0, 10.0, 20.0), k_drop=2.0):
    """A grid shaped like the notebook's: full at 200 ms and 400 MiB at every n
    (only the ratios matter), k = 128 at every n, k = 512 at the longest."""
    lengths = (512, 1024, 2048, 4096)
    bench = {}
    for n, s, m in zip(lengths, speed, memory):
        bench[n] = {"full": {"median_ms": 200.0, "peak_mib": 400.0},
                    128: {"median_ms": 200.0 / s, "peak_mib": 400.0 / m}}
    bench[4096][512] = {"median_ms": 200.0 / (speed[-1] / k_drop), "peak_mib": 80.0}
    return lf.table3_rows(bench)


def _cost(flops=(1.5, 3.0, 6.0), temp=(3.0, 8.0, 20.0), k_drop=2.0):
    """Compiled-cost ratios shaped like the notebook's: k = 128 at three n,
    k = 512 at the longest."""
    grid = {}
    for n, f, t in zip((1024, 2048, 4096), flops, temp):
        grid[n] = {"full": {"flops": 1e10, "temp_bytes": 2**30},
                   128: {"flops": 1e10 / f, "temp_bytes": int(2**30 / t)}}
    grid[4096][512] = {"flops": 1e10 / (flops[-1] / k_drop), "temp_bytes": 2**26}
    return lf.cost_rows(grid)


def _results(probes, accuracy=None, table3=None, backend="jax", cost=None):
    limit, padding, rank = probes
    return {
        "limit": limit, "padding": padding, "slot_rank": rank,
        "accuracy": accuracy or {"full": [60.0, 62.0], "k64": [59.0, 61.0],
                                 "k128": [60.0, 61.5], "bag": [30.0, 31.0]},
        "control": "bag", "chance": 10.0, "task": "listops",
        "table3": _bench() if table3 is None else table3, "backend": backend,
        "cost": _cost() if cost is None else cost,
    }


def test_real_layer_passes():
    limit, padding, rank = _probes("real")
    assert limit < 1e-5 and padding < 1e-5
    assert rank["linformer"] == RANK_K and rank["full"] > 2 * RANK_K
    claims = lf.linformer_claims(_results(_probes("real")), MARGINS)
    assert not _failed(claims)
    cl.assert_claims(claims)
    by_name = {c.name: c for c in claims}
    assert by_name["parity_k64"].asserted and by_name["parity_k128"].asserted
    assert by_name["speedup_grows_with_n_k128"].passed
    assert by_name["memory_saving_grows_with_n_k128"].passed
    assert by_name["speedup_shrinks_with_k"].passed
    assert by_name["bench_longest"].passed
    for name in ("cost_longest", "cost_grows_with_n_k128", "cost_shrinks_with_k"):
        assert by_name[name].passed and by_name[name].asserted, name
    # Wall clock and process memory are reported, never asserted.
    for name in ("bench_longest", "speedup_grows_with_n_k128",
                 "memory_saving_grows_with_n_k128", "speedup_shrinks_with_k"):
        assert not by_name[name].asserted, name


def test_paper_table3_shape():
    # The paper's own grid passes the trend checks it is quoted for.
    bench = {n: {"full": {"median_ms": 100.0, "peak_mib": 100.0}} for n in lf.PAPER_TABLE3["time"]}
    for n in bench:
        for k, s in lf.PAPER_TABLE3["time"][n].items():
            bench[n][k] = {"median_ms": 100.0 / s,
                           "peak_mib": 100.0 / lf.PAPER_TABLE3["memory"][n][k]}
    rows = lf.table3_rows(bench)
    claims = {c.name: c for c in lf.linformer_claims(_results(_probes("real"), table3=rows),
                                                     MARGINS)}
    assert claims["speedup_grows_with_n_k128"].passed
    assert claims["speedup_shrinks_with_k"].passed
    assert claims["bench_longest"].passed


def test_a_spread_that_reaches_the_margin_fails_the_asserted_comparison():
    # The seeds do not separate full attention from the Linformer arms
    # (spread 12 > margin 3): the comparisons are not testable at this
    # scale, and that fails them; they are not dropped from the asserts.
    accuracy = {"full": [50.0, 62.0], "k64": [59.0, 61.0], "k128": [60.0, 61.5],
                "bag": [30.0, 31.0]}
    claims = lf.linformer_claims(_results(_probes("real"), accuracy=accuracy), MARGINS)
    by_name = {c.name: c for c in claims}
    for name in ("parity_k64", "parity_k128", "task_needs_attention"):
        claim = by_name[name]
        assert claim.verdict == cl.NOT_TESTABLE, name
        assert claim.asserted and claim.failed, name
        assert lf.UNTESTABLE_FAILS in claim.detail
        assert claim.shown == cl.NOT_TESTABLE
    assert "not testable at this scale (asserted)" in cl.claims_table(claims)
    with pytest.raises(cl.ClaimFailure, match="parity_k64: not testable at this scale"):
        cl.assert_claims(claims)


def test_a_noisy_broken_arm_fails_instead_of_passing_unasserted():
    # A broken Linformer arm that only adds noise (its seeds spread over
    # the margin): the check must fail, not leave the claim out.
    accuracy = {"full": [60.0, 62.0], "k64": [40.0, 61.0], "k128": [60.0, 61.5],
                "bag": [30.0, 31.0]}
    claims = lf.linformer_claims(_results(_probes("real"), accuracy=accuracy), MARGINS)
    assert {"parity_k64", "beats_control_k64"} <= _failed(claims)


def test_planted_padding_not_masked_fails():
    # Bug: the padded keys and values are projected with the real ones.
    limit, padding, rank = _probes("unmasked")
    assert padding > 1e-2
    claims = lf.linformer_claims(_results((limit, padding, rank)), MARGINS)
    assert _failed(claims) == {"padding_masked"}
    with pytest.raises(cl.ClaimFailure):
        cl.assert_claims(claims)


def test_planted_lost_scale_fails_the_limit():
    # Bug: the logits are no longer divided by sqrt(d).
    limit, padding, rank = _probes("unscaled")
    assert limit > 1e-2
    claims = lf.linformer_claims(_results((limit, padding, rank)), MARGINS)
    assert _failed(claims) == {"identity_limit"}


def test_planted_zero_projection_fails():
    # Bug: E and F frozen at zero: every slot is zero, the layer is blind,
    # and a model built with it learns what the bag-of-tokens control learns.
    probes = _probes("zero")
    assert probes[2]["linformer"] == 0
    accuracy = {"full": [60.0, 62.0], "k64": [30.0, 31.5], "k128": [30.5, 31.0],
                "bag": [30.0, 31.0]}
    claims = lf.linformer_claims(_results(probes, accuracy=accuracy), MARGINS)
    assert {"slot_rank", "parity_k64", "parity_k128", "beats_control_k64",
            "beats_control_k128"} <= _failed(claims)


def test_planted_dense_swap_fails():
    # Bug: the layer swapped for dense attention: more than k directions,
    # and the compiled-cost ratios are 1 at every n and k.
    probes = _probes("dense")
    assert probes[2]["linformer"] > RANK_K
    flat = _cost(flops=(1.0, 1.0, 1.0), temp=(1.0, 1.0, 1.0), k_drop=1.0)
    claims = lf.linformer_claims(_results(probes, cost=flat), MARGINS)
    assert {"slot_rank", "cost_longest", "cost_grows_with_n_k128",
            "cost_shrinks_with_k"} <= _failed(claims)


def test_cost_claims_fail_on_a_small_saving():
    # Each cost check has its own threshold: a FLOP saving below
    # min_flop_ratio, a temporary-bytes saving below min_temp_ratio, flat
    # trends.
    by_name = lambda cost: {c.name: c for c in lf.linformer_claims(  # noqa: E731
        _results(_probes("real"), cost=cost), MARGINS)}
    assert by_name(_cost(flops=(1.5, 2.0, 2.5)))["cost_longest"].failed
    assert by_name(_cost(temp=(3.0, 4.0, 4.5)))["cost_longest"].failed
    assert by_name(_cost(temp=(3.0, 4.0, 4.4)))["cost_grows_with_n_k128"].failed
    assert by_name(_cost(k_drop=1.2))["cost_shrinks_with_k"].failed


def test_cost_claims_not_testable_off_jax():
    claims = {c.name: c for c in lf.linformer_claims(
        _results(_probes("real"), backend="tensorflow", cost=[]), MARGINS)}
    assert claims["cost_longest"].verdict == cl.NOT_TESTABLE
    assert not claims["cost_longest"].asserted
    assert "cost_grows_with_n_k128" not in claims


def test_wall_clock_claims_are_reported_not_asserted():
    # A slow Linformer run changes the verdict of the timing claims, never
    # the assert cell.
    flat = _bench(speed=(1.0, 1.05, 0.95, 1.0), memory=(1.0, 1.0, 1.02, 0.98), k_drop=1.0)
    claims = {c.name: c for c in lf.linformer_claims(
        _results(_probes("real"), table3=flat), MARGINS)}
    assert claims["bench_longest"].verdict != cl.REPRODUCED
    assert not claims["bench_longest"].failed
    assert not claims["speedup_grows_with_n_k128"].failed


def test_compiled_cost_of_real_layers():
    # On JAX, the compiled program of full attention at n = 256 needs more
    # FLOPs and temporary bytes than Linformer's at k = 16 (off JAX: None).
    full = lf.compiled_cost({"class_name": "FullAttention", "config": {}}, 256,
                            num_heads=2, head_dim=16)
    linformer = lf.compiled_cost(lf.linformer_spec(16, 256), 256, num_heads=2, head_dim=16)
    if keras.backend.backend() != "jax":
        assert full is None and linformer is None
        return
    assert full["flops"] > 1.5 * linformer["flops"]
    assert full["temp_bytes"] > 2 * linformer["temp_bytes"]


def test_planted_no_learning_fails():
    # Bug: a model that does not learn (labels shuffled, attention output
    # dropped): full attention at chance, no task check passes.
    accuracy = {"full": [11.0, 12.0], "k64": [10.0, 11.0], "k128": [11.0, 10.5],
                "bag": [10.5, 11.5]}
    claims = lf.linformer_claims(_results(_probes("real"), accuracy=accuracy), MARGINS)
    assert {"full_learns", "task_needs_attention"} <= _failed(claims)


def test_memory_claims_not_testable_on_torch():
    claims = {c.name: c for c in lf.linformer_claims(
        _results(_probes("real"), backend="torch"), MARGINS)}
    memory = claims["memory_saving_grows_with_n_k128"]
    assert memory.verdict == cl.NOT_TESTABLE and not memory.asserted
    assert "smaller in peak memory" not in claims["bench_longest"].statement


def test_table3_rows_and_markdown():
    rows = _bench()
    assert [(r["n"], r["k"]) for r in rows] == [(512, 128), (1024, 128), (2048, 128),
                                                (4096, 128), (4096, 512)]
    assert rows[0]["paper_speedup"] == 1.5 and rows[-1]["paper_memory_saving"] == 8.3
    text = lf.table3_markdown(rows, "speedup")
    assert "| 512 | 1.3x (1.5x) | — |" in text
    # JSON keys (strings) give the same rows.
    as_json = {str(n): {str(k): v for k, v in row.items()}
               for n, row in {512: {"full": {"median_ms": 2.0, "peak_mib": 4.0},
                                    128: {"median_ms": 1.0, "peak_mib": None}}}.items()}
    (row,) = lf.table3_rows(as_json)
    assert row["speedup"] == 2.0 and row["memory_saving"] is None


def test_padding_probe_sees_the_padding():
    # The probe has teeth: without the mask the padded values reach the
    # real positions (the same real layer, called without a mask).
    layer = _linformer()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 32, 16)).astype("float32")
    alone = keras.ops.convert_to_numpy(layer(x[:, :20], x[:, :20]))
    unmasked = keras.ops.convert_to_numpy(layer(x, x))[:, :20]
    assert np.max(np.abs(unmasked - alone)) > 1e-3


def test_compare_with_linformer_package_runs_only_when_importable():
    import importlib.util

    result = lf.compare_with_linformer_package(n=64, k=8, repeats=1)
    if keras.backend.backend() != "torch" or importlib.util.find_spec("linformer") is None:
        assert result is None
    else:
        assert result["n"] == 64 and result["ratio"] > 0
