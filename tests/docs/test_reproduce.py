"""`keras_longattn.reproduce`: parameters, argument parsing, reporting.

Only `test_a_failing_notebook_in_a_real_kernel` starts a kernel (a tiny
notebook, about a second); scripts/extra_stages.sh executes the notebooks.
"""

import argparse
import json
import re

import pytest

from keras_longattn import reproduce

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _notebook(parameters_source, full=None, tags=("parameters",)):
    return {
        "cells": [
            {"cell_type": "markdown", "id": "title", "metadata": {}, "source": "# Title"},
            {"cell_type": "code", "id": "parameters", "metadata": {"tags": list(tags)},
             "outputs": [], "execution_count": None, "source": parameters_source},
            {"cell_type": "code", "id": "check", "metadata": {}, "outputs": [],
             "execution_count": None, "source": "assert True"},
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


def _words(text):
    """The report with its wrapping undone (every run of blanks one space)."""
    return " ".join(text.split())


def test_format_results():
    text = reproduce.format_results({
        "demo": {"metrics": {"bits": 3.14159, "steps": 1200}, "backend": "jax",
                 "wall_time_s": 12.5,
                 "reproduce": {"size": "ci", "total_wall_time_s": 20.0,
                               "output": "build/notebooks/demo.ipynb"}},
    })
    assert text.startswith("== demo")
    assert "bits=3.142" in text and "steps=1,200" in text and "backend jax" in text
    assert "CI size" in text and "build/notebooks/demo.ipynb" in text


LONG_PAPER = ("2.80 vs 2.82 bits/dim on CIFAR-10 (Table 2), and 0.99 vs 1.00 bits/byte on enwik8, "
              "the paper's own numbers in full")
ASSERTED = {"name": "task_solved", "statement": "full attention solves the recall task",
            "paper": "(our task)", "ours": "0.95 ± 0.01 (2 seeds) (needs >= 0.9)",
            "verdict": "reproduced", "asserted": True, "detail": "mean 0.95, threshold 0.9"}
REPORTED = {"name": "speedup", "statement": "strided attention is faster per step than dense",
            "paper": LONG_PAPER, "ours": "2.1x (±0.2, 3 seeds)", "verdict": "direction only",
            "asserted": False, "detail": "ratio 2.1, needs >= 3"}


def _claim_block(text, statement):
    """The lines of the claim whose statement starts ``statement``, up to
    the next claim or the metrics."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if statement in line)
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"^\s+\d+\. \[", lines[i]) or lines[i].lstrip().startswith("metrics:")),
               len(lines))
    return _words("\n".join(lines[start:end]))


def test_format_results_prints_each_claim_as_its_statement(tmp_path):
    """A claim is its statement (not its identifier), asserted or reported,
    in claims.shown_verdict's words, with the paper's number in full."""
    text = reproduce.format_results(
        {"demo": {"claims": [ASSERTED, REPORTED], "backend": "torch",
                  "reproduce": {"size": "ci"}}},
        full_results_dir=tmp_path, width=72,
    )
    assert all(len(line) <= 72 for line in text.splitlines() if str(tmp_path) not in line)
    assert "task_solved" not in text and "speedup" not in text  # statements, not names
    asserted = _claim_block(text, "full attention solves")
    assert asserted.startswith("1. [asserted] full attention solves the recall task")
    assert "here (CI size): holds" in asserted  # an asserted threshold: holds, not reproduced
    assert "paper: (our task)" in asserted and "ours: 0.95 ± 0.01 (2 seeds)" in asserted
    reported = _claim_block(text, "strided attention")
    assert reported.startswith("2. [reported] strided attention is faster per step than dense")
    assert "here (CI size): measured, direction only" in reported
    assert f"paper: {LONG_PAPER}" in reported  # in full, not cut at 40 characters
    assert "claims: 1 asserted, 1 reported" in text
    assert "full size: none committed" in text


def test_format_results_full_size_verdicts_with_failed_and_stale_marks(tmp_path):
    """The committed full-size run: each claim's verdict there, FAILED after
    an asserted claim that did not hold (a reported one that did not is no
    failure), stale when the record's sources changed (here: it records no
    provenance), and the claims only the full-size run makes."""
    failed_full = dict(ASSERTED, ours="0.891 ± 0.023 (3 seeds) (needs >= 0.9)",
                       verdict="not reproduced", detail="mean 0.891, threshold 0.9")
    reported_full = dict(REPORTED, verdict="not reproduced")
    only_full = {"name": "lm", "statement": "byte LM: routing beats local attention",
                 "paper": "15.8 vs 18.3 ppl", "ours": "4.03 vs 4.04", "asserted": False,
                 "verdict": "not testable at this scale",
                 "detail": "difference 0.01, margin 0.05, spread 0.06"}
    (tmp_path / "demo.json").write_text(json.dumps(
        {"claims": [failed_full, reported_full, only_full]}))
    text = reproduce.format_results(
        {"demo": {"claims": [ASSERTED, REPORTED], "backend": "torch",
                  "reproduce": {"size": "ci"}}},
        full_results_dir=tmp_path, width=100,
    )
    header = _words(text.split("claims:")[0])
    assert "full size: " in header and "demo.json" in header
    assert "stale: no provenance recorded" in header
    assert "FAILED its assert cell: task_solved" in header
    asserted = _claim_block(text, "full attention solves")
    assert "here (CI size): holds | full size: does not hold [FAILED, stale]" in asserted
    assert "ours at full size: 0.891 ± 0.023 (3 seeds)" in asserted
    reported = _claim_block(text, "strided attention")
    assert "full size: measured, does not hold [stale]" in reported
    assert "FAILED" not in reported
    assert "claims of the full-size run only (1):" in text
    lm = _claim_block(text, "byte LM")
    assert lm.startswith("3. [reported] byte LM: routing beats local attention")
    assert ("here (CI size): not run at this size | "
            "full size: not testable at this scale [stale]") in lm
    assert "ours at full size: 4.03 vs 4.04" in lm


def test_format_results_an_up_to_date_full_size_run_has_no_mark(tmp_path):
    record = {"claims": [ASSERTED],
              "provenance": {"source_files": {}, "commit": "0123456789abcdef",
                             "date": "2026-01-02T03:04:05+00:00"}}
    (tmp_path / "demo.json").write_text(json.dumps(record))
    text = reproduce.format_results({"demo": {"claims": [ASSERTED], "reproduce": {"size": "ci"}}},
                                    full_results_dir=tmp_path)
    assert "(ran 2026-01-02, commit 0123456); up to date with the sources" in _words(text)
    assert "full size: holds" in text
    assert "[" not in _claim_block(text, "full attention solves").split("full size:")[1]


def _failing_notebook(directory, threshold_ok=False):
    """A notebook that writes a failed asserted claim, then asserts."""
    cells = [
        "import json\n"
        "claims = [{'name': 'solves', 'statement': 'the toy model solves the toy task',\n"
        "           'paper': 'solved', 'ours': '0.42 (needs >= 0.5)', 'asserted': True,\n"
        "           'verdict': 'reproduced' if threshold <= 0.42 else 'not reproduced',\n"
        "           'detail': 'mean 0.42, threshold 0.5'}]\n"
        "json.dump({'backend': 'none', 'metrics': {'accuracy': 0.42}, 'claims': claims},\n"
        "          open(results_path, 'w'))",
        "failed = [c['name'] for c in claims if c['verdict'] != 'reproduced']\n"
        "assert not failed, f'claims that do not hold: {failed}'",
    ]
    notebook = _notebook("threshold = 0.5\nresults_path = None\n")
    notebook["cells"][2:] = [
        {"cell_type": "code", "id": f"cell-{index}", "metadata": {}, "outputs": [],
         "execution_count": None, "source": source} for index, source in enumerate(cells)]
    notebook["metadata"]["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                          "language": "python"}
    (directory / "toy.ipynb").write_text(json.dumps(notebook))


class _FakeError(Exception):
    """papermill's PapermillExecutionError, as far as the report reads it."""

    def __init__(self, exec_count, source, ename, evalue, traceback):
        super().__init__(evalue)
        self.exec_count, self.source, self.ename, self.evalue = exec_count, source, ename, evalue
        self.traceback = traceback


def _run_toy(tmp_path, monkeypatch, write_results):
    """`reproduce toy` whose papermill raises in the assert cell, after
    writing the results (``write_results``) or before."""
    papermill = pytest.importorskip("papermill")
    exceptions = pytest.importorskip("papermill.exceptions")
    _failing_notebook(tmp_path)
    source = "failed = [c['name'] for c in claims]\nassert not failed, 'claims that do not hold'"
    traceback = ["\x1b[31m---\x1b[39m",
                 "\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[4]\x1b[39m\x1b[32m, line 2"
                 "\x1b[39m\n----> 2 assert not failed",
                 "\x1b[31mAssertionError\x1b[39m: claims that do not hold"]

    def execute(source_path, output, parameters, cwd, **kwargs):
        assert "--IPKernelApp.log_level=ERROR" in kwargs["extra_arguments"]
        if write_results:
            (tmp_path / "out" / parameters["results_path"]).write_text(json.dumps({
                "backend": "jax", "metrics": {"accuracy": 0.42},
                "claims": [dict(ASSERTED, verdict="not reproduced")]}))
        raise _FakeError(4, source, "AssertionError", "claims that do not hold", traceback)

    monkeypatch.setattr(exceptions, "PapermillExecutionError", _FakeError)
    monkeypatch.setattr(papermill, "execute_notebook", execute)
    monkeypatch.setattr(reproduce, "_check_kernel", lambda: None)
    parser = reproduce.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["toy", "--notebooks-dir", str(tmp_path),
                              "--output-dir", str(tmp_path / "out")])
    return reproduce.run(args)


