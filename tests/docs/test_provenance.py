"""Provenance of the notebooks' results and `keras-longattn reproduce --stale`.

`keras_longattn.reproductions.provenance.write_results` records the commit,
the hashes of the package sources the process imported, the backend, the
date and the machine; `check_results` finds the results whose sources
changed; the docs' notebook pages and `reproduce --stale` show them. Nothing
here executes a notebook.
"""

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import types
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from keras_longattn import reproduce
from keras_longattn.reproductions import provenance

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]
PAPER_NOTEBOOKS = ("adamra", "linformer", "longformer", "routing_transformer",
                   "sparse_transformer", "synthesizer")


def _sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _combined(files):
    """The combined hash, written out here rather than taken from the module."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\n".encode())
    return digest.hexdigest()


def _git(root, *args):
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com",
         "-c", "commit.gpgsign=false", *args],
        cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def _package(root, files):
    """A fake ``keras_longattn`` under ``root``; returns module stand-ins."""
    modules = {}
    for name, text in files.items():
        path = root / "keras_longattn" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if name.endswith(".py"):
            modules[name] = types.SimpleNamespace(__file__=str(path))
    return modules


# ---------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------


SCRIPT = """
import json, sys
import keras
from keras_longattn.reproductions import claims
from keras_longattn.reproductions.provenance import write_results
write_results(sys.argv[1], {"metrics": {"x": 1.5}})
print(json.dumps({
    "files": sorted(m.__file__ for m in list(sys.modules.values())
                    if (getattr(m, "__file__", None) or "").startswith(sys.argv[2])),
    "backend": keras.backend.backend(), "keras": keras.__version__,
}))
"""


def test_write_results_records_the_process_that_wrote_them(tmp_path):
    """In a fresh process: the fields, and the hashes of exactly the package
    files that process imported (the recording module excepted)."""
    out = tmp_path / "deep" / "r.json"
    package = str(ROOT / "keras_longattn") + os.sep
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(out), package],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    written = json.loads(out.read_text())
    assert written["metrics"] == {"x": 1.5}
    record = written["provenance"]

    imported = {Path(f).resolve().relative_to(ROOT).as_posix() for f in seen["files"]}
    # The module that records is left out of what it records.
    assert "keras_longattn/provenance.py" in imported
    imported.discard("keras_longattn/provenance.py")
    assert {"keras_longattn/__init__.py", "keras_longattn/reproductions/__init__.py",
            "keras_longattn/reproductions/claims.py",
            "keras_longattn/reproductions/provenance.py"} <= imported
    files = record["source_files"]
    assert set(files) == imported
    for name, digest in files.items():
        assert digest == _sha256(ROOT / name), name
    assert record["source_sha256"] == _combined(files)

    assert record["backend"] == seen["backend"] == os.environ.get("KERAS_BACKEND", "jax")
    date = datetime.fromisoformat(record["date"])
    assert date.utcoffset() == timedelta(0)
    machine = record["machine"]
    assert machine["versions"]["keras"] == seen["keras"]
    assert "numpy" in machine["versions"] and "scipy" not in machine["versions"]
    assert machine["python"] == platform.python_version()
    assert machine["cpu_count"] == os.cpu_count()
    assert machine["processor"] and machine["platform"]

    if shutil.which("git") and (ROOT / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        assert record["commit"] == head
        assert isinstance(record["dirty"], bool)
        assert isinstance(record["dirty_sources"], list)


def test_collect_counts_package_modules_and_their_native_sources(tmp_path):
    modules = _package(tmp_path, {"__init__.py": "", "layers/a.py": "a = 1\n",
                                  "kernels/band.py": "b = 2\n",
                                  "kernels/csrc/band.cpp": "int x;\n",
                                  "unused.py": "u = 3\n"})
    outside = tmp_path / "elsewhere.py"
    outside.write_text("")
    imported = {
        "keras_longattn": modules["__init__.py"],
        "keras_longattn.layers.a": modules["layers/a.py"],
        "keras_longattn.kernels.band": modules["kernels/band.py"],
        "elsewhere": types.SimpleNamespace(__file__=str(outside)),
        "builtin": types.SimpleNamespace(),
    }
    record = provenance.collect(imported, root=tmp_path)
    files = record["source_files"]
    assert list(files) == ["keras_longattn/__init__.py", "keras_longattn/kernels/band.py",
                           "keras_longattn/kernels/csrc/band.cpp",
                           "keras_longattn/layers/a.py"]
    assert files["keras_longattn/kernels/csrc/band.cpp"] == _sha256(
        tmp_path / "keras_longattn/kernels/csrc/band.cpp")
    # Not a git checkout: no commit.
    assert record["commit"] is None and record["dirty"] is None
    assert record["backend"] is None


def test_paper_notebooks_write_through_write_results():
    for slug in PAPER_NOTEBOOKS + ("quickstart",):
        notebook = json.loads((ROOT / "notebooks" / f"{slug}.ipynb").read_text())
        code = "\n".join("".join(c["source"]) for c in notebook["cells"]
                         if c["cell_type"] == "code")
        assert "write_results(" in code, slug
        assert "path.write_text(" not in code, slug


# ---------------------------------------------------------------------------
# Staleness
# ---------------------------------------------------------------------------


def _results(folder, name, record=None, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    results = {"backend": "jax", "metrics": {"x": 1.0}, **fields}
    if record is not None:
        results["provenance"] = record
    path = folder / f"{name}.json"
    path.write_text(json.dumps(results))
    return path


def test_stale_detection(tmp_path):
    root = tmp_path / "root"
    modules = _package(root, {"__init__.py": "", "a.py": "a = 1\n", "b.py": "b = 1\n"})
    record = provenance.collect(modules, root=root)
    results = tmp_path / "results"
    _results(results, "bare")
    _results(results, "fresh", record)

    checks = {c.name: c for c in provenance.check_directory(results, root=root)}
    assert checks["bare"].stale and checks["bare"].reason == "no provenance recorded"
    assert "no provenance recorded" in checks["bare"].note()
    assert not checks["fresh"].stale and checks["fresh"].note() == ""
    assert provenance.format_stale(checks.values()) == "bare: stale, no provenance recorded"

    (root / "keras_longattn" / "b.py").write_text("b = 2\n")
    check = provenance.check_results(results / "fresh.json", root=root)
    assert check.stale and check.changed == ("keras_longattn/b.py",)
    assert "keras_longattn/b.py" in check.note() and "keras_longattn/a.py" not in check.note()
    assert check.note().startswith("Stale: the sources of this run changed")

    (root / "keras_longattn" / "a.py").unlink()
    check = provenance.check_results(results / "fresh.json", root=root)
    assert check.changed == ("keras_longattn/a.py", "keras_longattn/b.py")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_stale_since_names_the_first_commit_that_changed_a_recorded_file(tmp_path):
    root = tmp_path / "repo"
    modules = _package(root, {"__init__.py": "", "a.py": "a = 1\n", "b.py": "b = 1\n"})
    (root / "README.md").write_text("x\n")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "c0")
    c0 = _git(root, "rev-parse", "HEAD")
    record = provenance.collect(modules, root=root)
    assert record["commit"] == c0 and record["dirty"] is False
    results = _results(tmp_path / "results", "demo", record)

    (root / "README.md").write_text("y\n")
    _git(root, "commit", "-q", "-am", "c1: not a source of the run")
    assert not provenance.check_results(results, root=root).stale

    (root / "keras_longattn" / "b.py").write_text("b = 2\n")
    _git(root, "commit", "-q", "-am", "c2")
    c2 = _git(root, "rev-parse", "HEAD")
    (root / "keras_longattn" / "b.py").write_text("b = 3\n")
    _git(root, "commit", "-q", "-am", "c3")
    check = provenance.check_results(results, root=root)
    assert check.stale and check.commit == c0 and check.changed == ("keras_longattn/b.py",)
    assert check.since and c2.startswith(check.since)
    assert f"since {check.since}" in check.note()

    # Edits not committed yet: stale, without a "since" commit.
    (root / "keras_longattn" / "a.py").write_text("a = 5\n")
    dirty = provenance.collect(modules, root=root)
    assert dirty["dirty"] is True and dirty["dirty_sources"] == ["keras_longattn/a.py"]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_comments_and_docstrings_do_not_stale_a_result_checked_by_bytes(tmp_path):
    root = tmp_path / "repo"
    code = ('"""A module."""\n\n\ndef f(x):\n    """Doubles."""\n    return 2 * x  # fast\n\n\n'
            'class C:\n    """Holds."""\n\n    def g(self):\n        """Only a docstring."""\n')
    modules = _package(root, {"__init__.py": "", "a.py": code})
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "c0")
    record = provenance.collect(modules, root=root)
    results = _results(tmp_path / "results", "demo", record)
    source = root / "keras_longattn" / "a.py"

    documented = ('"""A module, documented again\nover two lines."""\n\n\ndef f(x):\n'
                  '    # a comment where there was a docstring\n    return 2 * x\n\n\n'
                  'class C:\n    def g(self):\n        pass\n')
    source.write_text(documented)
    assert provenance.code_sha256(documented) == provenance.code_sha256(code)
    check = provenance.check_results(results, root=root)
    assert not check.stale, check.describe()
    # committed too: the recorded version still comes from the run's commit
    _git(root, "commit", "-q", "-am", "c1: docstrings")
    assert not provenance.check_results(results, root=root).stale

    for edit in (code.replace("2 * x", "3 * x"), code.replace("def g(self)", "def h(self)"),
                 code.replace('"""Doubles."""', '"""Doubles."""\n    x = x + 0')):
        source.write_text(edit)
        check = provenance.check_results(results, root=root)
        assert check.stale and check.changed == ("keras_longattn/a.py",), edit

    # The recorded version must be the one at the commit: a run on a dirty
    # tree (recorded bytes that no commit holds) is checked by bytes alone.
    source.write_text(code)
    dirty = dict(record, source_files=dict(record["source_files"],
                                           **{"keras_longattn/a.py": "0" * 64}))
    dirty_results = _results(tmp_path / "results", "dirty", dirty)
    assert provenance.check_results(dirty_results, root=root).stale
    # ... and so is a record whose commit this clone lacks.
    source.write_text(documented)
    gone = _results(tmp_path / "results", "gone", dict(record, commit="f" * 40))
    assert provenance.check_results(gone, root=root).stale


# ---------------------------------------------------------------------------
# The docs page
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_figures_provenance_test",
                                                  ROOT / "docs" / "gen_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page(gen, tmp_path, root, record):
    """The notebook page and index that the docs hook makes for a committed
    run recording ``record``, against the sources under ``root``."""
    src, build, full, out = (tmp_path / n for n in ("src", "build", "full", "out"))
    for folder in (src, build, full):
        folder.mkdir(parents=True)
    notebook = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# Demo"}],
                "metadata": {"keras_longattn": {"title": "Demo"}},
                "nbformat": 4, "nbformat_minor": 5}
    (src / "demo.ipynb").write_text(json.dumps(notebook))
    (full / "demo.ipynb").write_text(json.dumps(notebook))
    _results(full, "demo", record, parameters={}, wall_time_s=1.0)
    page = tmp_path / "reproductions.md"
    gen.generate_notebooks(src=src, build=build, out=out, page=page, full=full,
                           root=root)
    cells = json.loads((out / "demo.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells], page.read_text()


def test_notebook_page_shows_a_stale_note(gen, tmp_path):
    root = tmp_path / "root"
    modules = _package(root, {"__init__.py": "", "a.py": "a = 1\n"})
    record = provenance.collect(modules, root=root)

    cells, index = _page(gen, tmp_path / "fresh", root, record)
    assert not any("Stale" in c for c in cells) and "Stale" not in index

    (root / "keras_longattn" / "a.py").write_text("a = 2\n")
    cells, index = _page(gen, tmp_path / "stale", root, record)
    notes = [c for c in cells if "Stale" in c]
    assert len(notes) == 1 and 'class="admonition warning' in notes[0]
    assert "the sources of this run changed" in notes[0] and "keras_longattn/a.py" in notes[0]
    assert '!!! warning "Stale"' in index and "keras_longattn/a.py" in index

    cells, index = _page(gen, tmp_path / "bare", root, None)
    assert any("no provenance recorded" in c for c in cells)
    assert "no provenance recorded" in index


def test_hook_rebuilds_the_pages_when_a_recorded_source_changes(gen, tmp_path, monkeypatch):
    """The notebooks step's cache key follows the staleness of the committed
    runs, so an edit to a recorded source regenerates the pages."""
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("hook_provenance_test",
                                                  ROOT / "docs" / "hooks" / "generate.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    root = tmp_path / "root"
    modules = _package(root, {"__init__.py": "", "a.py": "a = 1\n"})
    full = tmp_path / "full"
    _results(full, "demo", provenance.collect(modules, root=root))
    monkeypatch.setattr(gen, "NOTEBOOKS_FULL", full)
    fresh = hook.step_key("notebooks", gen, root)
    assert hook.step_key("notebooks", gen, root) == fresh
    (root / "keras_longattn" / "a.py").write_text("a = 2\n")
    assert hook.step_key("notebooks", gen, root) != fresh


# ---------------------------------------------------------------------------
# keras-longattn reproduce --stale [--run]
# ---------------------------------------------------------------------------


def _stale_folder(tmp_path):
    """Results against this checkout: one fresh, one with a changed source
    (recorded on torch), one without provenance."""
    record = provenance.collect()
    assert "keras_longattn/reproduce.py" in record["source_files"]
    changed = json.loads(json.dumps(record))
    changed["source_files"]["keras_longattn/reproduce.py"] = "0" * 64
    folder = tmp_path / "results"
    _results(folder, "fresh", record)
    _results(folder, "changed", changed, backend="torch")
    _results(folder, "bare")
    return folder


def test_reproduce_stale_lists_only_the_stale_results(tmp_path, capsys):
    folder = _stale_folder(tmp_path)
    assert reproduce.main(["--stale", "--output-dir", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["bare: stale, no provenance recorded",
                   out[1]]
    assert out[1].startswith("changed: stale ") and "keras_longattn/reproduce.py" in out[1]
    assert "fresh" not in "\n".join(out)

    assert reproduce.main(["--stale", "changed", "--output-dir", str(folder)]) == 0
    assert capsys.readouterr().out.startswith("changed: stale ")

    (folder / "bare.json").unlink()
    (folder / "changed.json").unlink()
    assert reproduce.main(["--stale", "--output-dir", str(folder)]) == 0
    assert capsys.readouterr().out == ""


def test_reproduce_stale_run_reruns_only_the_stale_at_full_size(tmp_path, monkeypatch, capsys):
    folder = _stale_folder(tmp_path)
    calls = []

    def execute(slug, **kwargs):
        calls.append((slug, kwargs))
        return {"metrics": {}, "backend": kwargs["backend"],
                "reproduce": {"size": "full", "total_wall_time_s": 0.0}}

    monkeypatch.setattr(reproduce, "execute_notebook", execute)
    assert reproduce.main(["--stale", "--run", "--output-dir", str(folder)]) == 0
    assert [slug for slug, _ in calls] == ["bare", "changed"]
    for _, kwargs in calls:
        assert kwargs["full"] is True and Path(kwargs["output_dir"]) == folder
        assert not kwargs["overrides"]
    assert dict((slug, kw["backend"]) for slug, kw in calls) == {"bare": "jax",
                                                               "changed": "torch"}
    capsys.readouterr()

    calls.clear()
    assert reproduce.main(["--stale", "--run", "--backend", "tensorflow",
                           "--output-dir", str(folder)]) == 0
    assert {kw["backend"] for _, kw in calls} == {"tensorflow"}


def test_reproduce_stale_run_recreates_planted_results_with_their_module(tmp_path, monkeypatch,
                                                                         capsys):
    """The planted variants' results are no notebook: --stale --run runs
    reproductions.planted (on JAX) for them, and the notebooks as before."""
    folder = _stale_folder(tmp_path)
    _results(folder, reproduce.PLANTED_RESULTS)
    notebooks, commands = [], []

    def execute(slug, **kwargs):
        notebooks.append(slug)
        return {"metrics": {}, "backend": kwargs["backend"],
                "reproduce": {"size": "full", "total_wall_time_s": 0.0}}

    real_run = subprocess.run

    def fake_run(command, *args, **kwargs):
        if "keras_longattn.reproductions.planted" not in command:
            return real_run(command, *args, **kwargs)  # git, for the provenance
        commands.append((command, kwargs["env"]["KERAS_BACKEND"]))
        return subprocess.CompletedProcess(command, 1)  # a variant not caught

    monkeypatch.setattr(reproduce, "execute_notebook", execute)
    monkeypatch.setattr(reproduce.subprocess, "run", fake_run)
    assert reproduce.main(["--stale", "--run", "--output-dir", str(folder)]) == 1
    assert notebooks == ["bare", "changed"]
    ((command, backend),) = commands
    assert backend == "jax" and command[1:4] == ["-m", "keras_longattn.reproductions.planted",
                                                 "--write"]
    assert Path(command[4]) == folder / "planted_bugs.json"
    capsys.readouterr()


def test_reproduce_stale_usage_errors(tmp_path, capsys):
    assert reproduce.main(["--run", "--output-dir", str(tmp_path)]) == 2
    assert "--stale" in capsys.readouterr().err
    assert reproduce.main(["--stale", "-p", "steps=1", "--output-dir", str(tmp_path)]) == 2
    assert "-p" in capsys.readouterr().err
