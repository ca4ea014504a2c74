"""Provenance of a reproduction's results, and whether they are stale.

A paper notebook writes its results JSON with :func:`write_results`, which
adds a ``"provenance"`` record (see :func:`collect`): what the process that
ran the notebook (the notebook's kernel) ran on, as
:func:`keras_longattn.provenance.collect` records it (commit, the sha256 of
every package source file it imported, backend, date and machine), and,
for a run of ``keras-longattn reproduce``, the notebook and the behaviour
record described below.

:func:`check_results` compares a results file's recorded hashes with the
files as they are now: a results file without provenance is stale ("no
provenance recorded"), and so is one whose recorded files changed (or were
removed); where git knows the recorded commit, ``since`` is the first later
commit that touched one of the changed files. ``keras-longattn reproduce
--stale`` lists the stale results of ``docs/results/`` and the docs' paper
pages show the same :meth:`Staleness.note`.

**Current by behaviour.** A run that recorded what it built
(``keras-longattn reproduce`` starts :mod:`.recording` in the kernel) also
stores, under ``"behaviour"``, its *subjects* (every layer and model of the
package the run called: config and call arguments) and their fingerprints
(:mod:`.behaviour`: outputs, gradients and state on fixed seeded inputs and
weights, and the path that ran), and, under ``"notebook"``, the notebook's
file and hash. Such a result then depends on

* **by bytes**, the *harness* (:func:`is_harness`): the notebook (what it
  runs: :func:`notebook_code_sha256`, its parameters at the run's size and
  its code without comments; not its prose), and
  the recorded files of ``reproductions/`` (the paper modules), the data
  (``datasets/``, ``lra/``), ``benchmarks/``, the keras-hub converter
  (``hub/``, whose weight copying no config shows, and for a run that
  imported it ``models/generation.py``, the sampling); the modules that only record, show or judge
  (:data:`PRESENTATION`: this one, the recorder, the fingerprints, the pages,
  the claim checks, whose stored fields the pages re-derive their words
  from, and the planted variants, except for the planted run) count for
  nothing;
* **by behaviour**, every other recorded file (layers, ops, kernels, models,
  specs, parallel): when one of them changed by bytes, the subjects are
  fingerprinted again on the recorded backend (:func:`fingerprint_subjects`,
  a subprocess, cached under ``build/fingerprints/``) and the result stays
  current when every fingerprint agrees (:func:`behaviour.compare`).

A result without a behaviour record (or whose fingerprints could not all be
computed when it ran) is checked by bytes alone, as before.

**Bytes that are not code.** A recorded Python file whose bytes changed
counts as unchanged when only its comments, docstrings, blank lines or
layout did (:func:`code_sha256`, its syntax tree without docstrings): the
recorded version is read from git at the record's commit, and it must
have the recorded sha256 (otherwise, or without that history, the file
counts as changed). So a result checked by bytes (a benchmark's timings)
stays current when the code it ran is rewrapped or documented.

Only the standard library is imported, and of the package only
:mod:`keras_longattn.provenance` (which imports nothing else of it): the
docs build uses this module without importing Keras.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

from keras_longattn.provenance import (
    PACKAGE_PARENT,
    PROVENANCE_KEY,
    combined_hash,
    file_sha256,
    git,
    git_bytes,
    is_checkout,
    keras_backend,
    package_dir,
)
from keras_longattn.provenance import collect as base_collect

__all__ = [
    "PROVENANCE_KEY",
    "Staleness",
    "check_directory",
    "check_results",
    "code_sha256",
    "collect",
    "fingerprint_subjects",
    "is_harness",
    "needed_fingerprints",
    "notebook_code_sha256",
    "record_verified",
    "tree_hash",
    "combined_hash",
    "file_sha256",
    "format_stale",
    "write_results",
]

NO_PROVENANCE = "no provenance recorded"
#: The environment variable ``keras-longattn reproduce`` sets to the notebook
#: it runs (read by :func:`collect`).
NOTEBOOK_ENV_VAR = "KERAS_LONGATTN_NOTEBOOK"
#: ... and to the size it runs it at (``"full"`` or ``"ci"``).
NOTEBOOK_SIZE_ENV_VAR = "KERAS_LONGATTN_NOTEBOOK_SIZE"
#: Files that record, show or judge results: no result depends on their bytes.
PRESENTATION = frozenset({
    "keras_longattn/provenance.py",
    "keras_longattn/reproductions/__init__.py",
    "keras_longattn/reproductions/provenance.py",
    "keras_longattn/reproductions/recording.py",
    "keras_longattn/reproductions/behaviour.py",
    "keras_longattn/reproductions/pages.py",
    "keras_longattn/reproductions/claims.py",
    "keras_longattn/reproductions/planted.py",
})
#: Results files whose run is the planted variants (planted.py is their harness).
PLANTED_NAMES = frozenset({"planted_bugs"})
#: Files and folders of the harness, checked by bytes (see the docstring).
HARNESS_PREFIXES = (
    "notebooks/",
    "keras_longattn/reproductions/",
    "keras_longattn/datasets/",
    "keras_longattn/lra/",
    "keras_longattn/benchmarks/",
    "keras_longattn/hub/",
    "keras_longattn/hub.py",
    "keras_longattn/tokenizers.py",
)
#: Harness only for a run that imported the keras-hub converter (whose
#: CausalLMs generate through it); for other runs library code whose
#: behaviour no subject shows, imported with ``keras_longattn.models``.
GENERATION_FILE = "keras_longattn/models/generation.py"
HUB_PREFIXES = ("keras_longattn/hub/", "keras_longattn/hub.py")
BEHAVIOUR_FILE = Path(__file__).with_name("behaviour.py")
#: Where computed fingerprints are cached, relative to the root.
FINGERPRINT_CACHE = "build/fingerprints"


# ---------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------


def is_harness(relative: str, name: str = "", recorded: Iterable[str] = ()) -> bool | None:
    """How a result named ``name`` depends on the file ``relative`` (a path
    relative to the root): ``True`` by bytes (the harness), ``False`` by
    behaviour (library code its subjects run), ``None`` not at all
    (:data:`PRESENTATION`). ``recorded``: the files the run imported
    (``models/generation.py`` is harness for a run that imported the hub)."""
    if relative in PRESENTATION:
        if relative.endswith("/planted.py") and name in PLANTED_NAMES:
            return True
        return None
    if relative == GENERATION_FILE:
        return any(f.startswith(HUB_PREFIXES) for f in recorded)
    return relative.startswith(HARNESS_PREFIXES)


def notebook_code_sha256(text: str | bytes, size: str = "full") -> str | None:
    """A hash of what a notebook runs at ``size`` (``"full"`` or ``"ci"``):
    its parameters as that size resolves them (the ``parameters`` cell's
    values, with ``metadata.keras_longattn.full_parameters`` over them at
    full size) and the tokens of its other code cells, comments and blank
    lines left out; its prose and its outputs count for nothing. ``None``
    when the notebook cannot be read."""
    import ast
    import io
    import tokenize

    try:
        notebook = json.loads(text)
        cells = notebook["cells"]
    except (ValueError, KeyError, TypeError):
        return None
    parameters: dict[str, Any] = {}
    code = []
    for cell in cells:
        if not isinstance(cell, dict):
            return None
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell.get("source") or [])
        if "parameters" in (cell.get("metadata") or {}).get("tags", []):
            try:
                for node in ast.parse(source).body:
                    if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                            isinstance(node.targets[0], ast.Name):
                        parameters[node.targets[0].id] = ast.literal_eval(node.value)
            except (SyntaxError, ValueError):
                return None
            continue
        try:
            tokens = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                      if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER)]
        except (tokenize.TokenError, IndentationError, SyntaxError):
            tokens = [source]
        code.append(" ".join(tokens))
    if size == "full":
        meta = (notebook.get("metadata") or {}).get("keras_longattn") or {}
        parameters.update(meta.get("full_parameters") or {})
    parameters.pop("results_path", None)
    payload = json.dumps({"parameters": parameters, "code": code}, sort_keys=True, default=repr)
    return hashlib.sha256(payload.encode()).hexdigest()


def _notebook_record(root: Path) -> dict[str, Any] | None:
    """The notebook this run executes (:data:`NOTEBOOK_ENV_VAR`): its path
    relative to ``root``, sha256 and whether it equals the committed file."""
    value = os.environ.get(NOTEBOOK_ENV_VAR)
    if not value:
        return None
    path = Path(value).resolve()
    try:
        relative = path.relative_to(root).as_posix()
    except ValueError:
        relative = path.name
    if not path.is_file():
        return None
    digest = file_sha256(path)
    size = os.environ.get(NOTEBOOK_SIZE_ENV_VAR, "full")
    code = notebook_code_sha256(path.read_bytes(), size)
    committed = None
    if is_checkout(root):
        blob = git_bytes(root, "show", f"HEAD:{relative}")
        committed = blob is not None and hashlib.sha256(blob).hexdigest() == digest
    return {"path": relative, "sha256": digest, "size": size, "code_sha256": code,
            "committed": committed}


def tree_hash(root: str | os.PathLike) -> str:
    """One sha256 over the source files of the package under ``root`` that
    can define a layer a fingerprint runs (not :data:`PRESENTATION`, the
    commands, the data or the benchmark drivers): the key of the
    fingerprint cache."""
    root = Path(root)
    package = package_dir(root)
    files = {}
    for p in package.rglob("*"):
        if not p.is_file() or "__pycache__" in p.parts:
            continue
        if p.suffix not in (".py", ".cc", ".cpp", ".cu", ".h", ".json"):
            continue
        relative = p.relative_to(root).as_posix()
        if relative in PRESENTATION or relative in _NO_SUBJECTS or \
                relative.startswith(_NO_SUBJECT_PREFIXES):
            continue  # they define no layer a fingerprint runs
        files[relative] = file_sha256(p)
    return combined_hash(files)


#: Modules of the package that define no layer or model (commands, data,
#: benchmark drivers): left out of the fingerprint cache's key.
_NO_SUBJECTS = frozenset({"keras_longattn/reproduce.py", "keras_longattn/cli.py"})
_NO_SUBJECT_PREFIXES = ("keras_longattn/benchmarks/", "keras_longattn/datasets/",
                        "keras_longattn/lra/")


def _subject_key(subject: Mapping[str, Any]) -> str:
    return _load_behaviour().subject_key(subject)


def fingerprint_subjects(subjects: Iterable[Mapping[str, Any]], backend: str,
                         root: str | os.PathLike | None = None, *,
                         cache: bool = True, compute: bool = True,
                         timeout: float = 1800) -> dict[str, Any]:
    """``{subject key: fingerprint}`` of ``subjects`` on ``backend``, with the
    package under ``root`` (default: this checkout), computed in a fresh
    Python process (``behaviour.py`` of this checkout run by path, ``root``
    first on ``PYTHONPATH``, ``XLA_FLAGS`` cleared). Fingerprints are cached
    in ``<root>/build/fingerprints/`` by backend, subject and the hash of
    the package's sources.

    With ``compute=False`` only cached fingerprints are returned (the
    subjects without one are left out).

    Raises:
        RuntimeError: when the process fails.
    """
    import tempfile

    root = Path(root).resolve() if root is not None else PACKAGE_PARENT
    subjects = list(subjects)
    tree = tree_hash(root) + file_sha256(BEHAVIOUR_FILE)[:16]
    cache_dir = root / FINGERPRINT_CACHE
    cache_file = cache_dir / f"{backend}-{hashlib.sha256(tree.encode()).hexdigest()[:20]}.json"
    known: dict[str, Any] = {}
    if cache and cache_file.is_file():
        try:
            known = json.loads(cache_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            known = {}
    missing = [s for s in subjects if _subject_key(s) not in known]
    if not compute:
        return {_subject_key(s): known[_subject_key(s)] for s in subjects
                if _subject_key(s) in known}
    if missing:
        with tempfile.TemporaryDirectory() as scratch:
            source, target = Path(scratch) / "subjects.json", Path(scratch) / "out.json"
            source.write_text(json.dumps(missing), encoding="utf-8")
            env = dict(os.environ, KERAS_BACKEND=backend, XLA_FLAGS="",
                       TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0",
                       PYTHONPATH=os.pathsep.join([str(root)] + [
                           p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
            env.pop(NOTEBOOK_ENV_VAR, None)
            result = subprocess.run([sys.executable, str(BEHAVIOUR_FILE), str(source), str(target)],
                                    cwd=scratch, env=env, capture_output=True, text=True,
                                    timeout=timeout)
            if result.returncode != 0 or not target.is_file():
                raise RuntimeError(f"fingerprinting {len(missing)} subject(s) on {backend} failed: "
                                   f"{result.stderr.strip()[-2000:]}")
            known.update(json.loads(target.read_text(encoding="utf-8")))
        if cache:
            try:
                cache_dir.mkdir(parents=True, exist_ok=True)
                cache_file.write_text(json.dumps(known), encoding="utf-8")
            except OSError:
                pass
    return {_subject_key(s): known[_subject_key(s)] for s in subjects}


def _behaviour_record(modules: Mapping[str, Any], root: Path) -> dict[str, Any] | None:
    """The subjects this process recorded and their fingerprints (``None``
    when it did not record)."""
    recorder = modules.get("keras_longattn.reproductions.recording")
    if recorder is None or not getattr(recorder, "_state", {}).get("started"):
        return None
    subjects = recorder.subjects()
    backend = keras_backend(modules)
    record: dict[str, Any] = {"schema": BEHAVIOUR_SCHEMA, "backend": backend,
                              "subjects": subjects, "skipped": recorder.skipped()}
    try:
        record["fingerprints"] = fingerprint_subjects(subjects, backend, root, cache=False)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        record["fingerprints"] = None
        record["error"] = str(error)[-500:]
    return record


#: Version of the behaviour record (and of ``behaviour.SCHEMA``).
BEHAVIOUR_SCHEMA = 1


def collect(modules: Mapping[str, Any] | None = None,
            root: str | os.PathLike | None = None) -> dict[str, Any]:
    """The provenance record of this process (:func:`keras_longattn.provenance.collect`,
    whose arguments these are), with the notebook it runs and its behaviour
    record when it is a notebook's kernel (see the module's docstring)."""
    modules = sys.modules if modules is None else modules
    root = Path(root).resolve() if root is not None else PACKAGE_PARENT
    record = base_collect(modules, root)
    notebook = _notebook_record(root)
    if notebook is not None:
        record["notebook"] = notebook
    behaviour = _behaviour_record(modules, root)
    if behaviour is not None:
        record["behaviour"] = behaviour
    return record


def write_results(path: str | os.PathLike, results: Mapping[str, Any], *,
                  default=None) -> Path:
    """Writes ``results`` with its ``"provenance"`` (:func:`collect`) as
    indented JSON to ``path`` (its folder is created); returns the path.

    ``default`` is passed to :func:`json.dumps` (e.g. ``float`` for numpy
    scalars)."""
    path = Path(path)
    record = dict(results)
    record[PROVENANCE_KEY] = collect()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=default) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# Staleness
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Staleness:
    """Whether one results file describes the sources as they are now.

    Attributes:
        name: the results file's stem (the notebook's slug).
        path: the results file.
        stale: ``True`` when it has no provenance or its sources changed.
        reason: ``"no provenance recorded"``, ``"sources changed"`` or
            ``"up to date"``.
        changed: the recorded files whose content differs now (or that are
            gone), sorted.
        commit: the commit the run recorded (``None`` when none was).
        since: the short hash of the first commit after ``commit`` that
            touched one of ``changed`` (``None`` when git does not say).
    """

    name: str
    path: Path
    stale: bool
    reason: str
    changed: tuple[str, ...] = ()
    commit: str | None = None
    since: str | None = None
    #: Library files that changed by bytes while every fingerprint agreed
    #: (an up-to-date result), or whose change altered a fingerprint.
    behaviour_files: tuple[str, ...] = ()
    #: How fingerprints differ (``"<subject>: <difference>"``), when they do.
    differences: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: ``<name>: <what changed>``."""
        if not self.stale:
            if self.behaviour_files:
                return (f"{self.name}: up to date (behaviour unchanged; "
                        f"{len(self.behaviour_files)} library files changed by bytes)")
            return f"{self.name}: up to date"
        if self.reason == NOT_CHECKED:
            return (f"{self.name}: {NOT_CHECKED} ({len(self.changed)} library files changed "
                    f"{self._since_text()})")
        if self.differences:
            shown = "; ".join(self.differences[:3])
            more = f" (+{len(self.differences) - 3} more)" if len(self.differences) > 3 else ""
            return (f"{self.name}: stale, behaviour changed {self._since_text()}: {shown}{more}")
        if not self.changed:
            return f"{self.name}: stale, {self.reason}"
        return f"{self.name}: stale {self._since_text()} ({self._files_text()})"

    def note(self) -> str:
        """The sentence a docs page shows for a stale result (``""`` when
        the result is up to date)."""
        if not self.stale:
            return ""
        if self.reason == NOT_CHECKED:
            return (f"Not checked: {len(self.changed)} library files this run imported changed "
                    f"{self._since_text()}; `keras-longattn reproduce --stale` compares the "
                    "behaviour of the layers and models it used with today's code.")
        if self.differences:
            return (f"Stale: the behaviour of the code this run used changed "
                    f"{self._since_text()} ({'; '.join(self.differences[:3])}).")
        if not self.changed:
            return f"Stale: {self.reason} for this run."
        return (f"Stale: the sources of this run changed {self._since_text()} "
                f"({self._files_text()}).")

    def _since_text(self) -> str:
        if self.since:
            return f"since {self.since}"
        if self.commit:
            return (f"after its commit {self.commit[:10]} (no later commit touches them: "
                    "uncommitted edits, a run on a dirty tree, or history this clone lacks)")
        return "after the run (no commit recorded)"

    def _files_text(self) -> str:
        return f"file{'s' if len(self.changed) > 1 else ''} {', '.join(self.changed)}"

    def as_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["path"] = str(self.path)
        record["changed"] = list(self.changed)
        record["behaviour_files"] = list(self.behaviour_files)
        record["differences"] = list(self.differences)
        return record


