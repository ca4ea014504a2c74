"""The numbers of the paper pages (``papers/*.md``), generated from the
committed results files.

A paper page holds every number this project measured in a *region*: the
text between an opening and a closing HTML comment, which Markdown renders
invisibly, so the page reads as ordinary text. The text of a region is
generated from a committed JSON file; ``--check`` compares it with what the
files give, ``--write`` rewrites it. Four kinds of region:

* ``result``: a value, inline in a sentence or a table cell (never first
  on its line: a line that starts with ``<!--`` is an HTML block in
  Markdown), e.g. ``reaches <!-- result linformer:metrics.full_acc_mean
  fmt=.1f -->80.1<!-- /result --> %``;
* ``results-table NAME:claims``: the claims list of the results file as a
  table, as ``claims.claims_table`` writes it (claim | paper | ours |
  verdict, the verdict worded by ``claims.shown_verdict`` from the stored
  verdict, the asserted flag and the detail, "(asserted)" after the
  verdict of an asserted claim; the option
  ``only=name,...`` keeps the named claims, in their order in the file);
  ``results-table NAME:PATH`` inserts the string at ``PATH`` (e.g.
  ``synthesizer:lm_table``). A table region's markers stand on lines of
  their own, the table between them after a blank line:

    ```
    <!-- results-table linformer:claims -->

    | claim | paper | ours (mean ± spread over seeds) | verdict |
    ...

    <!-- /results-table -->
    ```

* ``results-provenance NAME``: one sentence on the committed run (its file,
  and the commit, date, backend and CPU its provenance record holds, or
  that it holds none);
* ``results-stale NAME``: :meth:`provenance.Staleness.note` of the file
  (or that its sources are unchanged), from
  :func:`provenance.check_results`. It depends on the package's sources
  as well as on the file, so a difference in it alone is reported by
  ``--check`` as a note to refresh, and fails only with ``--strict``.
  Both stand on lines of their own, like a table.

**Sources.** ``NAME`` is ``docs/results/NAME.json``; ``benchmarks`` is
``docs/benchmarks/results.json``, ``context_parallel``
``docs/parallel/context_parallel.json``, ``decode``
``docs/benchmarks/decode.json`` (``keras-longattn decode-bench --write``),
``span_cost`` ``docs/benchmarks/adaptive_span.json`` (``python -m
keras_longattn.benchmarks.span_cost --write``).

**Pages**: ``papers/*.md`` and every Markdown page under ``docs/`` that
holds a region (:data:`DOCS_GLOB`). Outside the regions a page quotes no
number of ours: ``tests/docs/test_no_typed_numbers.py`` checks it.

**Paths** are keys joined by dots: ``metrics.k64_acc_mean``,
``scaling.full.1024.median_ms``; a number indexes a list
(``per_seed.accuracy_percent.full.values.0``); ``[text]`` is a key that
holds dots or brackets; ``[field=value,...]`` picks the one element of a
list of objects whose fields have these values
(``results[backend=torch,layer=routing,seq_len=16384,scope=layer].time_ratio``;
``true``, ``false`` and ``null`` match JSON's, numbers match by value); a
filter that matches no element or several is an error.
``[all:field=value,...]`` picks every match (at least one), and the rest of
the path applies to each: ``suite_rows[all:layer=full].step_ms`` is a list.

**Expressions**: where the text after ``NAME:`` holds ``{path}``, it is an
arithmetic expression over those values (``+ - * / // % **``, numbers,
and ``min``, ``max``, ``abs``, ``round``, ``sum``, ``len``, ``mean``):
``{metrics.k64_acc_mean} - {metrics.full_acc_mean}``,
``{wall_time_s} / 60``. Nothing else is evaluated.

**Options**, after the path or expression: ``fmt=SPEC``, a format
specification of :func:`format` (``.1f``, ``,.0f``, ``+.3f``, ``.1%``;
without it, :class:`str`); ``join=TEXT``, what separates the elements of a
list (default ``", "``); ``none=TEXT``, the text of a JSON ``null``
(without it a ``null`` is an error); ``only=`` (tables of claims, above).
A value with spaces is written in double quotes (``join=" / "``).

``python -m keras_longattn.reproductions.pages --check`` lists the regions
whose text differs from what the files give (and the markers it cannot
read) and exits with status 1 when there is one; ``--write`` rewrites them
in place. Only the standard library is imported (and, for the claims
tables, :mod:`keras_longattn.reproductions.claims`, which needs NumPy).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

try:
    from keras_longattn.reproductions import provenance
except ImportError:  # loaded from its file, outside the package
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_keras_longattn_provenance", Path(__file__).with_name("provenance.py"))
    provenance = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = provenance
    _spec.loader.exec_module(provenance)

__all__ = [
    "KINDS",
    "Mismatch",
    "PageError",
    "Region",
    "Sources",
    "check_pages",
    "default_pages",
    "evaluate",
    "format_value",
    "main",
    "parse_regions",
    "render_page",
    "render_region",
    "resolve_path",
    "write_pages",
]

#: The kinds of region, by the word of their opening marker.
KINDS = ("result", "results-table", "results-provenance", "results-stale")
#: Regions written on lines of their own (their text: a blank line, the
#: generated text, a blank line).
BLOCK_KINDS = ("results-table", "results-provenance", "results-stale")
#: Regions whose text also depends on the package's sources (soft in
#: ``--check`` without ``--strict``).
SOFT_KINDS = ("results-stale",)
#: The folder of the committed results of the notebooks.
RESULTS_DIR = Path("docs") / "results"
#: Sources that are not ``docs/results/<name>.json``.
NAMED_SOURCES = {
    "benchmarks": Path("docs") / "benchmarks" / "results.json",
    "context_parallel": Path("docs") / "parallel" / "context_parallel.json",
    "decode": Path("docs") / "benchmarks" / "decode.json",
    "span_cost": Path("docs") / "benchmarks" / "adaptive_span.json",
}
#: The paper pages, relative to the checkout.
PAGES_GLOB = "papers/*.md"
#: The other pages: those of these Markdown files (relative to the
#: checkout) that hold an opening marker.
DOCS_GLOB = "docs/**/*.md"
OPTIONS = ("fmt", "join", "none", "only")
_FUNCTIONS = {
    "min": min,
    "max": max,
    "abs": abs,
    "round": round,
    "sum": sum,
    "len": len,
    "mean": lambda values: sum(values) / len(values),
}

_OPEN = re.compile(r"<!--\s*(" + "|".join(re.escape(k) for k in KINDS) + r")\b(.*?)-->", re.S)
_CLOSE = re.compile(r"<!--\s*/(" + "|".join(re.escape(k) for k in KINDS) + r")\s*-->")
_FENCE = re.compile(r"^[ \t]{0,3}(`{3,}|~{3,})", re.M)
_SOURCE = re.compile(r"^\s*([A-Za-z0-9_][A-Za-z0-9_.-]*)\s*(?::(.*))?$", re.S)
_OPTION = re.compile(r"\s+(" + "|".join(OPTIONS) + r')=("([^"]*)"|\S+)\s*$')
_REFERENCE = re.compile(r"\{([^{}]+)\}")
_SEGMENT = re.compile(r"\[([^\]]*)\]|([^.\[\]\s]+)")
_LINE_START = re.compile(r"^[ \t]*(?:(?:[-*+]|\d{1,9}[.)])[ \t]+|>[ \t]*)*$")


class PageError(ValueError):
    """A marker that cannot be read, or a value the files do not give."""


@dataclasses.dataclass(frozen=True)
class Region:
    """One generated region of a page.

    Attributes:
        kind: one of :data:`KINDS`.
        spec: the opening marker's text after the kind (``linformer:claims``).
        start: offset of the region's text (just after the opening marker).
        end: offset of the closing marker (the text is ``page[start:end]``).
        line: the line of the opening marker (from 1).
        text: the region's text as it is on the page.
    """

    kind: str
    spec: str
    start: int
    end: int
    line: int
    text: str

    def label(self) -> str:
        """``<kind> <spec>``, as the opening marker reads."""
        return f"{self.kind} {self.spec}"


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """A region whose text is not what the files give, or that cannot be
    generated.

    Attributes:
        page: the page's path.
        line: the line of the region's opening marker.
        label: the opening marker's kind and spec.
        found: the region's text on the page.
        expected: the text the files give (``None`` with ``error``).
        error: why the region cannot be generated (``None`` otherwise).
        soft: ``True`` for a ``results-stale`` region (an error only with
            ``--strict``).
    """

    page: Path
    line: int
    label: str
    found: str
    expected: str | None = None
    error: str | None = None
    soft: bool = False

    def describe(self) -> str:
        """A few lines for ``--check``'s report."""
        head = f"{self.page}:{self.line}: {self.label}"
        if self.error is not None:
            return f"{head}\n    error: {self.error}"
        note = (" (stale note: refresh with --write; an error only with --strict)"
                if self.soft else "")
        return (f"{head}{note}\n    page:  {_one_line(self.found)}\n"
                f"    files: {_one_line(self.expected)}")


