"""The adaptive span cost benchmark: its criterion on given rows, and one
tiny real run (torch, whose worker calls the layer eagerly)."""

import json

import keras
import pytest

from keras_longattn.benchmarks import span_cost

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _row(layer, ms, backend="torch", n=4096, mode="fwd", index=0, status="ok"):
    return {"layer": layer, "backend": backend, "seq_len": n, "mode": mode, "round": index,
            "status": status, "median_ms": ms if status == "ok" else None,
            "peak_memory_bytes": 2 ** 20}


def _report(rows):
    return {"settings": {"backends": sorted({r["backend"] for r in rows})}, "rows": rows}


def test_median_ratio_over_rounds_decides():
    rows = []
    for index, (at_max, at_eighth) in enumerate(((100.0, 20.0), (100.0, 30.0), (100.0, 40.0))):
        rows += [_row("full", 50.0, index=index), _row(span_cost.AT_MAX, at_max, index=index),
                 _row(span_cost.AT_EIGHTH, at_eighth, index=index)]
    (item,) = span_cost.span_criteria(_report(rows))
    assert item["ratio"] == pytest.approx(100.0 / 30.0)
    assert item["verdict"] == "failed"
    (item,) = span_cost.span_criteria(_report(rows), limit=3.0)
    assert item["verdict"] == "passed"
    assert [round(r, 3) for r in item["ratios"]] == [5.0, 3.333, 2.5]


def test_compiled_backends_and_missing_rows_are_not_verdicts():
    rows = [_row(span_cost.AT_MAX, 100.0, backend="jax"),
            _row(span_cost.AT_EIGHTH, 100.0, backend="jax"),
            _row(span_cost.AT_MAX, 100.0, status="oom"),
            _row(span_cost.AT_EIGHTH, 10.0)]
    verdicts = {item["backend"]: item["verdict"]
                for item in span_cost.span_criteria(_report(rows))}
    assert verdicts == {"jax": "not applicable", "torch": "not measured"}
    table = span_cost.rows_table(_report(rows))
    assert "| torch | 4,096 | fwd | adaptive-span-max | — | — | oom |" in table
    assert "not measured" in span_cost.criteria_table(span_cost.span_criteria(_report(rows)))


def test_registered_layers_differ_only_in_the_spans():
    from keras_longattn.specs import registry

    at_max = registry.get_entry(span_cost.AT_MAX).config
    at_eighth = registry.get_entry(span_cost.AT_EIGHTH).config
    assert at_max["class_name"] == at_eighth["class_name"] == "AdaptiveSpanAttention"
    assert {k: v for k, v in at_max["config"].items() if k != "span_init"} == \
        {k: v for k, v in at_eighth["config"].items() if k != "span_init"}
    assert (at_max["config"]["span_init"], at_eighth["config"]["span_init"]) == (1.0, 0.125)


def test_rounds_below_one_are_refused():
    with pytest.raises(ValueError, match="rounds=0"):
        span_cost.run_span_cost(rounds=0)


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="one real run is enough: the torch worker (eager) is the one "
                           "whose band follows the spans")
def test_tiny_real_run_writes_the_committed_form(tmp_path):
    report = span_cost.run_span_cost(lengths=(256,), window=128, modes=("fwd",), rounds=1,
                                     repeats=1, num_heads=2, head_dim=8)
    assert {r["layer"] for r in report["rows"]} == set(span_cost.LAYERS)
    assert all(r["status"] == "ok" for r in report["rows"]), report["rows"]
    path = span_cost.write_results(report, tmp_path / "span.json", command="test")
    written = json.loads(open(path, encoding="utf-8").read())
    (item,) = written["criteria"]
    assert item["verdict"] in ("passed", "failed") and len(item["ratios"]) == 1
    assert "provenance" in written and written["table"].count("| torch |") == 3
