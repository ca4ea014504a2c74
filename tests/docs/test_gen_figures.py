"""docs/gen_figures.py and docs/griffe_docstrings.py, on small inputs."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():
    pytest.importorskip("matplotlib")
    return _load("gen_figures")


def test_snake_case(gen):
    assert gen.snake_case("LocalAttention") == "local_attention"
    assert gen.snake_case("FullAttention") == "full_attention"


def test_pattern_masks_come_from_the_layer(gen):
    from keras_longattn.layers import LocalAttention

    masks = gen.pattern_masks(LocalAttention(num_heads=2, key_dim=4, window=4), n=12)
    i, j = np.meshgrid(np.arange(12), np.arange(12), indexing="ij")
    np.testing.assert_array_equal(masks["causal"], (j <= i) & (j > i - 4))
    np.testing.assert_array_equal(masks["bidirectional"], np.abs(j - i) <= 2)


def test_every_guide_has_a_figure(gen, tmp_path):
    written = {p.name for p in gen.generate_patterns(out_dir=tmp_path, n=16)}
    for guide in (ROOT / "docs" / "guides").glob("*_attention.md"):
        assert f"{guide.stem}.png" in written
        assert f"../assets/patterns/{guide.stem}.png" in guide.read_text(encoding="utf-8")


def test_entmax_figure_weights_are_softmax_entmax_and_sparsemax(gen, tmp_path):
    """Same projections in every panel: each row sums to 1, softmax has no
    exact zero, sparsemax has more than 1.5-entmax, which has some; the
    sparsemax panel is the sparsemax of the softmax panel's scores."""
    weights = gen.entmax_weights(n=12)
    soft, e15, sparse = (weights[title] for title, _ in gen.ENTMAX_FIGURE_ALPHAS)
    for w in (soft, e15, sparse):
        assert w.shape == (12, 12)
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, atol=1e-5)
    assert not np.any(soft == 0)
    assert 0 < np.sum(e15 == 0) < np.sum(sparse == 0)
    # Softmax weights are exp(s) / sum: log w recovers the scores up to a
    # per-row constant, and sparsemax of the scores is [s - tau]_+.
    from keras_longattn.ops.entmax import sparsemax

    scores = np.log(soft.astype("float64")).astype("float32")
    np.testing.assert_allclose(np.asarray(sparsemax(scores)), sparse, atol=1e-5)
    path = gen.draw_entmax("EntmaxAttention", {}, tmp_path / "entmax_attention.png", n=12)
    assert path.stat().st_size > 1000


def test_adaptive_span_figure_draws_each_heads_soft_mask(gen, tmp_path):
    """The masks are the paper's clamp((R + z - x) / R, 0, 1) on x = i - j
    >= 0, for the spans max_span * v set through the layer's weights."""
    options = {"max_span": 8, "ramp": 3}
    layer, masks = gen.span_masks(options, n=16, fractions=(0.0, 0.5, 1.0))
    assert list(masks) == ["head 0: span z = 0", "head 1: span z = 4",
                           "head 2: span z = 8"]
    i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    for z, mask in zip((0.0, 4.0, 8.0), masks.values()):
        expected = np.clip((3 + z - (i - j)) / 3, 0, 1) * (j <= i)
        np.testing.assert_allclose(mask, expected, atol=1e-6)
    assert layer.current_reach() == 8 + 3 - 1
    path = gen.draw_adaptive_span("AdaptiveSpanAttention", options,
                                  tmp_path / "adaptive_span_attention.png", n=16)
    assert path.stat().st_size > 1000


def test_new_layers_figures_are_generated(gen, tmp_path, monkeypatch):
    """generate_patterns writes EntmaxAttention's and AdaptiveSpanAttention's
    figures through CUSTOM_FIGURES (AdaptiveSpanAttention has no default
    max_span: its options come from FIGURE_OPTIONS); the other layers are
    left out to keep the test short (test_every_guide_has_a_figure draws
    them all)."""
    layers = gen.attention_layers()
    monkeypatch.setattr(gen, "attention_layers", lambda: {
        name: layers[name] for name in ("AdaptiveSpanAttention", "EntmaxAttention")})
    written = {p.name: p for p in gen.generate_patterns(out_dir=tmp_path, n=16)}
    assert set(written) == {"entmax_attention.png", "adaptive_span_attention.png"}
    for name in ("entmax_attention.png", "adaptive_span_attention.png"):
        assert name in written and written[name].stat().st_size > 1000


def test_benchmark_page_without_results_says_so(gen):
    page = gen.benchmark_page(None, None, None)
    assert "No benchmark results are available" in page
    assert "| layer |" not in page


def _row(layer, n, ms, peak, ratio=None, status="ok"):
    return {"layer": layer, "backend": "jax", "seq_len": n, "mode": "fwdbwd", "status": status,
            "median_ms": ms, "peak_memory_bytes": peak, "memory_method": "rss-hwm",
            "baseline": "full", "time_ratio": ratio, "memory_ratio": ratio and 1 / ratio,
            "ratio_note": "" if status == "ok" else status, "message": "killed" if status != "ok" else ""}


