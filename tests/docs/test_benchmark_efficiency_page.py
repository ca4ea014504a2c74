"""The efficiency table and the memory-per-token curve of the benchmark
page (docs/gen_figures.py), on small documents."""

import importlib.util
from pathlib import Path

import pytest

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen():
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("gen_figures_eff", ROOT / "docs" / "gen_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(n, peak, **extra):
    return {"layer": "local", "backend": "torch", "seq_len": n, "mode": "fwdbwd",
            "status": "ok", "median_ms": 10.0 * n / 1024, "peak_memory_bytes": peak,
            "causal": True, "scope": "attention", **extra}


def test_memory_curve_section_has_a_table_and_a_figure(gen, tmp_path):
    document = {"started": "2026-01-01T00:00:00", "results": [
        _row(16384, 16384 * 5000), _row(1048576, 1048576 * 5200, implementation="band_kernel"),
        _row(65536, None, status="oom")]}
    text = gen.memory_curve_section(document, tmp_path)
    # The path column: what ran, or that the row does not say.
    assert "| `local` | `band_kernel` | 1,048,576 |" in text and "5,200" in text
    assert "| `local` | not recorded | 16,384 |" in text
    assert "65,536" not in text  # not completed: not in the curve
    assert (tmp_path / gen.MEMORY_PLOT_NAME).is_file()
    assert gen.memory_curve_section(None, tmp_path) == ""
    assert gen.memory_curve_section({"results": []}, tmp_path) == ""


def test_efficiency_section_only_with_throughput(gen):
    rows = [_row(16384, 1, useful_gflop=12.8, useful_gflops_per_s=70.0,
                 matmul_peak_gflops=175.0, peak_fraction=0.4), _row(4096, 1)]
    text = gen.efficiency_section(rows)
    assert "Useful-FLOP throughput" in text and "40%" in text
    assert text.count("| `local` |") == 1
    assert "| `local` | torch | 16,384 | yes | attention | fwdbwd |" in text
    assert gen.efficiency_section([_row(4096, 1)]) == ""


def test_efficiency_section_names_the_allocator_state_and_faults(gen):
    """Rows say whether malloc was settled and their median page faults per
    call; rows measured before either was recorded get a dash."""
    base = dict(useful_gflop=2.0, useful_gflops_per_s=80.0, matmul_peak_gflops=180.0,
                peak_fraction=0.44)
    rows = [_row(8192, 1, allocator_settled=True, page_faults=[0, 3, 4065, 1, 2], **base),
            _row(16384, 1, allocator_settled=False, page_faults=[8000, 4000, 12000], **base),
            _row(32768, 1, **base)]
    lines = {line.split(" | ")[2]: line for line in gen.efficiency_section(rows).splitlines()
             if line.startswith("| `local`")}
    assert lines["8,192"].endswith("| settled | 2 |")
    assert lines["16,384"].endswith("| as started | 8,000 |")
    assert lines["32,768"].endswith(f"| {gen.DASH} | {gen.DASH} |")
