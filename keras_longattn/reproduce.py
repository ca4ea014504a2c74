"""``keras-longattn reproduce``: executes the notebooks of ``notebooks/``.

Each notebook ``notebooks/<slug>.ipynb`` is a reproduction that runs at two
sizes:

* the **CI size**: the defaults of its ``parameters``-tagged cell (a few
  minutes at most on a 2-core CPU);
* the **full size**: the parameters its metadata declares in
  ``metadata["keras_longattn"]["full_parameters"]`` (``--full``).

The notebook is executed with papermill (kernel ``python3``, which resolves
to the Python running this command) into ``<output-dir>/<slug>.ipynb``, in
``<output-dir>`` as working directory, with its ``results_path`` parameter
set to ``<slug>.json`` there. The command then prints the results that the
notebook wrote (:func:`format_results`: one block per notebook, each claim
as its statement, asserted or reported, its verdict at this size and in the
committed full-size run, marked stale or FAILED, the paper's number and
ours), also for a notebook whose assert cell failed (the block names the
cell, the line and the error; the notebooks write their results before
their assert cell). Nothing is printed that a user must learn to ignore:
the kernel runs at log level ERROR (:data:`KERNEL_ARGUMENTS`: no notice that
it runs over TCP), and papermill parses every line of each ``parameters``
cell (``tests/docs/test_notebooks.py``: no "Unable to parse line").
The notebook writes its results with
:func:`keras_longattn.reproductions.provenance.write_results`, which records
the run's provenance: the git commit, the hashes of the package's source
files the kernel imported, the backend, the date and the machine.

``--stale`` lists the committed full-size results (``docs/results/*.json``,
or those of ``--output-dir``) whose sources changed since they ran: a result
without provenance, or one whose recorded source files differ now (with the
first commit that changed them, where git knows the recorded one). It prints
nothing when every result is up to date, and exits with status 0 either way.
``--stale --run`` executes the notebooks of the stale results again at full
size, into the same folder, on the backend each recorded (or ``--backend``).

Examples::

    keras-longattn reproduce quickstart
    keras-longattn reproduce quickstart --full --backend torch
    keras-longattn reproduce --all --output-dir build/notebooks
    keras-longattn reproduce quickstart -p steps=50 -p dim=32
    keras-longattn reproduce --list
    keras-longattn reproduce --stale
    keras-longattn reproduce --stale --run

The same command is ``python -m keras_longattn.reproduce``. Only the standard
library is imported at module level; papermill is imported when a notebook
runs.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "DEFAULT_OUTPUT_DIR",
    "FULL_RESULTS_DIR",
    "METADATA_KEY",
    "NotebookFailed",
    "ReproductionError",
    "add_arguments",
    "add_parser",
    "default_notebooks_dir",
    "execute_notebook",
    "format_results",
    "history_entry",
    "keep_history",
    "list_notebooks",
    "main",
    "notebook_metadata",
    "notebook_parameters",
    "resolve_parameters",
    "run",
    "stale_benchmarks",
    "stale_results",
    "unregistered_files",
]

#: Where executed notebooks and their JSON results go by default.
DEFAULT_OUTPUT_DIR = "build/notebooks"
#: The committed full-size runs, relative to the checkout (``--stale``).
FULL_RESULTS_DIR = "docs/results"
#: The committed benchmark runs (``--stale`` checks them too; they are
#: re-run with the command each one records, not by ``--run``).
BENCHMARK_RESULTS_DIR = "docs/benchmarks"
#: The results file of the planted variants (``reproductions.planted``),
#: which ``--stale --run`` re-creates with that module, not with a notebook.
PLANTED_RESULTS = "planted_bugs"
#: Key of the notebook metadata this command reads.
METADATA_KEY = "keras_longattn"
#: Name of the kernel the notebooks run on.
KERNEL_NAME = "python3"
BACKENDS = ("jax", "tensorflow", "torch")
NOTEBOOKS_ENV_VAR = "KERAS_LONGATTN_NOTEBOOKS"

EPILOG = """\
examples:
  keras-longattn reproduce quickstart                  # CI size, the notebook's default backend
  keras-longattn reproduce quickstart --full           # the full size from the notebook's metadata
  keras-longattn reproduce --all --backend torch       # every notebook, on PyTorch
  keras-longattn reproduce quickstart -p steps=50      # override one parameter
  keras-longattn reproduce --list                      # the notebooks and their full sizes
  keras-longattn reproduce --stale                     # committed results whose sources changed
  keras-longattn reproduce --stale --run               # ... and re-run those at full size
