"""What a measurement ran on: the record every committed result carries.

:func:`collect` describes the current process:

* ``commit``: the git commit of the checkout the package was imported from,
  ``dirty``: whether its work tree had changes, ``dirty_sources``: which of
  the recorded source files git reports as changed or untracked (``None``
  when the package is not in a git checkout);
* ``source_files``: ``{path: sha256}`` of every ``keras_longattn`` source
  file the process imported (the ``__file__`` of each module of
  ``sys.modules`` that lies inside the package, when the record is taken),
  plus the files of a ``csrc/`` folder next to an imported module (the C++
  sources that module compiles); paths are relative to the folder that
  holds the package (``keras_longattn/layers/local_attention.py``). This
  module is left out: it records, it computes nothing a result depends on.
  ``source_sha256`` is one hash over all of them;
* ``backend`` (Keras' backend, when Keras was imported), ``date`` (UTC, ISO
  8601) and ``machine``: platform, processor, CPU counts, Python and the
  versions of keras, jax, jaxlib, tensorflow, torch and numpy among those
  imported.

The benchmarks and the context-parallel measurement write it into their
results files; the notebooks' records (:mod:`keras_longattn.reproductions.provenance`)
add what the notebook ran and its behaviour fingerprints, and judge whether
a committed result is still current.

Only the standard library is imported, and nothing else of the package.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

__all__ = [
    "PROVENANCE_KEY",
    "collect",
    "combined_hash",
    "file_sha256",
    "imported_source_files",
]

#: Key of the record in a results JSON.
PROVENANCE_KEY = "provenance"
#: Version of the record's layout.
SCHEMA = 1
#: The folder that holds the ``keras_longattn`` package (a checkout's root).
PACKAGE_PARENT = Path(__file__).resolve().parents[1]
PACKAGE_NAME = "keras_longattn"
#: Folders next to a module holding the native sources that module builds.
NATIVE_SOURCE_DIRS = ("csrc",)
#: Packages whose versions are recorded, when the process imported them.
VERSIONED_PACKAGES = ("keras", "jax", "jaxlib", "tensorflow", "torch", "numpy")


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


def package_dir(root: Path) -> Path:
    """The package's folder under a checkout's ``root``."""
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
    package = package_dir(root)
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


def git(root: Path, *args: str) -> str | None:
    """``git <args>`` in ``root``: its stdout, or ``None`` when git is missing
    or fails."""
    try:
        result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def git_bytes(root: Path, *args: str) -> bytes | None:
    """``git <args>`` in ``root``: its stdout as bytes, or ``None``."""
    try:
        result = subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def is_checkout(root: Path) -> bool:
    """Whether ``root`` is the top level of a git work tree."""
    top = git(root, "rev-parse", "--show-toplevel")
    return top is not None and Path(top.strip()).resolve() == root.resolve()


def git_state(root: Path, files: Iterable[str]) -> dict[str, Any]:
    """``commit``, ``dirty`` and ``dirty_sources`` (of ``files``) of the
    checkout at ``root`` (all ``None`` outside a checkout)."""
    if not is_checkout(root):
        return {"commit": None, "dirty": None, "dirty_sources": None}
    commit = git(root, "rev-parse", "HEAD")
    status = git(root, "status", "--porcelain")
    files = list(files)
    changed = git(root, "status", "--porcelain", "--", *files) if files else ""
    dirty_sources = None
    if changed is not None:
        dirty_sources = sorted({line[3:].strip() for line in changed.splitlines() if line})
    return {
        "commit": commit.strip() if commit else None,
        "dirty": None if status is None else bool(status.strip()),
        "dirty_sources": dirty_sources,
    }


def processor() -> str:
    """The CPU model (``/proc/cpuinfo``'s ``model name`` on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as stream:
            for line in stream:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(modules: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Platform, processor, CPU counts, Python and the versions of
    :data:`VERSIONED_PACKAGES` that ``modules`` (default ``sys.modules``) hold."""
    modules = sys.modules if modules is None else modules
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
        "processor": processor(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "versions": versions,
    }


def keras_backend(modules: Mapping[str, Any] | None = None) -> str | None:
    """Keras' backend, when ``modules`` (default ``sys.modules``) hold Keras."""
    keras = (sys.modules if modules is None else modules).get("keras")
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
    record: dict[str, Any] = {"schema": SCHEMA}
    record.update(git_state(root, files))
    record.update({
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": keras_backend(modules),
        "source_sha256": combined_hash(files),
        "source_files": files,
        "machine": machine(modules),
    })
    return record
