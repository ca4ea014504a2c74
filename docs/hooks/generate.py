"""mkdocs hook: the docs' generated pages and figures, made at build time.

``mkdocs.yml`` lists this file under ``hooks:``, so ``mkdocs build`` and
``mkdocs serve`` work from a clean checkout with no earlier step. In
``on_files`` it runs the steps of ``docs/gen_figures.py`` (pattern figures,
benchmark page, notebooks and reproductions index) and adds what they write
to the site at their paths in the sources (``assets/patterns/<layer>.png``,
``benchmarks.md``, ...), as files whose source folder is the cache entry
below. Nothing is written into ``docs/``.

Each step writes into ``build/docs-generated/<step>/<key>/``, where ``key``
is a hash of the step's inputs: the generator's code, the files it reads and
the versions of the packages that draw. A build whose inputs did not change
reuses that folder (so ``mkdocs serve`` does not redraw the figures on every
reload); a new key replaces the step's older folders. The inputs:

* ``patterns``: the ``keras_longattn`` package sources, the guides' names,
  the versions of keras, its backend and matplotlib. The figures are drawn in
  a subprocess (``python docs/gen_figures.py patterns``) with the checkout on
  ``PYTHONPATH`` and ``KERAS_BACKEND`` defaulting to jax: the backends are
  not imported into the mkdocs process, and edits to the package during
  ``mkdocs serve`` are drawn from the new code;
* ``benchmarks``: the benchmark JSON the page is made from;
* ``notebooks``: ``notebooks/*.ipynb``, the executed copies and results of
  ``build/notebooks/``, the committed runs of ``docs/results/``, whether each
  of those is stale against the package's sources (``gen.stale_checks``:
  the pages show a note when it is) and the date, which the index prints.

``KERAS_LONGATTN_DOCS_CACHE`` sets another folder than
``build/docs-generated``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.generate")

GEN_FIGURES = Path(__file__).resolve().parents[1] / "gen_figures.py"
CACHE_ENV = "KERAS_LONGATTN_DOCS_CACHE"
#: Written last into a step's folder: the list of its files.
MANIFEST = ".files.json"
STEPS = ("patterns", "benchmarks", "notebooks")


def load_gen_figures():
    """A fresh ``docs/gen_figures.py`` module (fresh so that ``mkdocs serve``
    picks up edits to it)."""
    spec = importlib.util.spec_from_file_location("keras_longattn_docs_gen_figures", GEN_FIGURES)
    module = importlib.util.module_from_spec(spec)
    # No docs/__pycache__ written mid-build (mkdocs serve watches docs/).
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = dont_write
    return module


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _package_dir(root: Path) -> Path | None:
    """The ``keras_longattn`` that the figures' subprocess imports: the
    checkout's own (it goes first on ``PYTHONPATH``), else the installed one."""
    if (root / "keras_longattn" / "__init__.py").is_file():
        return root / "keras_longattn"
    spec = importlib.util.find_spec("keras_longattn")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


class Key:
    """A sha256 over labelled values and files."""

    def __init__(self, root: Path):
        self.root = root
        self.hash = hashlib.sha256()

    def value(self, label: str, value) -> None:
        self.hash.update(f"{label}={value!r}\0".encode())

    def file(self, path: Path) -> None:
        try:
            name = path.resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            name = str(path)
        data = path.read_bytes() if path.is_file() else b"<missing>"
        self.hash.update(f"file {name} {len(data)}\0".encode())
        self.hash.update(data)

    def files(self, folder: Path, pattern: str) -> None:
        for path in sorted(folder.glob(pattern)) if folder.is_dir() else ():
            if "__pycache__" not in path.parts and path.is_file():
                self.file(path)

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


def step_key(step: str, gen, root: Path) -> str:
    """The hash of the inputs of one step (see the module's docstring)."""
    key = Key(root)
    key.value("step", step)
    key.file(GEN_FIGURES)
    key.file(Path(__file__))
    key.value("matplotlib", _version("matplotlib"))
    if step == "patterns":
        package = _package_dir(root)
        key.value("package", package is not None)
        if package is not None:
            key.files(package, "**/*.py")
        key.value("guides", sorted(p.name for p in gen.GUIDES.glob("*.md")))
        key.value("backend", os.environ.get("KERAS_BACKEND", "jax"))
        key.value("versions", [_version(name) for name in (
            "keras", "numpy", "jax", "jaxlib", "tensorflow", "tensorflow-cpu", "torch")])
    elif step == "benchmarks":
        document, source, kind = gen.find_benchmark(gen.BENCHMARK_SOURCES)
        key.value("source", (str(source), kind))
        if source is not None:
            key.file(source)
        if gen.MEMORY_CURVE_SOURCE.is_file():
            key.file(gen.MEMORY_CURVE_SOURCE)
        if gen.GPU_SOURCE.is_file():
            key.file(gen.GPU_SOURCE)
    elif step == "notebooks":
        key.files(gen.NOTEBOOKS_SRC, "*.ipynb")
        key.files(gen.NOTEBOOKS_BUILD, "*.ipynb")
        key.files(gen.NOTEBOOKS_BUILD, "*.json")
        key.files(gen.NOTEBOOKS_FULL, "*")
        key.value("stale", sorted(
            (slug, check.stale, check.note())
            for slug, check in gen.stale_checks(gen.NOTEBOOKS_FULL, root).items()))
        key.value("date", datetime.now().strftime("%Y-%m-%d"))
    else:
        raise ValueError(f"unknown step {step!r}")
    return key.hexdigest()


