"""The mkdocs hook docs/hooks/generate.py: the site builds from sources that
hold no generated file, and the generated files are cached by their inputs."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs")
pytest.importorskip("matplotlib")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hook():
    return _load(ROOT / "docs" / "hooks" / "generate.py", "docs_hook_generate")


@pytest.fixture()
def gen(hook):
    return hook.load_gen_figures()


def _tree(folder):
    return {p.relative_to(folder).as_posix(): p.stat().st_mtime_ns
            for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_mkdocs_yml_names_the_hook():
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "hooks:\n  - docs/hooks/generate.py" in text


def test_generate_writes_the_docs_layout_outside_docs(gen, tmp_path):
    before = _tree(ROOT / "docs")
    files = gen.generate(tmp_path, ["benchmarks", "notebooks"])
    assert "benchmarks.md" in files and "reproductions.md" in files
    if (ROOT / "docs" / "benchmarks" / "results.json").is_file():
        assert "assets/benchmarks/benchmark.png" in files
        assert "](assets/benchmarks/benchmark.png)" in (tmp_path / "benchmarks.md").read_text()
    for notebook in (ROOT / "notebooks").glob("*.ipynb"):
        assert f"notebooks/{notebook.name}" in files
    assert _tree(ROOT / "docs") == before, "generate() wrote into docs/"


def test_cache_reuses_an_entry_and_drops_older_keys(hook, tmp_path):
    calls = []

    def produce(out):
        calls.append(out)
        (out / "assets").mkdir()
        (out / "assets" / "a.png").write_bytes(b"png")
        (out / "page.md").write_text("# Page\n")

    folder, files, reused = hook.cached("demo", "a" * 64, tmp_path, produce)
    assert files == ["assets/a.png", "page.md"] and not reused and len(calls) == 1
    again, files_again, reused = hook.cached("demo", "a" * 64, tmp_path, produce)
    assert (again, files_again, reused) == (folder, files, True) and len(calls) == 1
    other, _, reused = hook.cached("demo", "b" * 64, tmp_path, produce)
    assert not reused and len(calls) == 2 and other != folder
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [other.name]


def test_failed_step_leaves_no_entry(hook, tmp_path):
    def produce(out):
        (out / "half.md").write_text("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        hook.cached("demo", "c" * 64, tmp_path, produce)
    assert list((tmp_path / "demo").iterdir()) == []


def test_keys_follow_the_inputs(hook, gen, tmp_path, monkeypatch):
    results = tmp_path / "results.json"
    monkeypatch.setattr(gen, "BENCHMARK_SOURCES", ((results, "committed"),))
    empty = hook.step_key("benchmarks", gen, ROOT)
    results.write_text('{"results": []}')
    first = hook.step_key("benchmarks", gen, ROOT)
    assert first != empty and first == hook.step_key("benchmarks", gen, ROOT)
    results.write_text('{"results": [{}]}')
    assert hook.step_key("benchmarks", gen, ROOT) != first

    build = tmp_path / "notebooks"
    build.mkdir()
    monkeypatch.setattr(gen, "NOTEBOOKS_BUILD", build)
    before = hook.step_key("notebooks", gen, ROOT)
    (build / "quickstart.ipynb").write_text("{}")
    assert hook.step_key("notebooks", gen, ROOT) != before

    # Patterns: the package sources; not the benchmark or notebook inputs.
    package = tmp_path / "keras_longattn"
    package.mkdir()
    (package / "__init__.py").write_text("")
    patterns = hook.step_key("patterns", gen, tmp_path)
    (package / "layers.py").write_text("x = 1\n")
    assert hook.step_key("patterns", gen, tmp_path) != patterns


#: Generated files that a copy of docs/ must not hold (git-ignored
#: leftovers of older gen_figures.py runs in a working tree).
GENERATED = ("assets/patterns", "assets/benchmarks", "notebooks", "benchmarks.md",
             "reproductions.md")


def _clean_copy(dest):
    """mkdocs.yml, docs/ without generated files, notebooks/ and the package."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    shutil.copy2(ROOT / "mkdocs.yml", dest / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", dest / "docs", ignore=ignore)
    for name in GENERATED:
        path = dest / "docs" / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for folder in ("notebooks", "keras_longattn"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)


def _build(root):
    # The backend the CI's build stage runs the hook on (its default).
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", KERAS_BACKEND="jax")
    env.pop("KERAS_LONGATTN_DOCS_CACHE", None)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    return result.stderr, time.perf_counter() - start


# Two whole builds (~100 s): CI's build stage makes the same strict build from
# a clean clone, whose pages the browser stage opens; this runs with --run-slow.
@pytest.mark.slow
def test_strict_build_from_sources_without_generated_files(tmp_path):
    _clean_copy(tmp_path)
    # A leftover of an older run (not in the nav) must not break the build.
    (tmp_path / "docs" / "notebooks").mkdir()
    (tmp_path / "docs" / "notebooks" / "gone.ipynb").write_text("{}")
    (tmp_path / "docs" / "benchmarks.md").write_text("# Stale\n")

    log, _ = _build(tmp_path)
    assert "Generated the docs' patterns" in log
    site = tmp_path / "site"
    for guide in (tmp_path / "docs" / "guides").glob("*_attention.md"):
        png = site / "assets" / "patterns" / f"{guide.stem}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    benchmarks = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    # The leftover's heading is gone (a "Stale" note of a stale result may be there).
    assert 'id="stale"' not in benchmarks and "<table" in benchmarks
    assert 'src="../assets/benchmarks/benchmark.png"' in benchmarks
    assert (site / "assets" / "benchmarks" / "benchmark.png").stat().st_size > 10000
    for notebook in (tmp_path / "notebooks").glob("*.ipynb"):
        page = site / "notebooks" / notebook.stem / "index.html"
        assert '<div class="jupyter-wrapper">' in page.read_text(encoding="utf-8"), page
    assert "Routing Transformer" in (site / "reproductions" / "index.html").read_text(
        encoding="utf-8")
    assert not (site / "notebooks" / "gone").exists()
    # Nothing generated went into the sources.
    assert not (tmp_path / "docs" / "assets" / "patterns").exists()

    # A second build reuses every cache entry.
    cache = tmp_path / "build" / "docs-generated"
    entries = {p: p.stat().st_mtime_ns for p in cache.glob("*/*")}
    assert len(entries) == 3
    log, _ = _build(tmp_path)
    assert "Generated the docs'" not in log
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*/*")} == entries
    assert (site / "assets" / "patterns" / "local_attention.png").is_file()