"""


class ReproductionError(RuntimeError):
    """A notebook could not be found, prepared or executed."""


class NotebookFailed(ReproductionError):
    """A cell of the notebook raised (an assert cell, most often).

    Attributes:
        failure: what failed, as the report prints it: ``cell`` (the
            execution count, ``In[cell]``), ``error`` (the exception's
            class), ``message`` (its text) and ``line`` (the line of the
            cell that raised, ``""`` when the traceback does not say).
        results: the results the notebook wrote before it stopped (with
            ``"reproduce"`` added: ``info``), or ``None`` when it stopped
            before writing them.
        info: what :func:`execute_notebook` adds as ``"reproduce"`` (size,
            parameters, paths, time, ``failure``).
    """

    def __init__(self, message: str, failure: Mapping[str, Any],
                 results: dict[str, Any] | None = None,
                 info: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.failure = dict(failure)
        self.results = results
        self.info = dict(info or {}, failure=self.failure)


# ---------------------------------------------------------------------------
# Notebooks and their parameters
# ---------------------------------------------------------------------------


def _checkout_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_notebooks_dir() -> Path:
    """``$KERAS_LONGATTN_NOTEBOOKS``, else ``notebooks/`` of the source
    checkout this package is installed from, else ``./notebooks``."""
    env = os.environ.get(NOTEBOOKS_ENV_VAR)
    if env:
        return Path(env)
    checkout = _checkout_root() / "notebooks"
    if checkout.is_dir():
        return checkout
    return Path.cwd() / "notebooks"


def list_notebooks(directory: str | os.PathLike | None = None) -> list[str]:
    """Slugs (file names without ``.ipynb``) of the notebooks in
    ``directory``, sorted; names starting with ``_`` or ``.`` are skipped."""
    directory = Path(directory) if directory is not None else default_notebooks_dir()
    if not directory.is_dir():
        return []
    return sorted(
        path.stem
        for path in directory.glob("*.ipynb")
        if not path.name.startswith(("_", "."))
    )


def _read_notebook(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as stream:
            return json.load(stream)
    except FileNotFoundError:
        raise ReproductionError(f"notebook not found: {path}") from None
    except json.JSONDecodeError as error:
        raise ReproductionError(f"{path} is not a valid notebook: {error}") from None


def _source(cell: Mapping[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def notebook_metadata(notebook: Mapping[str, Any]) -> dict[str, Any]:
    """``metadata["keras_longattn"]`` of a notebook (a dict, maybe empty)."""
    return dict(notebook.get("metadata", {}).get(METADATA_KEY, {}) or {})


def notebook_parameters(notebook: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults of the notebook's ``parameters``-tagged cell.

    Every top-level ``name = <literal>`` assignment of the cell counts.

    Raises:
        ReproductionError: if there is not exactly one such cell, or a
            value is not a Python literal.
    """
    cells = [
        cell
        for cell in notebook.get("cells", [])
        if cell.get("cell_type") == "code"
        and "parameters" in cell.get("metadata", {}).get("tags", [])
    ]
    if len(cells) != 1:
        raise ReproductionError(
            f"a notebook needs exactly one cell tagged 'parameters'; found {len(cells)}"
        )
    parameters: dict[str, Any] = {}
    for node in ast.parse(_source(cells[0])).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name):
            continue
        try:
            parameters[target.id] = ast.literal_eval(value)
        except ValueError:
            raise ReproductionError(
                f"parameter {target.id!r} is not a literal: {ast.unparse(value)}"
            ) from None
    return parameters


def _parse_value(text: str) -> Any:
    """``-p name=value``: a Python literal when it parses as one, else a string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def resolve_parameters(
    notebook: Mapping[str, Any],
    *,
    full: bool = False,
    backend: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The parameters papermill injects (only those that differ from the
    notebook's own defaults are needed, but all given ones are checked).

    Order: ``full_parameters`` (with ``full``), then ``backend``, then
    ``overrides``. Every name must be a parameter of the notebook.
    """
    defaults = notebook_parameters(notebook)
    injected: dict[str, Any] = {}
    if full:
        full_parameters = notebook_metadata(notebook).get("full_parameters")
        if not full_parameters:
            raise ReproductionError(
                f"the notebook declares no metadata['{METADATA_KEY}']['full_parameters']"
            )
        injected.update(full_parameters)
    if backend is not None:
        injected["backend"] = backend
    injected.update(overrides or {})
    unknown = sorted(set(injected) - set(defaults))
    if unknown:
        raise ReproductionError(
            f"not parameters of the notebook: {', '.join(unknown)} "
            f"(its parameters: {', '.join(defaults)})"
        )
    return injected


# ---------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------


