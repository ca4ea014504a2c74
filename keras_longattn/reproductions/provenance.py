"""Provenance of a reproduction's results, and whether they are stale.

A paper notebook writes its results JSON with :func:`write_results`, which
adds a ``"provenance"`` record (see :func:`collect`) describing the process
that ran the notebook (the notebook's kernel):

* ``commit``: the git commit of the checkout the package was imported from,
  ``dirty``: whether its work tree had changes, ``dirty_sources``: which of
  the recorded source files git reports as changed or untracked (``None``
  when the package is not in a git checkout);
* ``source_files``: ``{path: sha256}`` of every ``keras_longattn`` source
  file the process imported (the ``__file__`` of each module of
  ``sys.modules`` that lies inside the package, when the results are
  written), plus the files of a ``csrc/`` folder next to an imported module
  (the C++ sources that module compiles); paths are relative to the folder
  that holds the package (``keras_longattn/layers/local_attention.py``).
  This module itself is left out: it records, it computes nothing that a
  result depends on. ``source_sha256`` is one hash over all of them;
* ``backend`` (Keras' backend, when Keras was imported), ``date`` (UTC, ISO
  8601) and ``machine``: platform, processor, CPU counts, Python and the
  versions of keras, jax, jaxlib, tensorflow, torch and numpy among those
  imported.

:func:`check_results` compares a results file's recorded hashes with the
files as they are now: a results file without provenance is stale ("no
provenance recorded"), and so is one whose recorded files changed (or were
removed); where git knows the recorded commit, ``since`` is the first later
commit that touched one of the changed files. ``keras-longattn reproduce
--stale`` lists the stale results of ``docs/results/`` and the docs' paper
pages show the same :meth:`Staleness.note`.

Only the standard library is imported, and nothing of the package: the docs
build loads this file on its own (without importing ``keras_longattn``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = [
    "PROVENANCE_KEY",
    "Staleness",
    "check_directory",
    "check_results",
    "collect",
    "combined_hash",
    "file_sha256",
    "format_stale",
    "imported_source_files",
    "write_results",
]

#: Key of the record in a results JSON.
PROVENANCE_KEY = "provenance"
#: Version of the record's layout.
SCHEMA = 1
#: The folder that holds the ``keras_longattn`` package (a checkout's root).
PACKAGE_PARENT = Path(__file__).resolve().parents[2]
PACKAGE_NAME = "keras_longattn"
#: Folders next to a module holding the native sources that module builds.
NATIVE_SOURCE_DIRS = ("csrc",)
#: Packages whose versions are recorded, when the process imported them.
VERSIONED_PACKAGES = ("keras", "jax", "jaxlib", "tensorflow", "torch", "numpy")
NO_PROVENANCE = "no provenance recorded"


# ---------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def combined_hash(files: Mapping[str, str]) -> str:
    """One sha256 over ``{path: sha256}``, independent of the mapping's order."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\n".encode())
    return digest.hexdigest()


def _package_dir(root: Path) -> Path:
    return root / PACKAGE_NAME


def imported_source_files(modules: Mapping[str, Any] | None = None,
                          root: str | os.PathLike | None = None) -> dict[str, str]:
    """``{path relative to root: sha256}`` of the package's source files that
    ``modules`` (default: ``sys.modules``) hold, sorted by path.

    A module counts when its ``__file__`` lies inside ``<root>/keras_longattn``
    (``root`` defaults to the folder holding this package); the files of a
    ``csrc/`` folder beside such a module count too. This module is left out.
    """
    root = Path(root).resolve() if root is not None else PACKAGE_PARENT
    package = _package_dir(root)
    own = Path(__file__).resolve()
    modules = sys.modules if modules is None else modules
    paths: set[Path] = set()
    for module in list(modules.values()):
        filename = getattr(module, "__file__", None)
        if not filename:
            continue
        path = Path(filename).resolve()
        if path == own or package not in path.parents or not path.is_file():
            continue
        paths.add(path)
        for name in NATIVE_SOURCE_DIRS:
            native = path.parent / name
            if native.is_dir():
                paths.update(p for p in native.rglob("*")
                             if p.is_file() and "__pycache__" not in p.parts)
    return {path.relative_to(root).as_posix(): file_sha256(path)
            for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix())}


def _git(root: Path, *args: str) -> str | None:
    """``git <args>`` in ``root``: its stdout, or ``None`` when git is missing
    or fails."""
    try:
        result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def _checkout(root: Path) -> bool:
    """Whether ``root`` is the top level of a git work tree."""
    top = _git(root, "rev-parse", "--show-toplevel")
    return top is not None and Path(top.strip()).resolve() == root.resolve()