def _one_line(text: str | None) -> str:
    text = (text or "").strip()
    return text if len(text) <= 200 and "\n" not in text else repr(text[:200])


# ---------------------------------------------------------------------------
# Markers
# ---------------------------------------------------------------------------


def _fenced_spans(text: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` offsets of the fenced code blocks of ``text``."""
    spans = []
    opened = None
    for match in _FENCE.finditer(text):
        fence = match.group(1)
        if opened is None:
            opened = (match.start(), fence[0], len(fence))
        elif fence[0] == opened[1] and len(fence) >= opened[2]:
            line_end = text.find("\n", match.end())
            spans.append((opened[0], len(text) if line_end < 0 else line_end))
            opened = None
    if opened is not None:
        spans.append((opened[0], len(text)))
    return spans


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def parse_regions(text: str) -> list[Region]:
    """The regions of a page's text, in order (markers inside fenced code
    blocks are text, not markers).

    Raises:
        PageError: on an opening marker without its closing one (or with
            another opening marker before it), a closing marker without an
            opening one, or an inline ``result`` marker first on its line.
    """
    fences = _fenced_spans(text)

    def fenced(offset: int) -> bool:
        return any(start <= offset < end for start, end in fences)

    opens = [m for m in _OPEN.finditer(text) if not fenced(m.start())]
    closes = [m for m in _CLOSE.finditer(text) if not fenced(m.start())]
    events = sorted([(m.start(), "open", m) for m in opens]
                    + [(m.start(), "close", m) for m in closes], key=lambda e: e[0])
    regions = []
    current = None
    for offset, what, match in events:
        line = _line_of(text, offset)
        if what == "open":
            if current is not None:
                raise PageError(
                    f"line {line}: '<!-- {match.group(1)} ...' opens a region inside the "
                    f"'{current.group(1)}' region of line {_line_of(text, current.start())}, "
                    f"which is not closed (expected '<!-- /{current.group(1)} -->' first)")
            current = match
            continue
        if current is None:
            raise PageError(f"line {line}: '<!-- /{match.group(1)} -->' closes no region")
        if match.group(1) != current.group(1):
            raise PageError(
                f"line {line}: '<!-- /{match.group(1)} -->' closes the "
                f"'{current.group(1)}' region of line {_line_of(text, current.start())}")
        kind = current.group(1)
        spec = " ".join(current.group(2).split())
        open_line = _line_of(text, current.start())
        if kind == "result":
            before = text[text.rfind("\n", 0, current.start()) + 1:current.start()]
            if _LINE_START.match(before):
                raise PageError(
                    f"line {open_line}: '<!-- result {spec} -->' is first on its line, where "
                    "Markdown reads it as the start of an HTML block: put a word before it")
        regions.append(Region(kind, spec, current.end(), match.start(), open_line,
                              text[current.end():match.start()]))
        current = None
    if current is not None:
        raise PageError(f"line {_line_of(text, current.start())}: '<!-- {current.group(1)} ...' "
                        f"is not closed (expected '<!-- /{current.group(1)} -->')")
    return regions


def _split_options(spec: str) -> tuple[str, dict[str, str]]:
    """``spec`` without its trailing ``name=value`` options, and the options."""
    options: dict[str, str] = {}
    rest = " " + spec
    while True:
        match = _OPTION.search(rest)
        if match is None:
            break
        name = match.group(1)
        if name in options:
            raise PageError(f"option {name}= is given twice in '{spec}'")
        options[name] = match.group(3) if match.group(3) is not None else match.group(2)
        rest = rest[:match.start()]
    return rest.strip(), options


def _source_and_rest(spec: str, kind: str) -> tuple[str, str]:
    match = _SOURCE.match(spec)
    if match is None:
        raise PageError(f"'{kind} {spec}': expected 'NAME:PATH' (NAME a results file, e.g. "
                        "'linformer', or 'benchmarks')")
    return match.group(1), (match.group(2) or "").strip()


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------


class Sources:
    """The JSON files regions read, loaded once each.

    Args:
        root: the checkout holding ``docs/`` (default: the folder holding the
            ``keras_longattn`` package).
        compute_fingerprints: whether a stale region may fingerprint the
            layers of a result whose library files changed (seconds per
            layer); by default it reads only those ``keras-longattn
            reproduce --stale`` cached, and says "Not checked" without them.
    """

    def __init__(self, root: str | os.PathLike | None = None, *,
                 compute_fingerprints: bool = False):
        self.root = Path(root).resolve() if root is not None else provenance.PACKAGE_PARENT
        self.compute_fingerprints = compute_fingerprints
        self._loaded: dict[str, Any] = {}

    def path(self, name: str) -> Path:
        """The file of source ``name``."""
        relative = NAMED_SOURCES.get(name, RESULTS_DIR / f"{name}.json")
        return self.root / relative

    def load(self, name: str) -> Any:
        """The parsed JSON of source ``name``.

        Raises:
            PageError: if the file is missing or is not valid JSON.
        """
        if name not in self._loaded:
            path = self.path(name)
            if not path.is_file():
                raise PageError(f"source '{name}': no file {self._show(path)}")
            try:
                self._loaded[name] = json.loads(path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as error:
                raise PageError(f"source '{name}': {self._show(path)} is not valid JSON: "
                                f"{error}") from None
        return self._loaded[name]

    def _show(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)


def _matches(value: Any, wanted: str) -> bool:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value] == wanted.lower()
    if isinstance(value, (int, float)):
        try:
            return float(wanted) == float(value)
        except ValueError:
            return False
    return str(value) == wanted


def _keys(value: dict) -> str:
    keys = list(value)
    shown = ", ".join(str(k) for k in keys[:12])
    return shown + (f", ... ({len(keys)} keys)" if len(keys) > 12 else "")


class _Many(list):
    """The values an ``[all:...]`` filter picked: later segments apply to each."""


def _step(value: Any, segment: str, bracket: str | None, name: str | None, where: str) -> Any:
    if isinstance(value, _Many):
        return _Many(_step(item, segment, bracket, name, where) for item in value)
    if bracket is not None and "=" in bracket:
        every = bracket.startswith("all:")
        conditions = []
        for part in bracket[4 if every else 0:].split(","):
            field, _, wanted = part.partition("=")
            if not field.strip():
                raise PageError(f"{where}, the filter {segment} has an empty field name")
            conditions.append((field.strip(), wanted.strip()))
        if not isinstance(value, list):
            raise PageError(f"{where}, the filter {segment} needs a list, found "
                            f"{type(value).__name__}")
        found = [item for item in value if isinstance(item, dict)
                 and all(field in item and _matches(item[field], wanted)
                         for field, wanted in conditions)]
        if every:
            if not found:
                raise PageError(f"{where}, the filter {segment} matches no element")
            return _Many(found)
        if len(found) != 1:
            raise PageError(f"{where}, the filter {segment} matches {len(found)} elements "
                            "(it must match exactly one; [all:...] takes every match)")
        return found[0]
    key = bracket if bracket is not None else name
    if isinstance(value, list):
        try:
            index = int(key)
        except ValueError:
            raise PageError(f"{where}, '{key}' is not an index of a list of "
                            f"{len(value)}") from None
        if not -len(value) <= index < len(value):
            raise PageError(f"{where}, index {index} is outside the list of {len(value)}")
        return value[index]
    if isinstance(value, dict):
        if key not in value:
            raise PageError(f"{where}, no key '{key}' (keys: {_keys(value)})")
        return value[key]
    raise PageError(f"{where}, '{key}' reads into a {type(value).__name__} ({value!r})")


def resolve_path(document: Any, path: str) -> Any:
    """The value at ``path`` (see the module's docstring) in ``document``.

    Raises:
        PageError: if the path cannot be read or leads nowhere.
    """
    if not path.strip():
        raise PageError("empty path")
    value = document
    position = 0
    walked = ""
    while position < len(path):
        if walked and path[position] == ".":
            position += 1
        match = _SEGMENT.match(path, position)
        if match is None or match.end() == position:
            raise PageError(f"path '{path}': cannot read it at character {position + 1} "
                            f"('{path[position:]}')")
        position = match.end()
        where = f"path '{path}': at '{walked or '(top)'}'"
        value = _step(value, match.group(0), match.group(1), match.group(2), where)
        walked = path[:position]
    return list(value) if isinstance(value, _Many) else value


_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load,
                  ast.Call, ast.Tuple, ast.List, ast.Add, ast.Sub, ast.Mult, ast.Div,
                  ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd)


def evaluate(document: Any, expression: str) -> Any:
    """The value of ``expression``: a path, or arithmetic over ``{path}``
    references (see the module's docstring), read in ``document``.

    Raises:
        PageError: if a path cannot be read, or the expression holds
            anything but numbers, references, arithmetic operators and the
            allowed functions, or its arithmetic fails.
    """
    if "{" not in expression and "}" not in expression:
        return resolve_path(document, expression.strip())
    names: dict[str, Any] = {}

    def substitute(match: re.Match) -> str:
        name = f"_v{len(names)}"
        names[name] = resolve_path(document, match.group(1).strip())
        return name

    source = _REFERENCE.sub(substitute, expression)
    if "{" in source or "}" in source:
        raise PageError(f"expression '{expression}': unbalanced braces")
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError as error:
        raise PageError(f"expression '{expression}': {error.msg}") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise PageError(f"expression '{expression}': {type(node).__name__} is not allowed "
                            "(numbers, {path} references, + - * / // % **, and "
                            f"{', '.join(sorted(_FUNCTIONS))} only)")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)):
            raise PageError(f"expression '{expression}': the constant {node.value!r} is not a "
                            "number")
        if isinstance(node, ast.Name) and node.id not in names and node.id not in _FUNCTIONS:
            raise PageError(f"expression '{expression}': unknown name '{node.id}' (a path "
                            "goes in braces: {metrics.x})")
        if isinstance(node, ast.Call) and (not isinstance(node.func, ast.Name)
                                           or node.func.id not in _FUNCTIONS or node.keywords):
            raise PageError(f"expression '{expression}': only {', '.join(sorted(_FUNCTIONS))} "
                            "may be called, with positional arguments")
    try:
        return eval(compile(tree, "<region>", "eval"),  # noqa: S307 (nodes checked above)
                    {"__builtins__": {}}, {**_FUNCTIONS, **names})
    except Exception as error:  # arithmetic on the files' values: report, do not crash
        raise PageError(f"expression '{expression}': {type(error).__name__}: {error}") from None


def format_value(value: Any, fmt: str | None = None, join: str = ", ",
                 none: str | None = None) -> str:
    """``value`` as a region's text: ``format(value, fmt)`` (``str`` without
    ``fmt``); a list's elements joined by ``join``; ``null`` as ``none``.

    Raises:
        PageError: for a ``null`` without ``none``, an object, a non-finite
            number, or a format the value does not take.
    """
    if isinstance(value, (list, tuple)):
        return join.join(format_value(item, fmt, join, none) for item in value)
    if value is None:
        if none is None:
            raise PageError("the value is null (give none=TEXT to write one)")
        return none
    if isinstance(value, dict):
        raise PageError(f"the value is an object (keys: {_keys(value)}), not a number or a "
                        "text: the path must go further")
    if isinstance(value, float) and not math.isfinite(value):
        raise PageError(f"the value is {value}")
    if fmt is None:
        return str(value)
    try:
        return format(value, fmt)
    except (ValueError, TypeError) as error:
        raise PageError(f"fmt={fmt} does not format {value!r}: {error}") from None


def _claims_table(claims: Any, only: str | None) -> str:
    if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
        raise PageError("'claims' is not a list of claims")
    if only is not None:
        names = [c.get("name") for c in claims]
        # a name may hold commas ("rates_1/4,1/4,1/4,1/4"): a whole name first
        wanted = [only] if only in names else [n.strip() for n in only.split(",") if n.strip()]
        missing = [name for name in wanted if name not in names]
        if missing:
            raise PageError(f"only={only}: no claim named {', '.join(missing)} "
                            f"(claims: {', '.join(str(n) for n in names)})")
        claims = [c for c in claims if c.get("name") in wanted]
    from keras_longattn.reproductions.claims import Claim, claims_table

    rows = []
    for claim in claims:
        try:
            rows.append(Claim(name=claim.get("name"), statement=claim["statement"],
                              paper=claim.get("paper"), ours=claim["ours"],
                              verdict=claim["verdict"],
                              asserted=bool(claim.get("asserted")),
                              detail=str(claim.get("detail") or "")))
        except KeyError as error:
            raise PageError(f"claim {claim.get('name')!r} has no {error.args[0]!r}") from None
        except ValueError as error:
            raise PageError(f"claim {claim.get('name')!r}: {error}") from None
    return claims_table(rows)


def _provenance_sentence(name: str, sources: Sources) -> str:
    results = sources.load(name)
    shown = sources._show(sources.path(name))
    if not isinstance(results, dict):
        raise PageError(f"source '{name}' is not a JSON object")
    record = results.get(provenance.PROVENANCE_KEY)
    if not isinstance(record, dict):
        backend = results.get("backend")
        on = f" (backend {backend})" if backend else ""
        return (f"Committed run: `{shown}`{on} holds no provenance record: the commit and "
                "the date it ran on are not recorded.")
    parts = [f"Committed run: `{shown}`"]
    commit = record.get("commit")
    if commit:
        dirty = record.get("dirty_sources")
        parts.append(f"commit `{commit[:10]}`"
                     + (f" with uncommitted changes to {', '.join(dirty)}" if dirty else ""))
    else:
        parts.append("no commit recorded")
    if record.get("date"):
        parts.append(str(record["date"]))
    if record.get("backend"):
        parts.append(f"backend {record['backend']}")
    machine = record.get("machine")
    if isinstance(machine, dict) and machine.get("processor"):
        cpus = machine.get("usable_cpus")
        parts.append(f"{machine['processor']}" + (f", {cpus} usable CPUs" if cpus else ""))
    text = ", ".join(parts) + "."
    notebook = record.get("notebook")
    if isinstance(notebook, dict):
        if notebook.get("committed"):
            text += (f" Its checks (thresholds, margins, steps, seeds) are those of "
                     f"`{notebook.get('path')}` as committed"
                     + (f" at `{commit[:10]}`" if commit else "") + ", before it ran.")
        else:
            text += (f" `{notebook.get('path')}` differed from its last commit when it ran: "
                     "its checks were not pre-registered.")
    behaviour = record.get("behaviour")
    if isinstance(behaviour, dict) and isinstance(behaviour.get("subjects"), list):
        text += (f" Behaviour fingerprints of the {len(behaviour['subjects'])} layer and model "
                 "configurations it used are recorded"
                 + (f" ({behaviour['bootstrap']})" if behaviour.get("bootstrap") else "") + ".")
    return text + _history_text(results)


def _history_text(results: Mapping[str, Any]) -> str:
    """The earlier runs a results file keeps (``history``): each one's
    commit, the checks that differ from this run's, and its failed asserted
    claims."""
    history = [entry for entry in results.get("history") or [] if isinstance(entry, dict)]
    if not history:
        return ""
    current = results.get("parameters") or {}
    lines = []
    for entry in history:
        commit = entry.get("commit")
        changed = {k: v for k, v in (entry.get("parameters") or {}).items()
                   if current.get(k) != v}
        where = f"at `{commit[:10]}`" if commit else "(no commit recorded)"
        checks = (", ".join(f"`{k} = {v!r}`" for k, v in sorted(changed.items()))
                  or "the same checks")
        failed = entry.get("failed") or []
        outcome = (f"failed {', '.join(f'`{n}`' for n in failed)}" if failed
                   else "no asserted claim failed")
        claims = {c.get("name"): c for c in entry.get("claims") or [] if isinstance(c, dict)}
        measured = "; ".join(f"`{n}`: {claims[n].get('verdict')}, {claims[n].get('ours')}"
                             for n in failed if n in claims and claims[n].get("ours"))
        line = f"a run {where} under {checks}: {outcome}" + (f" ({measured})" if measured else "")
        if entry.get("reconstructed"):
            note = str(entry["reconstructed"]).rstrip(".")
            line += f" ({note[:1].upper() + note[1:]})"
        lines.append(line)
    return " Earlier runs, kept in the results' history: " + "; ".join(lines) + "."


def _stale_sentence(name: str, sources: Sources) -> str:
    path = sources.path(name)
    if not path.is_file():
        raise PageError(f"source '{name}': no file {sources._show(path)}")
    check = provenance.check_results(path, sources.root, compute=sources.compute_fingerprints)
    if check.stale:
        return check.note()
    if check.behaviour_files:
        return (f"Up to date by behaviour: {len(check.behaviour_files)} library files this run "
                "imported changed since, and the fingerprints of every layer and model it used "
                "agree with today's code.")
    return "Up to date: no source file this run depends on has changed since."


def render_region(region: Region, sources: Sources) -> str:
    """The text the files give for ``region`` (block regions: a blank line,
    the generated text, a blank line).

    Raises:
        PageError: if the marker cannot be read or the files do not give the
            value.
    """
    try:
        if region.kind == "result":
            rest, options = _split_options(region.spec)
            name, expression = _source_and_rest(rest, region.kind)
            if not expression:
                raise PageError("expected 'NAME:PATH' or 'NAME:EXPRESSION'")
            if "only" in options:
                raise PageError("only= is an option of results-table")
            value = evaluate(sources.load(name), expression)
            return format_value(value, options.get("fmt"), options.get("join", ", "),
                                options.get("none"))
        if region.kind == "results-table":
            rest, options = _split_options(region.spec)
            name, path = _source_and_rest(rest, region.kind)
            unknown = set(options) - {"only"}
            if unknown:
                raise PageError(f"results-table takes only=, not {', '.join(sorted(unknown))}=")
            if path == "claims":
                body = _claims_table(resolve_path(sources.load(name), "claims"),
                                     options.get("only"))
            else:
                if "only" in options:
                    raise PageError("only= applies to 'claims' tables")
                value = resolve_path(sources.load(name), path)
                if not isinstance(value, str):
                    raise PageError(f"'{path}' is a {type(value).__name__}, not a table's text")
                body = value.strip()
        else:
            rest, options = _split_options(region.spec)
            if options or ":" in rest or not rest:
                raise PageError(f"expected '{region.kind} NAME' (NAME a results file)")
            name = rest
            body = (_provenance_sentence(name, sources) if region.kind == "results-provenance"
                    else _stale_sentence(name, sources))
    except PageError as error:
        raise PageError(f"{region.label()}: {error}") from None
    return f"\n\n{body}\n\n" if region.kind in BLOCK_KINDS else body


def render_page(text: str, sources: Sources) -> str:
    """``text`` with every region's text replaced by what the files give.

    Raises:
        PageError: as :func:`parse_regions` and :func:`render_region`.
    """
    pieces = []
    last = 0
    for region in parse_regions(text):
        pieces.append(text[last:region.start])
        pieces.append(render_region(region, sources))
        last = region.end
    pieces.append(text[last:])
    return "".join(pieces)


# ---------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------


def default_pages(root: str | os.PathLike | None = None) -> list[Path]:
    """The paper pages of the checkout ``root`` (``papers/*.md``), by name,
    then the pages of :data:`DOCS_GLOB` that hold an opening marker (outside
    a fenced code block), by path."""
    root = Path(root).resolve() if root is not None else provenance.PACKAGE_PARENT
    others = []
    for page in sorted(root.glob(DOCS_GLOB)):
        if RESULTS_DIR.parts[-1] in page.relative_to(root).parts[1:-1]:
            continue
        text = page.read_text(encoding="utf-8")
        fences = _fenced_spans(text)
        if any(not any(start <= m.start() < end for start, end in fences)
               for m in _OPEN.finditer(text)):
            others.append(page)
    return sorted(root.glob(PAGES_GLOB)) + others


def _page_mismatches(page: Path, sources: Sources) -> list[Mismatch]:
    text = page.read_text(encoding="utf-8")
    try:
        regions = parse_regions(text)
    except PageError as error:
        line = re.match(r"line (\d+)", str(error))
        return [Mismatch(page, int(line.group(1)) if line else 1, "markers", "", error=str(error))]
    found = []
    for region in regions:
        try:
            expected = render_region(region, sources)
        except PageError as error:
            found.append(Mismatch(page, region.line, region.label(), region.text, error=str(error)))
            continue
        if expected != region.text:
            found.append(Mismatch(page, region.line, region.label(), region.text, expected,
                                  soft=region.kind in SOFT_KINDS))
    return found


def check_pages(pages: Iterable[str | os.PathLike] | None = None,
                root: str | os.PathLike | None = None) -> list[Mismatch]:
    """The regions of ``pages`` (default: :func:`default_pages`) whose text
    is not what the files under ``root`` give, and those that cannot be
    generated; an empty list when every page is in sync."""
    sources = Sources(root)
    pages = default_pages(sources.root) if pages is None else [Path(p) for p in pages]
    found = []
    for page in pages:
        found.extend(_page_mismatches(page, sources))
    return found


def write_pages(pages: Iterable[str | os.PathLike] | None = None,
                root: str | os.PathLike | None = None, *,
                compute_fingerprints: bool = True) -> list[Path]:
    """Rewrites the regions of ``pages`` (default: :func:`default_pages`)
    from the files under ``root``; returns the pages that changed. A page
    with a region that cannot be generated is left as it is. Its stale
    notes compare behaviour (``compute_fingerprints``, see :class:`Sources`).

    Raises:
        PageError: naming the page, for the first page with a region that
            cannot be generated (the pages before it are written).
    """
    sources = Sources(root, compute_fingerprints=compute_fingerprints)
    pages = default_pages(sources.root) if pages is None else [Path(p) for p in pages]
    changed = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        try:
            new = render_page(text, sources)
        except PageError as error:
            raise PageError(f"{page}: {error}") from None
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(page)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``--check`` (status 1 when a region differs or
    cannot be generated) or ``--write``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_longattn.reproductions.pages",
        description="Generate the numbers of the paper pages (papers/*.md) from the committed "
                    "results files (docs/results/*.json, docs/benchmarks/results.json).")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="list the regions whose text differs from what the files give; "
                           "exit with status 1 if there is one")
    mode.add_argument("--write", action="store_true", help="rewrite the regions in place")
    parser.add_argument("--strict", action="store_true",
                        help="with --check: an outdated stale note is an error too")
    parser.add_argument("--root", default=None,
                        help="the checkout holding papers/ and docs/ (default: the one this "
                             "package is imported from)")
    parser.add_argument("pages", nargs="*", help="pages to process (default: papers/*.md)")
    args = parser.parse_args(argv)
    pages = args.pages or None
    if args.write:
        try:
            changed = write_pages(pages, args.root)
        except PageError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        for page in changed:
            print(f"rewrote {page}")
        return 0
    found = check_pages(pages, args.root)
    errors = [m for m in found if not m.soft or args.strict]
    for mismatch in found:
        print(mismatch.describe())
    if errors:
        print(f"{len(errors)} region(s) differ from the files or cannot be generated: run "
              "'python -m keras_longattn.reproductions.pages --write' (or fix the marker).",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
