"""`keras_longattn.reproduce`: parameters, argument parsing, reporting.

Nothing here starts a kernel; scripts/extra_stages.sh executes the notebooks.
"""

import argparse
import json

import pytest

from keras_longattn import reproduce


def _notebook(parameters_source, full=None, tags=("parameters",)):
    return {
        "cells": [
            {"cell_type": "markdown", "metadata": {}, "source": "# Title"},
            {"cell_type": "code", "metadata": {"tags": list(tags)}, "outputs": [],
             "execution_count": None, "source": parameters_source},
            {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
             "source": "assert True"},
        ],
        "metadata": {"keras_longattn": {"title": "T", "full_parameters": full or {}}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


SOURCE = 'backend = "jax"  # comment\nsteps = 10\nrate: float = 1e-3\nresults_path = "r.json"\n'


def test_notebook_parameters_reads_literals():
    params = reproduce.notebook_parameters(_notebook(SOURCE))
    assert params == {"backend": "jax", "steps": 10, "rate": 1e-3, "results_path": "r.json"}


def test_notebook_parameters_needs_one_cell():
    with pytest.raises(reproduce.ReproductionError, match="exactly one"):
        reproduce.notebook_parameters(_notebook(SOURCE, tags=()))


def test_notebook_parameters_refuses_expressions():
    with pytest.raises(reproduce.ReproductionError, match="not a literal"):
        reproduce.notebook_parameters(_notebook("steps = 2 ** 10\n"))


def test_resolve_parameters_ci_full_backend_overrides():
    notebook = _notebook(SOURCE, full={"steps": 1000})
    assert reproduce.resolve_parameters(notebook) == {}
    assert reproduce.resolve_parameters(notebook, full=True) == {"steps": 1000}
    assert reproduce.resolve_parameters(notebook, full=True, backend="torch",
                                        overrides={"steps": 5}) == {
        "steps": 5, "backend": "torch"}


def test_resolve_parameters_refuses_unknown_names():
    with pytest.raises(reproduce.ReproductionError, match="not parameters"):
        reproduce.resolve_parameters(_notebook(SOURCE), overrides={"stpes": 5})
    with pytest.raises(reproduce.ReproductionError, match="full_parameters"):
        reproduce.resolve_parameters(_notebook(SOURCE), full=True)


def test_list_notebooks(tmp_path):
    for name in ("b.ipynb", "a.ipynb", "_draft.ipynb", "notes.md"):
        (tmp_path / name).write_text("{}")
    assert reproduce.list_notebooks(tmp_path) == ["a", "b"]


def test_repository_notebooks_are_found():
    assert "quickstart" in reproduce.list_notebooks()


def test_add_parser_follows_the_cli_convention():
    parser = argparse.ArgumentParser(prog="keras-longattn")
    sub = parser.add_subparsers(dest="command")
    reproduce.add_parser(sub)
    args = parser.parse_args(
        ["reproduce", "quickstart", "--full", "--backend", "torch", "-p", "steps=5",
         "-p", "name=abc", "--output-dir", "out"])
    assert args.slugs == ["quickstart"] and args.full and args.backend == "torch"
    assert dict(args.parameters) == {"steps": 5, "name": "abc"}
    assert args.output_dir == "out"
    assert callable(args.handler) and args.command_parser is not None


def test_bad_parameter_syntax_is_an_error():
    parser = reproduce.add_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["x", "-p", "no-equals-sign"])


def test_run_without_a_notebook_is_a_usage_error(tmp_path, capsys):
    parser = reproduce.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--notebooks-dir", str(tmp_path)])
    assert reproduce.run(args) == 2
    assert "--all" in capsys.readouterr().err


def test_run_unknown_notebook_fails(tmp_path, capsys):
    parser = reproduce.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["nope", "--notebooks-dir", str(tmp_path),
                              "--output-dir", str(tmp_path / "out")])
    assert reproduce.run(args) == 1
    assert "no notebook" in capsys.readouterr().err


def test_list(tmp_path, capsys):
    path = tmp_path / "demo.ipynb"
    path.write_text(json.dumps(_notebook(SOURCE, full={"steps": 1000})))
    parser = reproduce.add_arguments(argparse.ArgumentParser())
    assert reproduce.run(parser.parse_args(["--list", "--notebooks-dir", str(tmp_path)])) == 0
    out = capsys.readouterr().out
    assert "demo: T" in out and "steps=10->1000" in out


def test_format_results():
    text = reproduce.format_results({
        "demo": {"metrics": {"bits": 3.14159, "steps": 1200}, "backend": "jax",
                 "wall_time_s": 12.5,
                 "reproduce": {"size": "ci", "total_wall_time_s": 20.0,
                               "output": "build/notebooks/demo.ipynb"}},
    })
    assert "demo" in text and "3.142" in text and "1,200" in text and "jax" in text
    assert "build/notebooks/demo.ipynb" in text


def test_format_results_prints_claims_with_both_verdicts(tmp_path):
    """Each claim of a run: the paper's number, ours, the verdict at this
    size and at full size (the committed run), and where that run is."""
    claim = {"name": "speedup", "statement": "s", "paper": "3x at n=4096",
             "ours": "2.1x (±0.2, 3 seeds)", "verdict": "direction only", "asserted": False}
    full = dict(claim, ours="3.2x", verdict="reproduced")
    (tmp_path / "demo.json").write_text(json.dumps({"claims": [full]}))
    text = reproduce.format_results(
        {"demo": {"claims": [claim], "metrics": {"bits": 1.0}, "backend": "torch",
                  "reproduce": {"size": "ci"}}},
        full_results_dir=tmp_path,
    )
    row = next(line for line in text.splitlines() if line.strip().startswith("speedup"))
    assert "3x at n=4096" in row and "2.1x (±0.2, 3 seeds)" in row
    assert "direction only (reported)" in row and "reproduced" in row
    assert row.index("direction only") < row.index("reproduced") < row.index("3x at")
    assert f"full-size result: {tmp_path / 'demo.json'}" in text
    assert "Stale: no provenance recorded" in text  # the typed file has none
    missing = reproduce.format_results({"other": {"claims": [claim]}}, full_results_dir=tmp_path)
    assert "none committed" in missing