def test_a_failing_notebook_still_prints_its_claims(tmp_path, monkeypatch, capsys):
    assert _run_toy(tmp_path, monkeypatch, write_results=True) == 1
    captured = capsys.readouterr()
    out = _words(captured.out)
    assert "== toy: T" in out
    assert ("FAILED: cell In[4] raised AssertionError at `assert not failed, 'claims that do "
            "not hold'`: claims that do not hold") in out
    assert "The claims below are what the notebook wrote before it stopped." in out
    assert "claims: 1 asserted, 0 reported; FAILED here: task_solved" in out
    assert "1. [asserted] full attention solves the recall task" in out
    assert "here (CI size): does not hold, FAILED" in out
    assert "metrics: accuracy=0.42" in out
    assert "0 of 1 notebook(s) passed" in out
    assert "FAILED toy: cell In[4] raised AssertionError" in captured.err
    assert "failed: toy" in captured.err


def test_a_notebook_that_stops_before_its_results_says_so(tmp_path, monkeypatch, capsys):
    assert _run_toy(tmp_path, monkeypatch, write_results=False) == 1
    out = _words(capsys.readouterr().out)
    assert "== toy: T" in out and "FAILED: cell In[4] raised AssertionError" in out
    assert "stopped before it wrote its results" in out


def test_failure_reads_the_cell_line_from_the_traceback():
    error = _FakeError(7, "x = 1\nassert x == 2\n", "AssertionError", "",
                       ["\x1b[36mCell In[7], line 2\x1b[39m\n----> 2 assert x == 2"])
    assert reproduce._failure(error) == {"cell": 7, "error": "AssertionError", "message": "",
                                         "line": "assert x == 2"}
    error.traceback = ["no cell frame"]
    assert reproduce._failure(error)["line"] == ""