def cached(step: str, key: str, cache: Path, produce) -> tuple[Path, list[str], bool]:
    """``(folder, files, reused)``: the folder of ``step`` for ``key`` under
    ``cache``, made by ``produce(folder)`` unless a complete one exists.

    ``produce`` writes into a temporary folder that is renamed into place
    once complete, so an interrupted build leaves no half-written entry;
    the step's folders of other keys are then removed."""
    step_dir = cache / step
    final = step_dir / key[:24]
    manifest = final / MANIFEST
    if manifest.is_file():
        return final, json.loads(manifest.read_text(encoding="utf-8")), True
    step_dir.mkdir(parents=True, exist_ok=True)
    tmp = step_dir / f".tmp-{os.getpid()}-{key[:8]}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        produce(tmp)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        (tmp / MANIFEST).write_text(json.dumps(files, indent=1) + "\n", encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one
        try:
            tmp.rename(final)
        except OSError:
            if not manifest.is_file():  # not another build's complete copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for other in step_dir.iterdir():
        if other != final and not other.name.startswith(".tmp-"):
            shutil.rmtree(other, ignore_errors=True)
    return final, json.loads(manifest.read_text(encoding="utf-8")), False


def draw_patterns(root: Path, out: Path) -> None:
    """``python docs/gen_figures.py patterns --out <out>`` in a subprocess."""
    env = dict(os.environ)
    env.setdefault("KERAS_BACKEND", "jax")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["MPLBACKEND"] = "Agg"
    # No __pycache__ in the package: mkdocs serve watches it.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    command = [sys.executable, str(GEN_FIGURES), "patterns", "--out", str(out)]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    for line in result.stderr.splitlines():
        if line.startswith("[gen_figures] "):
            message = line[len("[gen_figures] "):]
            (log.info if message.startswith("skipped") else log.debug)(message)
    if result.returncode != 0:
        raise PluginError(
            f"the pattern figures failed ({' '.join(command)}, exit status "
            f"{result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")


def generate_all(root: Path, cache: Path, gen=None) -> list[tuple[str, Path]]:
    """``(src_uri, folder)`` of every generated file (at ``folder / src_uri``),
    made or taken from the cache."""
    gen = gen or load_gen_figures()
    generated = []
    for step in STEPS:
        start = time.perf_counter()
        key = step_key(step, gen, root)
        if step == "patterns":
            produce = lambda out: draw_patterns(root, out)  # noqa: E731
        else:
            produce = lambda out, step=step: gen.STEPS[step](out)  # noqa: E731
        folder, files, reused = cached(step, key, cache, produce)
        where = os.path.relpath(folder, root)
        if reused:
            log.debug("%s: %d files, unchanged inputs (%s)", step, len(files), where)
        else:
            log.info("Generated the docs' %s: %d files in %.1f s (%s)",
                     step, len(files), time.perf_counter() - start, where)
        generated += [(uri, folder) for uri in files]
    return generated


def _root(config) -> Path:
    """The folder of mkdocs.yml (the repository root)."""
    if config.config_file_path:
        return Path(config.config_file_path).resolve().parent
    return GEN_FIGURES.parents[1]


def _cache(config) -> Path:
    return Path(os.environ.get(CACHE_ENV) or _root(config) / "build" / "docs-generated")


# Before the plugins' on_files: mkdocs-jupyter must see the notebooks.
@event_priority(100)
def on_files(files: Files, config) -> Files:
    gen = load_gen_figures()
    generated = generate_all(_root(config), _cache(config), gen)
    uris = {uri for uri, _ in generated}
    # Copies in docs/ (git-ignored leftovers of the time when
    # gen_figures.py wrote there) are replaced by this build's.
    owned = tuple(f"{folder}/" for folder in (
        gen.PATTERNS_URI, gen.BENCHMARK_ASSETS_URI, gen.NOTEBOOKS_URI))
    leftovers = [f for f in files if f.src_uri in uris or f.src_uri.startswith(owned)]
    for file in leftovers:
        files.remove(file)
    if leftovers:
        log.info("Ignored %d generated files left in %s by older builds (safe to delete): %s",
                 len(leftovers), config.docs_dir, ", ".join(f.src_uri for f in leftovers[:5])
                 + (", ..." if len(leftovers) > 5 else ""))
    for uri, folder in generated:
        # A plain File whose source folder is the cache entry, rather than
        # File.generated(config, uri, abs_src_path=...): mkdocs-jupyter
        # (0.26) wraps notebooks in a NotebookFile that recomputes
        # abs_src_path from src_dir, which File.generated leaves None.
        files.append(File(uri, src_dir=str(folder), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    return files


def on_serve(server, config, builder):
    """Rebuilds when the generated files' inputs outside docs/ change."""
    root = _root(config)
    for path in (root / "notebooks", root / "build" / "notebooks",
                 root / "build" / "benchmarks", _package_dir(root)):
        if path is not None and path.is_dir():
            server.watch(str(path))
    return server