def _check_kernel() -> None:
    """The ``python3`` kernel must run this Python (jupyter_client replaces a
    bare ``python`` in the kernel's argv by ``sys.executable``)."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    except ImportError as error:  # pragma: no cover - papermill needs it
        raise ReproductionError(f"jupyter_client is not installed: {error}") from None
    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        raise ReproductionError(
            f"no Jupyter kernel named {KERNEL_NAME!r}: run "
            f"`{sys.executable} -m ipykernel install --sys-prefix --name {KERNEL_NAME}`"
        ) from None
    program = spec.argv[0] if spec.argv else ""
    bare = {"python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2]}
    if program in bare:
        return
    if os.path.realpath(program) != os.path.realpath(sys.executable):
        raise ReproductionError(
            f"the Jupyter kernel {KERNEL_NAME!r} ({spec.resource_dir}) runs {program}, "
            f"not this Python ({sys.executable}); remove that kernel spec or run "
            f"`{sys.executable} -m ipykernel install --sys-prefix --name {KERNEL_NAME}`"
        )


def execute_notebook(
    slug: str,
    *,
    full: bool = False,
    backend: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    output_dir: str | os.PathLike = DEFAULT_OUTPUT_DIR,
    notebooks_dir: str | os.PathLike | None = None,
    log_output: bool = False,
    timeout: float | None = None,
    record: bool | None = None,
) -> dict[str, Any]:
    """Executes ``notebooks/<slug>.ipynb`` into ``<output_dir>/<slug>.ipynb``.

    ``record`` (default: ``full``) starts the recording of the layers and
    models the notebook calls (:func:`kernel_arguments`), whose fingerprints
    its results then store: what keeps a committed full-size result current
    by behaviour. CI-size runs skip it (fingerprinting costs seconds).

    Returns:
        The notebook's results (the JSON it wrote), with ``"reproduce"``
        added: size, injected parameters, paths and the total wall time
        (kernel start included).

    Raises:
        NotebookFailed: when a cell raised (the message names the cell, the
            exception and the line; ``results`` holds what the notebook
            wrote before it stopped, if it wrote its results).
        ReproductionError: on a missing notebook, unknown parameters or
            missing results.
    """
    notebooks_dir = Path(notebooks_dir) if notebooks_dir is not None else default_notebooks_dir()
    source = notebooks_dir / f"{slug}.ipynb"
    if not source.is_file():
        known = ", ".join(list_notebooks(notebooks_dir)) or "none"
        raise ReproductionError(f"no notebook {source} (notebooks: {known})")
    notebook = _read_notebook(source)
    parameters = resolve_parameters(notebook, full=full, backend=backend, overrides=overrides)
    if "results_path" not in notebook_parameters(notebook):
        raise ReproductionError(f"{source} has no 'results_path' parameter")
    output_dir = Path(output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    output = output_dir / f"{slug}.ipynb"
    results_file = output_dir / f"{slug}.json"
    # Relative to the kernel's working directory, output_dir: the executed
    # copy shows no absolute path, and re-running it (nbval) in its own
    # folder writes to the same place.
    parameters["results_path"] = results_file.name
    if results_file.exists():
        results_file.unlink()

    _check_kernel()
    # The kernel inherits this environment.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    import papermill
    from papermill.exceptions import PapermillExecutionError

    engine_kwargs: dict[str, Any] = {} if timeout is None else {"execution_timeout": timeout}
    info = {
        "size": "full" if full else "ci",
        "injected_parameters": parameters,
        "source": str(source),
        "output": str(output),
        "results": str(results_file),
    }
    started = time.perf_counter()
    # For this kernel only: the notebook and its size go into its results'
    # provenance (the notebook is part of what a result depends on).
    run_env = {"KERAS_LONGATTN_NOTEBOOK": str(source.resolve()),
               "KERAS_LONGATTN_NOTEBOOK_SIZE": "full" if full else "ci"}
    saved_env = {name: os.environ.get(name) for name in run_env}
    os.environ.update(run_env)
    try:
        papermill.execute_notebook(
            str(source.resolve()),
            str(output),
            parameters=parameters,
            kernel_name=KERNEL_NAME,
            cwd=str(output_dir),
            progress_bar=False,
            log_output=log_output,
            extra_arguments=kernel_arguments(record=full if record is None else record),
            kernel_manager_class=_kernel_manager_class(),
            **engine_kwargs,
        )
    except PapermillExecutionError as error:
        failure = _failure(error)
        info["total_wall_time_s"] = round(time.perf_counter() - started, 1)
        info["failure"] = failure
        # The notebooks write their results before their assert cell, so a
        # failed assert still leaves this run's results (the file of an
        # earlier run was removed above).
        results = _read_results(results_file)
        if results is not None:
            results["reproduce"] = info
        where = f" at `{failure['line']}`" if failure["line"] else ""
        raise NotebookFailed(
            f"{slug}: cell In[{failure['cell']}] raised {failure['error']}{where}: "
            f"{failure['message']} (the executed notebook is {output})",
            failure, results, info,
        ) from None
    finally:
        _restore_env(saved_env)
    info["total_wall_time_s"] = round(time.perf_counter() - started, 1)
    results = _read_results(results_file)
    if results is None:
        raise ReproductionError(f"{slug}: the notebook ran but wrote no results "
                                f"(a JSON object) to {results_file}")
    results["reproduce"] = info
    return results


def _restore_env(saved: Mapping[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


#: Arguments of the kernel papermill starts. Its log level is ERROR: at
#: WARNING, ipykernel warns on every start that it runs over TCP without
#: encryption, which is how jupyter_client always starts a local kernel (on
#: 127.0.0.1, every message signed with the key of a connection file only
#: this user can read); a notice printed on every run that nobody can act on.
KERNEL_ARGUMENTS = ("--IPKernelApp.log_level=ERROR",)


def kernel_arguments(record: bool = True) -> list[str]:
    """:data:`KERNEL_ARGUMENTS`, and with ``record`` a line the kernel runs
    before the first cell: it starts
    :mod:`keras_longattn.reproductions.recording` (loaded by path, so the
    notebook still picks the Keras backend), which records the layers and
    models the notebook builds for its results' behaviour fingerprints."""
    if not record:
        return list(KERNEL_ARGUMENTS)
    recorder = Path(__file__).resolve().parent / "reproductions" / "recording.py"
    spec_line = (
        "import importlib.util as _u, sys as _s; "
        f"_p = _u.spec_from_file_location('keras_longattn.reproductions.recording', {str(recorder)!r}); "
        "_m = _u.module_from_spec(_p); _s.modules[_p.name] = _m; "
        "_p.loader.exec_module(_m); _m.start(); del _u, _s, _p, _m")
    return [*KERNEL_ARGUMENTS, f"--IPKernelApp.exec_lines={json.dumps([spec_line])}"]

def _kernel_manager_class():
    """jupyter_client's ``AsyncKernelManager`` without the interrupt it
    sends before a shutdown request: the notebook's kernel is idle by then
    (a cell that timed out was interrupted already), and a SIGINT that
    meets an idle kernel makes it log "KeyboardInterrupt caught in kernel"
    on the terminal now and then."""
    from jupyter_client import AsyncKernelManager

    class QuietShutdownKernelManager(AsyncKernelManager):
        async def _async_interrupt_kernel(self):
            if not self.shutting_down:
                await super()._async_interrupt_kernel()

    return QuietShutdownKernelManager


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_LINE = re.compile(r"Cell In\[\d+\], line (\d+)")


