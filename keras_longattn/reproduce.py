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
notebook wrote. The notebook writes them with
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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "DEFAULT_OUTPUT_DIR",
    "FULL_RESULTS_DIR",
    "METADATA_KEY",
    "ReproductionError",
    "add_arguments",
    "add_parser",
    "default_notebooks_dir",
    "execute_notebook",
    "format_results",
    "list_notebooks",
    "main",
    "notebook_metadata",
    "notebook_parameters",
    "resolve_parameters",
    "run",
    "stale_results",
]

#: Where executed notebooks and their JSON results go by default.
DEFAULT_OUTPUT_DIR = "build/notebooks"
#: The committed full-size runs, relative to the checkout (``--stale``).
FULL_RESULTS_DIR = "docs/results"
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
) -> dict[str, Any]:
    """Executes ``notebooks/<slug>.ipynb`` into ``<output_dir>/<slug>.ipynb``.

    Returns:
        The notebook's results (the JSON it wrote), with ``"reproduce"``
        added: size, injected parameters, paths and the total wall time
        (kernel start included).

    Raises:
        ReproductionError: on a missing notebook, unknown parameters, a
            failing cell (the message names it) or missing results.
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

    engine_kwargs = {} if timeout is None else {"execution_timeout": timeout}
    started = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(source.resolve()),
            str(output),
            parameters=parameters,
            kernel_name=KERNEL_NAME,
            cwd=str(output_dir),
            progress_bar=False,
            log_output=log_output,
            **engine_kwargs,
        )
    except PapermillExecutionError as error:
        raise ReproductionError(
            f"{slug}: cell {error.exec_count} raised {error.ename}: {error.evalue} "
            f"(the executed notebook is {output})"
        ) from None
    wall = time.perf_counter() - started
    if not results_file.is_file():
        raise ReproductionError(f"{slug}: the notebook ran but wrote no {results_file}")
    with open(results_file, encoding="utf-8") as stream:
        results = json.load(stream)
    results["reproduce"] = {
        "size": "full" if full else "ci",
        "injected_parameters": parameters,
        "source": str(source),
        "output": str(output),
        "results": str(results_file),
        "total_wall_time_s": round(wall, 1),
    }
    return results


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


def _clip(text: Any, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    line = lambda cells: indent + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)).rstrip()
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _full_size_record(slug: str, full_results_dir: Path | None) -> tuple[dict, str]:
    """The committed full-size results of ``slug`` (or ``{}``) and a line
    saying where they are and whether they are stale."""
    if full_results_dir is None:
        return {}, ""
    path = Path(full_results_dir) / f"{slug}.json"
    if not path.is_file():
        return {}, f"full-size result: none committed ({path})"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return {}, f"full-size result: {path} unreadable ({error})"
    from keras_longattn.reproductions import provenance

    check = provenance.check_results(path, root=_checkout_root())
    state = check.note() or "up to date with the sources"
    return record, f"full-size result: {path} ({state})"


def format_results(results_by_slug: Mapping[str, Mapping[str, Any]],
                   full_results_dir: str | os.PathLike | None = None) -> str:
    """Per notebook: each claim with the paper's number, this run's
    (mean ± spread over the seeds, as the notebook states it), the verdict
    at this run's size and at full size (from ``full_results_dir``, the
    committed runs, when given), where the full-size result is and whether
    it is stale; then the run's metrics and facts."""
    blocks = []
    full_dir = None if full_results_dir is None else Path(full_results_dir)
    for slug, results in results_by_slug.items():
        info = results.get("reproduce", {})
        size = str(info.get("size", "?"))
        lines = [f"{slug}: {size} size, backend {results.get('backend', '?')}, "
                 f"notebook {_fmt(results.get('wall_time_s'))} s "
                 f"(total {_fmt(info.get('total_wall_time_s'))} s)"]
        full, where = _full_size_record(slug, full_dir)
        full_verdicts = {c.get("name"): c.get("verdict") for c in full.get("claims") or []}
        claims = results.get("claims") or []
        if claims:
            rows = []
            for claim in claims:
                mark = "" if claim.get("asserted") else " (reported)"
                rows.append([
                    _clip(claim.get("name", "?"), 36),
                    f"{claim.get('verdict', '?')}{mark}",
                    str(full_verdicts.get(claim.get("name"), "-")) if full else "-",
                    _clip(claim.get("paper", ""), 40),
                    _clip(claim.get("ours", ""), 120),
                ])
            lines += _table(["claim", "verdict here", "full size", "paper",
                             f"ours ({size} size)"], rows)
        else:
            lines.append("  (this notebook states no claims)")
        if where:
            lines.append(where)
        metrics = [(name, _fmt(value)) for name, value in (results.get("metrics") or {}).items()]
        if metrics:
            lines.append("metrics:")
            lines += _table(["metric", "value"], [[n, v] for n, v in metrics])
        if info.get("output"):
            lines.append(f"executed notebook: {info['output']}")
        if info.get("results"):
            lines.append(f"results: {info['results']}")
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
    """Executes each ``(slug, backend)`` of ``plan``, prints the results;
    returns 1 when one failed, else 0."""
    done: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    for slug, backend in plan:
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
            )
        except ReproductionError as error:
            print(f"[reproduce] FAILED {error}", file=sys.stderr, flush=True)
            failed.append(slug)
            continue
        print(f"[reproduce] {slug}: done in {done[slug]['reproduce']['total_wall_time_s']} s",
              flush=True)
    if done:
        print()
        print(format_results(done, full_results_dir=_checkout_root() / FULL_RESULTS_DIR))
    if failed:
        print(f"\n[reproduce] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


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
    if args.slugs:
        wanted = {_strip_suffix(slug) for slug in args.slugs}
        checks = [check for check in checks if check.name in wanted]
    stale = [check for check in checks if check.stale]
    if stale:
        from keras_longattn.reproductions.provenance import format_stale

        print(format_stale(stale), flush=True)
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