def test_benchmark_page_with_results(gen, tmp_path):
    document = {
        "started": "2026-01-01T00:00:00+00:00",
        "config": {"layers": ["full", "local"], "lengths": [1024, 4096], "window": 256},
        "machine": {"platform": "Linux", "usable_cpus": 2, "versions": {"keras": "3"}},
        "results": [
            _row("full", 1024, 100.0, 2 ** 26, 1.0),
            dict(_row("local", 1024, 50.0, 2 ** 25, 2.0), implementation="band_kernel"),
            _row("full", 4096, None, None, status="oom"), _row("local", 4096, 200.0, 2 ** 26),
        ],
    }
    page = gen.benchmark_page(document, ROOT / "docs/benchmarks/results.json", "committed",
                              assets=tmp_path)
    assert "### jax" in page
    # The path column: what ran, a dash where the row does not record it.
    assert ("| `local` | `band_kernel` | 1,024 | yes | fwdbwd | 50.0 | 2.00x | 32.0 | 0.50 "
            "| ok |") in page
    assert "| `full` | — | 1,024 |" in page
    assert "oom: killed" in page
    assert (tmp_path / "benchmark.png").stat().st_size > 1000
    local = gen.benchmark_page(document, ROOT / "build/benchmarks/latest.json", "local",
                               assets=tmp_path)
    assert "Local, uncommitted run" in local
    merged = dict(document, runs=[{"file": "a.json", "config": {"lengths": [1024]},
                                   "started": "s1", "finished": "f1"}])
    merged.pop("config")
    page = gen.benchmark_page(merged, ROOT / "docs/benchmarks/results.json", "committed",
                              assets=tmp_path)
    assert "4 configurations from 1 runs" in page and "`a.json`, started s1, finished f1" in page


def test_notebook_copies(gen, tmp_path):
    src, build, out = tmp_path / "src", tmp_path / "build", tmp_path / "out"
    for folder in (src, build):
        folder.mkdir()
    cell = {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
            "source": "print(1)"}
    notebook = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# Demo"}, cell],
                "metadata": {"keras_longattn": {"title": "Demo", "claims": ["it works"]}},
                "nbformat": 4, "nbformat_minor": 5}
    (src / "demo.ipynb").write_text(json.dumps(notebook))
    (src / "other.ipynb").write_text(json.dumps(notebook))
    executed = json.loads(json.dumps(notebook))
    executed["cells"][1]["outputs"] = [
        {"output_type": "stream", "name": "stderr",
         "text": "WARNING: All log messages before absl::InitializeLog() is called are "
                 "written to STDERR\nI0000 00:00:1 port.cc:153] oneDNN custom operations are on.\n"},
        {"output_type": "stream", "name": "stderr", "text": "a real warning\n"},
        {"output_type": "stream", "name": "stdout", "text": "1\n"},
    ]
    (build / "demo.ipynb").write_text(json.dumps(executed))
    (build / "demo.json").write_text(json.dumps(
        {"backend": "jax", "metrics": {"bits": 1.5}, "wall_time_s": 3.0, "parameters": {}}))
    page = tmp_path / "reproductions.md"
    gen.generate_notebooks(src=src, build=build, out=out, page=page, full=tmp_path / "none")
    copied = json.loads((out / "demo.ipynb").read_text())
    texts = [o["text"] for o in copied["cells"][1]["outputs"]]
    assert texts == ["a real warning\n", "1\n"]
    unexecuted = json.loads((out / "other.ipynb").read_text())
    assert "Not executed" in unexecuted["cells"][1]["source"]
    text = page.read_text()
    assert "## Demo" in text and "| `bits` | 1.5 |" in text and "it works" in text
    assert "keras-longattn reproduce demo --full" in text


def test_griffe_rewrite():
    pytest.importorskip("griffe")
    rewrite = _load("griffe_docstrings").rewrite
    text = "Summary :class:`Foo` and :func:`~a.b`.\n\nExample:\n\n>>> x = 1\n>>> x\n1\n\nReference:\n    R."
    assert rewrite(text) == (
        "Summary `Foo` and `a.b`.\n\nExamples:\n\n    >>> x = 1\n    >>> x\n    1\n\n"
        "Reference:\n    R.")
    args = "Args:\n    See :class:`Base` (the arguments\n    of X).\n\nReturns:\n    y."
    assert rewrite(args) == "Constructor arguments: see `Base` (the arguments of X).\n\nReturns:\n    y."
    kept = "Args:\n    x: a number.\n"
    assert rewrite(kept) == kept


def test_committed_full_size_run_is_shown(gen, tmp_path):
    """docs/results/<slug>.ipynb (a --full run) replaces the build's CI-size
    copy in the docs; the index gives both result tables."""
    src, build, out, full = (tmp_path / n for n in ("src", "build", "out", "full"))
    for folder in (src, build, full):
        folder.mkdir()
    meta = {"keras_longattn": {"title": "Demo", "full_parameters": {"steps": 100}}}
    notebook = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# Demo"}],
                "metadata": meta, "nbformat": 4, "nbformat_minor": 5}
    (src / "demo.ipynb").write_text(json.dumps(notebook))
    for folder, steps, bits, marker in ((build, 10, 3.0, "ci"), (full, 100, 1.25, "full")):
        executed = json.loads(json.dumps(notebook))
        executed["cells"].append({"cell_type": "markdown", "metadata": {}, "source": marker})
        (folder / "demo.ipynb").write_text(json.dumps(executed))
        (folder / "demo.json").write_text(json.dumps(
            {"backend": "jax", "parameters": {"steps": steps}, "wall_time_s": 1.0,
             "metrics": {"bits": bits, "table": {"dense": {"bits": bits}}, "curve": [1, 2]}}))
    page = tmp_path / "reproductions.md"
    gen.generate_notebooks(src=src, build=build, out=out, page=page, full=full)
    shown = json.loads((out / "demo.ipynb").read_text())
    sources = ["".join(c["source"]) for c in shown["cells"]]
    assert "full" in sources and "ci" not in sources
    assert any("Full-size run" in s for s in sources)
    text = page.read_text()
    assert "Committed results (full size" in text and "| `bits` | 1.25 |" in text
    assert "Results of this build (CI size" in text and "| `bits` | 3 |" in text
    assert "| `table.dense.bits` | 1.25 |" in text and "curve" not in text