def _read_results(path: Path) -> dict[str, Any] | None:
    """The results a notebook wrote (``None``: none, or not a JSON object)."""
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as stream:
            results = json.load(stream)
    except json.JSONDecodeError:
        return None
    return results if isinstance(results, dict) else None


def _failure(error: Any) -> dict[str, Any]:
    """What a :class:`papermill.exceptions.PapermillExecutionError` says
    failed: the cell, the exception, its message and the cell's line that
    raised (from the traceback's ``Cell In[n], line l``)."""
    line = ""
    traceback = _ANSI.sub("", "\n".join(getattr(error, "traceback", None) or []))
    match = _CELL_LINE.search(traceback)
    source = str(getattr(error, "source", "") or "").splitlines()
    if match and 0 < int(match.group(1)) <= len(source):
        line = source[int(match.group(1)) - 1].strip()
    return {
        "cell": getattr(error, "exec_count", None),
        "error": str(getattr(error, "ename", "") or "an error"),
        "message": str(getattr(error, "evalue", "") or "").strip(),
        "line": line,
    }


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


#: The report's width when the terminal does not say (a pipe, a CI log).
REPORT_WIDTH = 100
LEGEND = (
    "Each claim: asserted (the notebook's assert cell checks it; a failure stops the "
    "notebook) or reported (measured and shown, never asserted); the paper's number; ours at "
    "this run's size; the verdict here and in the committed full-size run (docs/results/), "
    "marked stale when its sources changed since and FAILED when an asserted claim did not "
    "hold there."
)


def _report_width() -> int:
    return max(72, min(110, shutil.get_terminal_size((REPORT_WIDTH, 24)).columns))


def _wrap(text: Any, indent: str, width: int, first: str | None = None) -> list[str]:
    """``text`` wrapped to ``width``, ``first`` (default ``indent``) before
    its first line; line breaks of ``text`` are kept."""
    first = indent if first is None else first
    lines: list[str] = []
    for paragraph in str(text).splitlines() or [""]:
        lines += textwrap.wrap(" ".join(paragraph.split()), width=width,
                               initial_indent=first if not lines else indent,
                               subsequent_indent=indent, break_long_words=False,
                               break_on_hyphens=False) or [first if not lines else indent]
    return [line.rstrip() for line in lines]


def _shown(claim: Mapping[str, Any]) -> str:
    """The words :func:`claims.shown_verdict` gives a claim of a results
    file (its stored verdict when that is not one it knows)."""
    from keras_longattn.reproductions import claims

    verdict = str(claim.get("verdict", "?"))
    try:
        return claims.shown_verdict(verdict, bool(claim.get("asserted")),
                                    str(claim.get("detail") or ""), str(claim.get("ours") or ""))
    except ValueError:
        return verdict


def _claim_failed(claim: Mapping[str, Any]) -> bool:
    """An asserted claim that did not come out reproduced
    (:attr:`claims.Claim.failed`)."""
    return bool(claim.get("asserted")) and claim.get("verdict") != "reproduced"


def _display_path(path: Path) -> str:
    """``path`` relative to the checkout when it is inside it."""
    try:
        return str(path.resolve().relative_to(_checkout_root()))
    except ValueError:
        return str(path)


def _stale_text(check: Any) -> str:
    """``"stale: ..."`` in one short line, or ``""`` when up to date."""
    if not getattr(check, "stale", False):
        return ""
    changed = tuple(getattr(check, "changed", ()) or ())
    if not changed:
        return f"stale: {getattr(check, 'reason', 'see keras-longattn reproduce --stale')}"
    since = getattr(check, "since", None)
    commit = getattr(check, "commit", None)
    when = (f"since {since}" if since else
            f"after its commit {commit[:10]}" if commit else "after the run")
    files = changed[0] if len(changed) == 1 else f"{len(changed)} files"
    return (f"stale: its sources changed {when} ({files}; "
            f"`keras-longattn reproduce --stale` lists them)")


def _full_size_record(slug: str, full_results_dir: Path | None) -> tuple[dict, str, bool]:
    """The committed full-size results of ``slug`` (or ``{}``), a line
    saying where they are, when they ran, whether they are stale and which
    asserted claims failed in them, and whether they are stale."""
    if full_results_dir is None:
        return {}, "", False
    path = Path(full_results_dir) / f"{slug}.json"
    shown = _display_path(path)
    if not path.is_file():
        return {}, f"full size: none committed ({shown})", False
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as error:
        return {}, f"full size: {shown} is unreadable ({error})", False
    from keras_longattn.reproductions import provenance

    try:
        check = provenance.check_results(path, root=_checkout_root())
    except ValueError as error:  # pragma: no cover - read above
        return record, f"full size: {shown} ({error})", True
    recorded = record.get("provenance") or {}
    ran = ", ".join(part for part in (
        str(recorded.get("date") or "")[:10],
        f"commit {str(recorded['commit'])[:7]}" if recorded.get("commit") else "",
    ) if part)
    parts = [f"full size: {shown}" + (f" (ran {ran})" if ran else "")]
    stale = _stale_text(check)
    parts.append(stale or "up to date with the sources")
    failed = [str(c.get("name", "?")) for c in record.get("claims") or [] if _claim_failed(c)]
    if failed:
        parts.append(f"FAILED its assert cell: {', '.join(failed)}")
    return record, "; ".join(parts), bool(stale)


def _size_words(size: str) -> str:
    return {"ci": "CI size", "full": "full size"}.get(size, f"{size} size")