def _first_commit_since(root: Path, commit: str, files: Iterable[str]) -> str | None:
    log = git(root, "log", "--format=%h", "--reverse", f"{commit}..HEAD", "--", *files)
    if not log:
        return None
    return log.split()[0]


def _load_behaviour():
    """:mod:`.behaviour`, loaded by path (it imports only the standard
    library at module level)."""
    import importlib.util

    name = "keras_longattn.reproductions.behaviour"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location("_keras_longattn_behaviour", BEHAVIOUR_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(path: Path) -> dict[str, Any]:
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path} does not hold a JSON object. Received: {type(results).__name__}")
    return results


def _usable_behaviour(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The behaviour record when it can decide staleness: every subject has
    a fingerprint that was computed, in today's layout."""
    behaviour = record.get("behaviour")
    if not isinstance(behaviour, dict) or behaviour.get("schema") != BEHAVIOUR_SCHEMA:
        return None
    subjects, prints = behaviour.get("subjects"), behaviour.get("fingerprints")
    if not isinstance(subjects, list) or not subjects or not isinstance(prints, dict):
        return None
    keys = [_subject_key(subject) for subject in subjects]
    if any(key not in prints or "error" in prints[key] for key in keys):
        return None
    return behaviour


def code_sha256(source: bytes | str) -> str | None:
    """A hash of what a Python file runs: its syntax tree (``ast.dump``,
    without positions) with the docstrings of the module, its classes and
    functions left out. Comments, docstrings, blank lines and layout count
    for nothing; any other edit changes it. ``None`` when it does not
    parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and \
                    isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def _same_code(root: Path, commit: str | None, relative: str, digest: str) -> bool:
    """Whether the Python file ``relative``, whose bytes differ from the
    recorded ``digest``, runs the same code as the version recorded: that
    version read from git at ``commit`` (it must have ``digest``) and the
    file now have the same :func:`code_sha256`."""
    if not commit or not relative.endswith(".py"):
        return False
    old = git_bytes(root, "show", f"{commit}:{relative}")
    if old is None or hashlib.sha256(old).hexdigest() != digest:
        return False
    before = code_sha256(old)
    return before is not None and before == code_sha256((root / relative).read_bytes())


def _changed_files(record: Mapping[str, Any], root: Path) -> list[str]:
    changed = []
    commit = record.get("commit")
    for relative, digest in record["source_files"].items():
        current = root / relative
        if not current.is_file():
            changed.append(relative)
        elif file_sha256(current) != digest and not _same_code(root, commit, relative, digest):
            changed.append(relative)
    notebook = record.get("notebook")
    if isinstance(notebook, dict) and notebook.get("path"):
        current = root / notebook["path"]
        if not current.is_file():
            changed.append(notebook["path"])
        elif notebook.get("code_sha256"):
            # what the notebook runs: its parameters at the run's size and
            # its code, not its prose, comments or the other size's values
            now = notebook_code_sha256(current.read_bytes(), notebook.get("size", "full"))
            if now != notebook["code_sha256"]:
                changed.append(notebook["path"])
        elif file_sha256(current) != notebook.get("sha256"):
            changed.append(notebook["path"])
    return sorted(changed)


def needed_fingerprints(path: str | os.PathLike, root: str | os.PathLike | None = None
                        ) -> tuple[str, list[dict[str, Any]]] | None:
    """``(backend, subjects)`` whose fingerprints :func:`check_results` needs
    to decide on ``path`` (``None`` when bytes decide)."""
    path = Path(path)
    root = Path(root).resolve() if root is not None else PACKAGE_PARENT
    record = _read(path).get(PROVENANCE_KEY)
    if not isinstance(record, dict) or not isinstance(record.get("source_files"), dict):
        return None
    behaviour = _usable_behaviour(record)
    if behaviour is None:
        return None
    harness, library = _split_changes(record, root, path.stem)
    if harness or not library or _verified(behaviour, library, root):
        return None
    return behaviour["backend"], behaviour["subjects"]


def _split_changes(record: Mapping[str, Any], root: Path, name: str
                   ) -> tuple[list[str], list[str]]:
    """``(harness, library)``: the recorded files (and the notebook) that
    changed since the run, by how the result depends on them
    (:func:`is_harness`; presentation-only files dropped). A record with
    ``depends_on`` counts only those files, as harness."""
    changed = _changed_files(record, root)
    depends_on = record.get("depends_on")
    if isinstance(depends_on, list):
        # a result measured on its own sources only (a device run: the files
        # of the paths it timed, see "depends_on_reason")
        return [f for f in changed if f in depends_on], []
    recorded = record["source_files"]
    kinds = [(f, is_harness(f, name, recorded)) for f in changed]
    return ([f for f, kind in kinds if kind is True],
            [f for f, kind in kinds if kind is False])


#: The reason of a result whose behaviour was not compared (``compute=False``
#: and no cached fingerprints).
NOT_CHECKED = "behaviour not checked"


def check_results(path: str | os.PathLike, root: str | os.PathLike | None = None, *,
                  fingerprints: Mapping[str, Any] | None = None,
                  compute: bool = True) -> Staleness:
    """Whether the results file ``path`` is stale against the sources under
    ``root`` (default: the folder holding this package).

    With a behaviour record (see the module's docstring) a result is stale
    when a harness file or the notebook changed, or when a library file
    changed and a subject's fingerprint now differs; ``fingerprints``
    (``{subject key: fingerprint}``, as :func:`fingerprint_subjects`
    returns) saves computing them; with ``compute=False`` only cached ones
    are used, and a result that needs others comes back stale with the
    reason :data:`NOT_CHECKED` (its note says to run ``keras-longattn
    reproduce --stale``). Without a behaviour record, any change of a
    recorded file makes it stale.

    Raises:
        ValueError: if ``path`` is not a JSON object.
    """
    path = Path(path)
    root = Path(root).resolve() if root is not None else PACKAGE_PARENT
    results = _read(path)
    name = path.stem
    record = results.get(PROVENANCE_KEY)
    if not isinstance(record, dict) or not isinstance(record.get("source_files"), dict):
        return Staleness(name, path, True, NO_PROVENANCE)
    commit = record.get("commit")
    harness, library = _split_changes(record, root, name)
    behaviour = _usable_behaviour(record)
    if behaviour is not None and not isinstance(record.get("depends_on"), list):
        if not harness and not library:
            return Staleness(name, path, False, "up to date", commit=commit)
        if not harness:
            if _verified(behaviour, library, root):
                return Staleness(name, path, False, "up to date", commit=commit,
                                 behaviour_files=tuple(library))
            if not compute and fingerprints is None:
                fingerprints = fingerprint_subjects(behaviour["subjects"], behaviour["backend"],
                                                    root, compute=False)
                if len(fingerprints) < len(behaviour["subjects"]):
                    return Staleness(name, path, True, NOT_CHECKED, tuple(library), commit,
                                     behaviour_files=tuple(library))
            differences = _fingerprint_differences(behaviour, root, fingerprints)
            if not differences:
                return Staleness(name, path, False, "up to date", commit=commit,
                                 behaviour_files=tuple(library))
            since = _first_commit_since(root, commit, library) if commit else None
            return Staleness(name, path, True, "behaviour changed", tuple(library), commit, since,
                             behaviour_files=tuple(library), differences=tuple(differences))
        changed = harness
    else:
        changed = sorted(harness + library)
    if not changed:
        return Staleness(name, path, False, "up to date", commit=commit)
    since = _first_commit_since(root, commit, changed) if commit else None
    return Staleness(name, path, True, "sources changed", tuple(changed), commit, since)


def _verified(behaviour: Mapping[str, Any], library: Iterable[str], root: Path) -> bool:
    """Whether every library file in ``library`` is byte for byte what it was
    when the fingerprints were last found to agree (``behaviour["verified"]``,
    written by :func:`record_verified`)."""
    verified = behaviour.get("verified")
    files = verified.get("source_files") if isinstance(verified, dict) else None
    if not isinstance(files, dict):
        return False
    for relative in library:
        current = root / relative
        if relative not in files or not current.is_file() or file_sha256(current) != files[relative]:
            return False
    return True


def record_verified(path: str | os.PathLike, root: str | os.PathLike | None = None) -> bool:
    """Notes in the results file ``path`` that its fingerprints agree with the
    library files as they are now (``provenance.behaviour.verified``: the
    commit, the date and those files' hashes), so that later checks compute
    fingerprints again only for files changed since. Does nothing (returns
    ``False``) unless :func:`check_results` finds the result current by
    behaviour with changed library files."""
    path = Path(path)
    root = Path(root).resolve() if root is not None else PACKAGE_PARENT
    check = check_results(path, root)
    if check.stale or not check.behaviour_files:
        return False
    results = _read(path)
    record = results[PROVENANCE_KEY]
    files = {f: file_sha256(root / f) for f in record["source_files"]
             if is_harness(f, path.stem, record["source_files"]) is False and (root / f).is_file()}
    head = git(root, "rev-parse", "HEAD") if is_checkout(root) else None
    record["behaviour"]["verified"] = {
        "commit": head.strip() if head else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source_files": files,
    }
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return True


def _fingerprint_differences(behaviour: Mapping[str, Any], root: Path,
                             fingerprints: Mapping[str, Any] | None) -> list[str]:
    subjects = behaviour["subjects"]
    if fingerprints is None or any(_subject_key(s) not in fingerprints for s in subjects):
        try:
            fingerprints = fingerprint_subjects(subjects, behaviour["backend"], root)
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            return [f"fingerprints could not be computed: {str(error)[-300:]}"]
    compare = _load_behaviour().compare
    differences = []
    for subject in subjects:
        key = _subject_key(subject)
        found = compare(behaviour["fingerprints"][key], fingerprints[key])
        if found:
            label = subject.get("layer", {}).get("class_name", "?")
            differences.append(f"{label} {key}: {', '.join(found[:2])}")
    return differences


def check_directory(directory: str | os.PathLike,
                    root: str | os.PathLike | None = None, *,
                    compute: bool = True) -> list[Staleness]:
    """:func:`check_results` of every ``*.json`` of ``directory``, by name
    (an empty list when the folder does not exist), with one fingerprinting
    process per backend for all of them (``compute=False``: cached
    fingerprints only)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    paths = sorted(directory.glob("*.json"))
    # One fingerprinting process per backend for every result that needs one.
    wanted: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            needed = needed_fingerprints(path, root)
        except ValueError:
            needed = None
        if needed is not None:
            backend, subjects = needed
            for subject in subjects:
                wanted.setdefault(backend, {})[_subject_key(subject)] = subject
    computed: dict[str, Any] = {}
    for backend, subjects in wanted.items():
        try:
            computed.update(fingerprint_subjects(list(subjects.values()), backend, root,
                                                 compute=compute))
        except (RuntimeError, OSError, subprocess.SubprocessError):
            pass  # check_results reports it per result
    return [check_results(path, root, fingerprints=computed if compute else None,
                          compute=compute) for path in paths]


def format_stale(checks: Iterable[Staleness]) -> str:
    """The stale ones of ``checks``, one line each (``""`` when none is)."""
    return "\n".join(check.describe() for check in checks if check.stale)