def test_a_failing_notebook_in_a_real_kernel(tmp_path, capfd):
    """End to end: papermill runs the toy notebook in a kernel; the report
    names the failed assert and prints the claims; neither papermill nor
    the kernel prints a warning (no 'Unable to parse', no TCP notice)."""
    pytest.importorskip("papermill")
    try:
        reproduce._check_kernel()
    except reproduce.ReproductionError as error:
        pytest.skip(str(error))
    _failing_notebook(tmp_path)
    parser = reproduce.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["toy", "--notebooks-dir", str(tmp_path),
                              "--output-dir", str(tmp_path / "out"), "--timeout", "60"])
    assert reproduce.run(args) == 1
    captured = capfd.readouterr()
    out = _words(captured.out)
    assert "raised AssertionError at `assert not failed, f'claims that do not hold: " in out
    assert "1. [asserted] the toy model solves the toy task" in out
    assert "here (CI size): does not hold, FAILED" in out
    errors = [line for line in captured.err.splitlines()
              if not line.startswith("[reproduce]") and line.strip()]
    assert errors == [], errors
    assert reproduce.run(parser.parse_args(
        ["toy", "--notebooks-dir", str(tmp_path), "--output-dir", str(tmp_path / "out"),
         "-p", "threshold=0.4"])) == 0
    captured = capfd.readouterr()
    assert "here (CI size): holds" in captured.out and "1 of 1 notebook(s) passed" in captured.out
    assert not [line for line in captured.err.splitlines() if line.strip()], captured.err


def test_format_results_of_a_run_into_the_committed_folder(tmp_path):
    """`--stale --run` writes into docs/results: the run is the committed
    one, with nothing to compare it with."""
    (tmp_path / "demo.json").write_text(json.dumps({"claims": [ASSERTED]}))
    text = reproduce.format_results(
        {"demo": {"claims": [ASSERTED],
                  "reproduce": {"size": "full", "results": str(tmp_path / "demo.json")}}},
        full_results_dir=tmp_path)
    assert "full size: this run is the committed one" in text
    assert "here (full size): holds" in text and "|" not in text