def _title(info: Mapping[str, Any]) -> str:
    """The notebook's title (its metadata), ``""`` when unknown."""
    source = info.get("source")
    if not source:
        return ""
    try:
        return str(notebook_metadata(_read_notebook(Path(source))).get("title", "") or "")
    except ReproductionError:
        return ""


def _failure_lines(failure: Mapping[str, Any], has_results: bool, width: int) -> list[str]:
    where = f" at `{failure['line']}`" if failure.get("line") else ""
    lines = _wrap(f"FAILED: cell In[{failure.get('cell', '?')}] raised "
                  f"{failure.get('error', 'an error')}{where}"
                  + (":" if failure.get("message") else ""), "    ", width, "  ")
    if failure.get("message"):
        lines += _wrap(failure["message"], "      ", width, "    ")
    lines += _wrap(
        "The claims below are what the notebook wrote before it stopped." if has_results
        else "The notebook stopped before it wrote its results: no claims to show.",
        "    ", width, "  ")
    return lines


def _claim_lines(number: int, claim: Mapping[str, Any] | None, full: Mapping[str, Any] | None,
                 *, size: str, full_state: str, stale: bool, width: int) -> list[str]:
    """One claim: the statement, asserted or reported, the verdicts here and
    at full size, the paper's number and ours. ``claim`` is ``None`` for a
    claim of the full-size run that this run does not make; ``full_state``
    is ``"compare"`` (look at ``full``) or ``""`` (none committed, this run
    is the committed one, or not asked: the block's header says which)."""
    main = claim if claim is not None else full or {}
    asserted = bool(main.get("asserted"))
    kind = "asserted" if asserted else "reported"
    label = f"{number:>3}. "
    indent = " " * len(label)
    lines = _wrap(f"[{kind}] {main.get('statement') or main.get('name', '?')}",
                  indent, width, label)
    here_label = f"here ({_size_words(size)})"
    if claim is None:
        here = f"{here_label}: not run at this size"
    else:
        here = f"{here_label}: {_shown(claim)}"
        if _claim_failed(claim):
            here += ", FAILED"
    if full_state == "compare":
        if full is None:
            there = "full size: not in the committed run"
        else:
            there = f"full size: {_shown(full)}"
            marks = []
            if _claim_failed(full):
                marks.append("FAILED")
            if stale:
                marks.append("stale")
            if claim is not None and bool(full.get("asserted")) != asserted:
                marks.append("asserted there" if full.get("asserted") else "reported there")
            if marks:
                there += f" [{', '.join(marks)}]"
    else:
        there = ""
    lines += _wrap(f"{here}  |  {there}" if there else here, indent + "  ", width, indent)
    lines += _wrap(main.get("paper") or "—", indent + " " * 7, width, indent + "paper: ")
    if claim is not None:
        lines += _wrap(claim.get("ours") or "—", indent + " " * 7, width, indent + "ours:  ")
    if full is not None and full_state == "compare" and (claim is None or _claim_failed(full)):
        # the number behind a full-size failure (or a full-size-only claim)
        lines += _wrap(full.get("ours") or "—", indent + " " * 7, width,
                       indent + "ours at full size: ")
    return lines