def _git_state(root: Path, files: Iterable[str]) -> dict[str, Any]:
    if not _checkout(root):
        return {"commit": None, "dirty": None, "dirty_sources": None}
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain")
    files = list(files)
    changed = _git(root, "status", "--porcelain", "--", *files) if files else ""
    dirty_sources = None
    if changed is not None:
        dirty_sources = sorted({line[3:].strip() for line in changed.splitlines() if line})
    return {
        "commit": commit.strip() if commit else None,
        "dirty": None if status is None else bool(status.strip()),
        "dirty_sources": dirty_sources,
    }


def _processor() -> str:
    """The CPU model (``/proc/cpuinfo``'s ``model name`` on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as stream:
            for line in stream:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine(modules: Mapping[str, Any]) -> dict[str, Any]:
    versions = {}
    for name in VERSIONED_PACKAGES:
        module = modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is not None:
            versions[name] = str(version)
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": _processor(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "versions": versions,
    }


def _backend(modules: Mapping[str, Any]) -> str | None:
    keras = modules.get("keras")
    if keras is None:
        return None
    try:
        return str(keras.backend.backend())
    except Exception:  # a half-imported keras: no backend to report
        return None


def collect(modules: Mapping[str, Any] | None = None,
            root: str | os.PathLike | None = None) -> dict[str, Any]:
    """The provenance record of this process (see the module's docstring).

    Args:
        modules: the modules to describe; default ``sys.modules``, read when
            called, so call it at the end of the run.
        root: the folder holding the package; default the one this module
            was loaded from.
    """
    modules = sys.modules if modules is None else modules
    root = Path(root).resolve() if root is not None else PACKAGE_PARENT
    files = imported_source_files(modules, root)
    record = {"schema": SCHEMA}
    record.update(_git_state(root, files))
    record.update({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": _backend(modules),
        "source_sha256": combined_hash(files),
        "source_files": files,
        "machine": _machine(modules),
    })
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

    def describe(self) -> str:
        """One line: ``<name>: <what changed>``."""
        if not self.stale:
            return f"{self.name}: up to date"
        if not self.changed:
            return f"{self.name}: stale, {self.reason}"
        return f"{self.name}: stale {self._since_text()} ({self._files_text()})"

    def note(self) -> str:
        """The sentence a docs page shows for a stale result (``""`` when
        the result is up to date)."""
        if not self.stale:
            return ""
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
        return record


def _first_commit_since(root: Path, commit: str, files: Iterable[str]) -> str | None:
    log = _git(root, "log", "--format=%h", "--reverse", f"{commit}..HEAD", "--", *files)
    if not log:
        return None
    return log.split()[0]


def check_results(path: str | os.PathLike, root: str | os.PathLike | None = None) -> Staleness:
    """Whether the results file ``path`` is stale against the sources under
    ``root`` (default: the folder holding this package).

    Raises:
        ValueError: if ``path`` is not a JSON object.
    """
    path = Path(path)
    root = Path(root).resolve() if root is not None else PACKAGE_PARENT
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path} does not hold a JSON object. Received: {type(results).__name__}")
    name = path.stem
    record = results.get(PROVENANCE_KEY)
    if not isinstance(record, dict) or not isinstance(record.get("source_files"), dict):
        return Staleness(name, path, True, NO_PROVENANCE)
    recorded = record["source_files"]
    commit = record.get("commit")
    changed = []
    for relative, digest in recorded.items():
        current = root / relative
        if not current.is_file() or file_sha256(current) != digest:
            changed.append(relative)
    if not changed:
        return Staleness(name, path, False, "up to date", commit=commit)
    changed.sort()
    since = _first_commit_since(root, commit, changed) if commit else None
    return Staleness(name, path, True, "sources changed", tuple(changed), commit, since)


def check_directory(directory: str | os.PathLike,
                    root: str | os.PathLike | None = None) -> list[Staleness]:
    """:func:`check_results` of every ``*.json`` of ``directory``, by name
    (an empty list when the folder does not exist)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return [check_results(path, root) for path in sorted(directory.glob("*.json"))]


def format_stale(checks: Iterable[Staleness]) -> str:
    """The stale ones of ``checks``, one line each (``""`` when none is)."""
    return "\n".join(check.describe() for check in checks if check.stale)