def format_results(results_by_slug: Mapping[str, Mapping[str, Any]],
                   full_results_dir: str | os.PathLike | None = None,
                   width: int | None = None) -> str:
    """The main job's report: one block per notebook.

    A block names the notebook, this run (size, backend, time; or which
    cell failed and what it raised), and the committed full-size run of
    ``full_results_dir`` (where it is, when it ran, stale or up to date,
    which of its asserted claims failed). Then each claim, its statement
    wrapped to ``width``: asserted or reported, the verdict at this run's
    size and at full size in :func:`claims.shown_verdict`'s words (FAILED
    after an asserted claim that did not hold, stale after a full-size one
    whose sources changed since), the paper's number and ours in full. The
    claims of the full-size run that this run does not make follow. Then
    the run's metrics and where its files are.

    A results dict whose ``"reproduce"`` holds ``"failure"`` is a notebook
    that stopped (:class:`NotebookFailed`); its claims are the ones it wrote
    before stopping, if it wrote them.
    """
    width = width or _report_width()
    full_dir = None if full_results_dir is None else Path(full_results_dir)
    blocks = []
    for slug, results in results_by_slug.items():
        info = results.get("reproduce", {}) or {}
        size = str(info.get("size", "?"))
        failure = info.get("failure")
        title = _title(info)
        lines = _wrap(f"{slug}: {title}" if title else slug, "    ", width, "== ")
        run = [f"this run: {_size_words(size)}", f"backend {results.get('backend', '?')}"]
        if results.get("wall_time_s") is not None:
            run.append(f"notebook {_fmt(results['wall_time_s'])} s")
        if info.get("total_wall_time_s") is not None:
            run.append(f"total {_fmt(info['total_wall_time_s'])} s")
        lines += _wrap(", ".join(run), "    ", width, "  ")
        has_results = "claims" in results or "metrics" in results
        if failure:
            lines += _failure_lines(failure, has_results, width)
        committed = None if full_dir is None else full_dir / f"{slug}.json"
        if (committed is not None and info.get("results")
                and Path(info["results"]).resolve() == committed.resolve()):
            full, stale, full_state = {}, False, ""
            where = "full size: this run is the committed one"
        else:
            full, where, stale = _full_size_record(slug, full_dir)
            full_state = "compare" if full else ""
        if where:
            lines += _wrap(where, "    ", width, "  ")
        claims = [c for c in results.get("claims") or [] if isinstance(c, Mapping)]
        full_claims = {c.get("name"): c for c in full.get("claims") or [] if isinstance(c, Mapping)}
        if claims:
            asserted = sum(bool(c.get("asserted")) for c in claims)
            failed = [str(c.get("name", "?")) for c in claims if _claim_failed(c)]
            lines.append(f"  claims: {asserted} asserted, {len(claims) - asserted} reported"
                         + (f"; FAILED here: {', '.join(failed)}" if failed else ""))
            for number, claim in enumerate(claims, 1):
                lines += _claim_lines(number, claim, full_claims.get(claim.get("name")),
                                      size=size, full_state=full_state, stale=stale, width=width)
        elif has_results:
            lines.append("  (this notebook states no claims)")
        names = {c.get("name") for c in claims}
        only_full = [c for name, c in full_claims.items() if name not in names]
        if only_full and has_results:
            lines.append(f"  claims of the full-size run only ({len(only_full)}):")
            for number, claim in enumerate(only_full, len(claims) + 1):
                lines += _claim_lines(number, None, claim, size=size, full_state=full_state,
                                      stale=stale, width=width)
        metrics = [f"{name}={_fmt(value)}"
                   for name, value in (results.get("metrics") or {}).items()]
        if metrics:
            lines += _wrap(", ".join(metrics), "    ", width, "  metrics: ")
        if info.get("output"):
            lines += _wrap(f"executed notebook: {_display_path(Path(info['output']))}"
                           + (f"; results: {_display_path(Path(info['results']))}"
                              if info.get("results") and has_results else ""),
                           "    ", width, "  ")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _format_listing(notebooks_dir: Path) -> str:
    lines = []
    for slug in list_notebooks(notebooks_dir):
        notebook = _read_notebook(notebooks_dir / f"{slug}.ipynb")
        meta = notebook_metadata(notebook)
        title = meta.get("title", "")
        lines.append(f"{slug}: {title}")
        try:
            defaults = notebook_parameters(notebook)
        except ReproductionError as error:
            lines.append(f"    (invalid: {error})")
            continue
        full = meta.get("full_parameters") or {}
        changed = ", ".join(
            f"{name}={defaults.get(name)!r}->{value!r}"
            for name, value in full.items()
            if defaults.get(name) != value
        )
        lines.append(f"    CI size: ~{meta.get('ci_minutes', '?')} min; "
                     f"--full: ~{meta.get('full_minutes', '?')} min ({changed or 'no changes'})")
    return "\n".join(lines) or f"no notebooks in {notebooks_dir}"


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _parameter(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), _parse_value(value)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the arguments of ``reproduce`` to ``parser``."""
    parser.add_argument("slugs", nargs="*", metavar="SLUG",
                        help="notebook names (notebooks/<SLUG>.ipynb)")
    parser.add_argument("--all", action="store_true", help="every notebook of notebooks/")
    parser.add_argument("--full", action="store_true",
                        help="the full size declared in the notebook's metadata "
                             "(default: the CI size, the notebook's own defaults)")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="Keras backend (default: the notebook's default)")
    parser.add_argument("--output-dir", default=None,
                        help=f"where executed notebooks and results go (default: "
                             f"{DEFAULT_OUTPUT_DIR}; with --stale: {FULL_RESULTS_DIR} of the "
                             f"checkout, whose results are checked and re-run in place)")
    parser.add_argument("--notebooks-dir", default=None,
                        help="where the notebooks are (default: notebooks/ of the checkout)")
    parser.add_argument("--refresh", action="store_true",
                        help="with --stale: note in each result that is current by behaviour "
                             "(library files changed, fingerprints agree) the files as they are "
                             "now, so later checks fingerprint only what changes after")
    parser.add_argument("--record", action="store_true",
                        help="record the layers and models the notebook calls at CI size too "
                             "(full-size runs always do: their results store the fingerprints)")
    parser.add_argument("--unregistered", action="store_true",
                        help="with --full: run although the notebook or its paper module "
                             "differs from the last commit (the result then records that its "
                             "checks were not pre-registered)")
    parser.add_argument("-p", "--parameter", dest="parameters", action="append", default=[],
                        type=_parameter, metavar="NAME=VALUE",
                        help="override one parameter (a Python literal or a string); repeatable")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds allowed to each cell (default: no limit)")
    parser.add_argument("--log-output", action="store_true",
                        help="stream the notebook's outputs while it runs")
    parser.add_argument("--list", action="store_true", help="list the notebooks and exit")
    parser.add_argument("--stale", action="store_true",
                        help=f"list the results of {FULL_RESULTS_DIR} (or --output-dir) whose "
                             "sources changed since they ran, or that record no provenance "
                             "(SLUGs: only those); exit status 0 either way")
    parser.add_argument("--run", action="store_true",
                        help="with --stale: execute the stale ones again at full size, into "
                             "the same folder, on the backend each recorded (or --backend)")
    return parser


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``reproduce`` subcommand to the ``keras-longattn`` parser.

    Sets the defaults ``handler`` (``(args, parser) -> int``) and
    ``command_parser``, as every subcommand of :mod:`keras_longattn.cli`.
    """
    parser = subparsers.add_parser(
        "reproduce",
        help="execute the reproduction notebooks (papermill) and print their results",
        description="Execute notebooks/<slug>.ipynb with papermill at CI size or, "
                    "with --full, at the full size its metadata declares, then print "
                    "the results the notebook wrote.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(handler=lambda args, _parser=None: run(args), command_parser=parser)
    return parser


def stale_results(directory: str | os.PathLike | None = None) -> list:
    """The provenance check of every results JSON of ``directory`` (default:
    ``docs/results`` of the checkout), as
    :class:`keras_longattn.reproductions.provenance.Staleness` records (up
    to date ones included), by name."""
    from keras_longattn.reproductions import provenance

    directory = Path(directory) if directory is not None else _checkout_root() / FULL_RESULTS_DIR
    return provenance.check_directory(directory, root=_checkout_root())


#: Other committed measurements the docs pages show (checked like benchmarks).
MEASUREMENT_DIRS = (BENCHMARK_RESULTS_DIR, "docs/parallel")


def stale_benchmarks() -> list:
    """:func:`stale_results` of ``docs/benchmarks`` and ``docs/parallel``
    (their top-level JSON files: the measurements the docs pages show)."""
    return [check for directory in MEASUREMENT_DIRS
            for check in stale_results(_checkout_root() / directory)]


def _recorded_backend(path: Path) -> str | None:
    """The backend a results file says its run used (``None`` if unknown)."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(results, dict):
        return None
    backend = results.get("backend") or (results.get("provenance") or {}).get("backend")
    return backend if backend in BACKENDS else None


def _execute_all(plan: Sequence[tuple[str, str | None]], args: argparse.Namespace, *,
                 full: bool, output_dir: str | os.PathLike, notebooks_dir: Path,
                 overrides: Mapping[str, Any]) -> int:
    """Executes each ``(slug, backend)`` of ``plan``, prints the report of
    every notebook that wrote results (:func:`format_results`; one that
    failed an assert cell too); returns 1 when one failed, else 0."""
    done: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    if full and not getattr(args, "unregistered", False):
        unregistered = {slug: files for slug, _ in plan
                        if (files := unregistered_files(slug, notebooks_dir))}
        if unregistered:
            for slug, files in unregistered.items():
                print(f"[reproduce] {slug}: a full-size run's checks (thresholds, margins, steps, "
                      f"seeds) must be fixed in a commit before it runs; commit "
                      f"{', '.join(files)} first (or pass --unregistered)",
                      file=sys.stderr, flush=True)
            return 2
    for slug, backend in plan:
        previous = _read_results(Path(output_dir) / f"{slug}.json") if full else None
        size = "full size" if full else "CI size"
        print(f"[reproduce] {slug}: {size}, backend {backend or 'default'} -> "
              f"{Path(output_dir) / (slug + '.ipynb')}", flush=True)
        try:
            done[slug] = execute_notebook(
                slug,
                full=full,
                backend=backend,
                overrides=overrides,
                output_dir=output_dir,
                notebooks_dir=notebooks_dir,
                log_output=args.log_output,
                timeout=args.timeout,
                record=True if getattr(args, "record", False) else None,
            )
        except NotebookFailed as error:
            print(f"[reproduce] FAILED {error}", file=sys.stderr, flush=True)
            failed.append(slug)
            done[slug] = (error.results if error.results is not None
                          else {"reproduce": error.info, "backend": backend or "default"})
            if full and error.results is not None:
                keep_history(Path(output_dir) / f"{slug}.json", previous)
            continue
        except ReproductionError as error:
            print(f"[reproduce] FAILED {error}", file=sys.stderr, flush=True)
            failed.append(slug)
            continue
        if full:
            keep_history(Path(output_dir) / f"{slug}.json", previous)
        print(f"[reproduce] {slug}: done in {done[slug]['reproduce']['total_wall_time_s']} s",
              flush=True)
    if done:
        width = _report_width()
        print()
        print("\n".join(_wrap(LEGEND, "", width)))
        print()
        print(format_results(done, full_results_dir=_checkout_root() / FULL_RESULTS_DIR,
                             width=width))
        print(f"\n[reproduce] {len(plan) - len(failed)} of {len(plan)} notebook(s) passed",
              flush=True)
    if failed:
        print(f"\n[reproduce] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def unregistered_files(slug: str, notebooks_dir: str | os.PathLike | None = None) -> list[str]:
    """The files that fix a full-size run's checks (the notebook, and its
    paper module ``keras_longattn/reproductions/<slug>.py``) whose content
    differs from the last commit (``[]`` outside a git checkout)."""
    root = _checkout_root()
    notebooks_dir = Path(notebooks_dir) if notebooks_dir is not None else default_notebooks_dir()
    candidates = [notebooks_dir / f"{slug}.ipynb",
                  root / "keras_longattn" / "reproductions" / f"{slug}.py"]
    files = []
    for path in candidates:
        if not path.is_file():
            continue
        try:
            relative = path.resolve().relative_to(root).as_posix()
        except ValueError:
            continue
        try:
            result = subprocess.run(["git", "status", "--porcelain", "--", relative], cwd=root,
                                    capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return []
        if result.returncode != 0:
            return []
        if result.stdout.strip():
            files.append(relative)
    return files


#: Parameters of a run that are set-up, not checks (left out of its history).
_NOT_CHECKS = ("backend", "results_path")


def history_entry(results: Mapping[str, Any]) -> dict[str, Any]:
    """What a results file's ``history`` keeps of a run: when and on what it
    ran, its parameters (thresholds, margins, steps, seeds), each claim's
    verdict and measurement, and the asserted claims that failed."""
    record = results.get("provenance") or {}
    claims = [c for c in results.get("claims") or [] if isinstance(c, Mapping)]
    return {
        "commit": record.get("commit"),
        "date": record.get("date"),
        "notebook_sha256": (record.get("notebook") or {}).get("sha256"),
        "parameters": {k: v for k, v in (results.get("parameters") or {}).items()
                       if k not in _NOT_CHECKS},
        "claims": [{"name": c.get("name"), "verdict": c.get("verdict"),
                    "asserted": c.get("asserted"), "ours": c.get("ours")} for c in claims],
        "failed": [c.get("name") for c in claims
                   if c.get("asserted") and c.get("verdict") != "reproduced"],
    }


def keep_history(path: Path, previous: Mapping[str, Any] | None) -> None:
    """Adds the run ``previous`` (the results the new run at ``path``
    replaced) and its own history to the new results' ``history``, so that
    a page keeps every earlier threshold with the result under it."""
    if previous is None or not path.is_file():
        return
    results = _read_results(path)
    if results is None:
        return
    history = [entry for entry in previous.get("history") or [] if isinstance(entry, Mapping)]
    history.append(history_entry(previous))
    results["history"] = history
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def _strip_suffix(slug: str) -> str:
    return slug[:-len(".ipynb")] if slug.endswith(".ipynb") else slug


def _run_stale(args: argparse.Namespace, notebooks_dir: Path) -> int:
    """``--stale`` (and ``--stale --run``)."""
    if args.parameters:
        print("reproduce: --stale re-runs at the full size of each notebook; "
              "-p does not apply to it", file=sys.stderr)
        return 2
    directory = (Path(args.output_dir) if args.output_dir is not None
                 else _checkout_root() / FULL_RESULTS_DIR)
    if not directory.is_dir():
        print(f"reproduce: no results folder {directory}: nothing to check", file=sys.stderr)
        return 0
    try:
        checks = stale_results(directory)
    except ValueError as error:
        print(f"reproduce: {error}", file=sys.stderr)
        return 1
    benchmarks = []
    if args.output_dir is None:
        try:
            benchmarks = stale_benchmarks()
        except ValueError as error:
            print(f"reproduce: {error}", file=sys.stderr)
            return 1
    if args.slugs:
        wanted = {_strip_suffix(slug) for slug in args.slugs}
        checks = [check for check in checks if check.name in wanted]
        benchmarks = [check for check in benchmarks if check.name in wanted]
    stale = [check for check in checks if check.stale]
    stale_bench = [check for check in benchmarks if check.stale]
    if stale or stale_bench:
        from keras_longattn.reproductions.provenance import format_stale

        if stale:
            print(format_stale(stale), flush=True)
        for check in stale_bench:
            command = (_read_results(check.path) or {}).get("command")
            folder = check.path.parent.relative_to(_checkout_root()).as_posix()
            print(f"{folder}/{check.describe()}"
                  + (f"; re-run: {command}" if isinstance(command, str) else ""), flush=True)
    if getattr(args, "refresh", False):
        from keras_longattn.reproductions.provenance import record_verified

        for check in [*checks, *benchmarks]:
            if not check.stale and check.behaviour_files and record_verified(check.path,
                                                                            _checkout_root()):
                print(f"[reproduce] {check.name}: current by behaviour; the files of today "
                      f"noted as verified", file=sys.stderr, flush=True)
    if not args.run or not stale:
        return 0
    plan = [(check.name, args.backend or _recorded_backend(check.path)) for check in stale
            if check.name != PLANTED_RESULTS]
    status = 0
    if plan:
        print(f"[reproduce] re-running {len(plan)} stale result(s) at full size into {directory}",
              flush=True)
        status = _execute_all(plan, args, full=True, output_dir=directory,
                              notebooks_dir=notebooks_dir, overrides={})
    if any(check.name == PLANTED_RESULTS for check in stale):
        status = max(status, _run_planted(directory / f"{PLANTED_RESULTS}.json"))
    return status


def _run_planted(path: Path) -> int:
    """Re-runs every planted variant of the reproductions (on JAX, in a
    fresh process) into ``path``; returns 1 when one was not caught."""
    command = [sys.executable, "-m", "keras_longattn.reproductions.planted", "--write", str(path)]
    print(f"[reproduce] planted variants -> {path}", flush=True)
    env = dict(os.environ, KERAS_BACKEND="jax")
    return 0 if subprocess.run(command, env=env, check=False).returncode == 0 else 1


def run(args: argparse.Namespace) -> int:
    """Runs ``reproduce`` with parsed arguments; returns the exit status."""
    notebooks_dir = Path(args.notebooks_dir) if args.notebooks_dir else default_notebooks_dir()
    if args.list:
        print(_format_listing(notebooks_dir))
        return 0
    if args.run and not args.stale:
        print("reproduce: --run goes with --stale (re-run the stale results)", file=sys.stderr)
        return 2
    if args.stale:
        return _run_stale(args, notebooks_dir)
    available = list_notebooks(notebooks_dir)
    if args.all:
        slugs = available
        if not slugs:
            print(f"reproduce: no notebooks in {notebooks_dir}", file=sys.stderr)
            return 2
    else:
        slugs = list(args.slugs)
    if not slugs:
        print(f"reproduce: name a notebook or give --all (notebooks: {', '.join(available) or 'none'})",
              file=sys.stderr)
        return 2
    output_dir = args.output_dir if args.output_dir is not None else DEFAULT_OUTPUT_DIR
    plan = [(_strip_suffix(slug), args.backend) for slug in slugs]
    return _execute_all(plan, args, full=args.full, output_dir=output_dir,
                        notebooks_dir=notebooks_dir, overrides=dict(args.parameters))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m keras_longattn.reproduce``."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_longattn.reproduce",
        description="Execute the reproduction notebooks with papermill.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
