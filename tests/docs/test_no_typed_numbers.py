"""No measured number of ours is typed into the documentation.

Every number this project measured that a page of ``docs/`` or ``papers/``
quotes comes from a committed file, through a generated region of
:mod:`keras_longattn.reproductions.pages` (``<!-- result NAME:PATH -->``,
``<!-- results-table ... -->``); a number typed into the prose goes stale
with the next run and nothing notices. This test reads every Markdown page
of ``docs/`` and ``papers/`` (not ``docs/results/``) and fails on a
*measurement-like* number that no rule below allows. When a rule is too
narrow for a page, the page is reworded (a number written in words, a
parameter in code, the paper named) rather than the rule widened.

**What is looked at.** The page with these parts blanked out first:
generated regions and every other HTML comment, fenced code blocks,
inline code, link targets ``](...)``, ``$...$`` math, and the sections
that hold the paper's claims (rule 1). A number is *measurement-like*
when it has a decimal point (``0.63``, ``1.5``), is written ``±`` after
another, or carries a unit of a measurement right after it: ``x`` / ``×``
(a ratio; not ``2 × 64``, a shape), ``%``, a unit of time (``ns``, ``µs``,
``ms``, ``s``, ``min``), of memory (``KiB`` ... ``GiB``, ``KB`` ...
``GB``), of work (``GFLOP``...), ``bits``, ``nats``, ``points`` or
``tokens/s``. Whole numbers without a unit (counts, sizes, seeds, years)
and numbers in exponent form (``1e-5``, tolerances) are not looked at.

**Allowed** (each rule is a regular expression of this module):

1. *The paper's numbers.* In a sentence (a table row counts as one) that
   names the paper before the number (:data:`PAPER_LABEL`: "the paper",
   "paper's", "the authors", "Table 3", "Figure 1"), with no word of ours
   (:data:`OURS`: "ours", "we", "here", "measured", "the notebook", ...)
   between the label and the number; in a table column whose header names
   the paper; and in a section headed "What the paper claims"
   (:data:`PAPER_SECTION`), up to the next heading of its level.
2. *Set-up parameters and thresholds* (:data:`SETUP`, on the text right
   before the number): after ``=``, ``<``, ``>``, ``≤``, ``≥``, "at
   least", "at most", "needs", "margin", "threshold", "chance", "first",
   "last", "default", or a parameter's name (window, rate, decay, dropout,
   α, tolerance, ...); and a number joined to a name by a hyphen
   (``1.5-entmax``, ``CIFAR-10``, ``5-point``).
3. *Versions and citations* (:data:`VERSION`): after "version", ``v`` or
   ``arXiv:``, or a package name (keras, jax, torch, ...) earlier in the
   same clause, when no unit follows (``torch 2.13``, "a torch before
   2.5"); dotted versions of three parts (``1.11.0``) never match a number.

A number that none of these allows is generated or removed. Run
``python tests/docs/test_no_typed_numbers.py`` to list them. The same
module checks that no page names an absolute path of a machine
(:data:`MACHINE_PATH`), and that the generated benchmark page leaves out
the run files named by one.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from keras_longattn.reproductions import pages  # noqa: E402

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

#: The pages read: every Markdown file of these folders (results/ holds
#: no page).
FOLDERS = ("docs", "papers")
SKIP_PARTS = ("results", "__pycache__")

_UNIT = (r"(?:x(?!\w|\s*\d)|×(?!\s*\d)|%|ns\b|µs\b|us\b|ms\b|s\b|sec\b|min\b|"
         r"[KMGT]i?B\b|[GMT]?FLOPs?\b|bits?\b|bits/|nats?\b|points?\b|tokens/s\b)")
#: A number (with thousands separators and a decimal part) and what follows.
NUMBER = re.compile(r"(?<![\w.,/^])(\d(?:[\d,]*\d)?(?:\.\d+)?)(?![\w.]*\d)")
MEASURE_UNIT = re.compile(r"\s?" + _UNIT)

#: Rule 1: words that name the paper (or its authors, tables and figures).
PAPER_LABEL = re.compile(r"\bpaper'?s?\b|\bauthors'?\b|\bTable \d|\bFigure \d|\bthe original\b",
                         re.I)
#: Rule 1, by section: a heading that says the section holds the paper's
#: claims ("## What the paper claims"); its numbers, up to the next heading
#: of the same or a higher level, are the paper's.
PAPER_SECTION = re.compile(r"^(#{1,6})\s+(?:What the paper claims|The paper'?s? (?:claims|results))",
                           re.I | re.M)
_HEADING = re.compile(r"^(#{1,6})\s", re.M)
#: Words of ours that end the reach of a paper label in a sentence.
OURS = re.compile(r"\b(?:ours?|we|here|this project|the reproduction|the notebook|"
                  r"measured|this machine|our run|the run)\b", re.I)
#: Rule 2: set-up parameters and thresholds, the text right before the number.
SETUP = re.compile(
    r"(?:[=<>≤≥]\s*|\bat (?:least|most)\s+|\bneeds?\s+|\bmargin (?:of )?|\bthreshold (?:of )?|"
    r"\b(?:window|rate|decay|dropout|α|alpha|temperature|tolerance|epsilon|eps|scale|"
    r"weight decay|learning rate|momentum|beta[12]?|ratio|fraction|factor|"
    r"clip(?:norm)?|default|init(?:ial)?|starts? at|first|last)\s+|\bchance\W{0,3})$", re.I)
#: Rule 3: versions and citations, the text right before the number.
VERSION = re.compile(
    r"(?:\bv|\bversion\s+|arXiv:\s*)$|\b(?:keras|jax|jaxlib|tensorflow|torch|pytorch|numpy|"
    r"python|cuda|cudnn|triton|mkdocs|pallas|xla|TorchInductor|local-attention|"
    r"routing-transformer|product-key-memory|gensim|scikit-learn|matplotlib)\b[^.;]{0,40}$",
    re.I)

_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_LINK_TARGET = re.compile(r"\]\([^)]*\)")
_MATH = re.compile(r"\$[^$\n]+\$")
_SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z(*`\[])|\n\s*\n|\n\s*[-*+]\s|\n\s*\d+\.\s|\|")


def _blank(text: str, start: int, end: int) -> str:
    """``text`` with ``[start, end)`` replaced by spaces (newlines kept)."""
    return text[:start] + re.sub(r"[^\n]", " ", text[start:end]) + text[end:]


def visible_prose(text: str) -> str:
    """The page's text with generated regions, comments, code, link targets
    and math blanked out (offsets and lines kept)."""
    for region in pages.parse_regions(text):
        text = _blank(text, region.start, region.end)
    for start, end in pages._fenced_spans(text):
        text = _blank(text, start, end)
    for pattern in (_COMMENT, _CODE_SPAN, _LINK_TARGET, _MATH):
        for match in list(pattern.finditer(text)):
            text = _blank(text, match.start(), match.end())
    return text


def _sentence_start(text: str, offset: int) -> int:
    start = 0
    for match in _SENTENCE_END.finditer(text, 0, offset):
        start = match.end()
    return start


def _paper_columns(lines: list[str], index: int) -> set[int]:
    """The columns whose header names the paper, for a table row at
    ``lines[index]`` (an empty set outside tables)."""
    row = index
    while row > 0 and lines[row - 1].lstrip().startswith("|"):
        row -= 1
    header = lines[row]
    if not header.lstrip().startswith("|") or row == index:
        return set()
    cells = header.strip().strip("|").split("|")
    return {i for i, cell in enumerate(cells) if PAPER_LABEL.search(cell)}


def _measurement_like(text: str, match: re.Match) -> bool:
    value = match.group(1)
    after = text[match.end():match.end() + 12]
    before = text[max(0, match.start() - 3):match.start()]
    if "." in value or "±" in before or after.lstrip().startswith("±"):
        return True
    return MEASURE_UNIT.match(after) is not None


def _allowed(text: str, match: re.Match, lines: list[str]) -> bool:
    start = match.start()
    before_line = text[text.rfind("\n", 0, start) + 1:start]
    before = " ".join(text[max(0, start - 80):start].split()) + (
        " " if text[start - 1:start].isspace() else "")
    after = text[match.end():match.end() + 2]
    # joined to a name by a hyphen: 1.5-entmax, CIFAR-10, GPT-2
    if re.match(r"-[A-Za-z]", after) or re.search(r"[A-Za-z]-$", before):
        return True
    if SETUP.search(before[-40:]):
        return True
    if VERSION.search(before[-50:]) and not MEASURE_UNIT.match(text[match.end():]):
        return True
    sentence_start = _sentence_start(text, start)
    sentence = text[sentence_start:start]
    label = None
    for label in PAPER_LABEL.finditer(sentence):
        pass
    if label is not None and not OURS.search(sentence[label.end():]):
        return True
    # a table cell in a column headed "paper"
    if before_line.lstrip().startswith("|"):
        line_index = text.count("\n", 0, start)
        column = before_line.count("|") - 1
        if column in _paper_columns(lines, line_index):
            return True
    return False


def _paper_sections(text: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` offsets of the sections whose heading says they
    hold the paper's claims (:data:`PAPER_SECTION`)."""
    spans = []
    for match in PAPER_SECTION.finditer(text):
        level = len(match.group(1))
        end = len(text)
        for heading in _HEADING.finditer(text, match.end()):
            if len(heading.group(1)) <= level:
                end = heading.start()
                break
        spans.append((match.start(), end))
    return spans


def typed_numbers(text: str) -> list[tuple[int, str, str]]:
    """``(line, number, the line's text)`` of every measurement-like number
    of ``text`` that no rule allows."""
    prose = visible_prose(text)
    for start, end in _paper_sections(prose):
        prose = _blank(prose, start, end)
    lines = prose.split("\n")
    found = []
    for match in NUMBER.finditer(prose):
        if not _measurement_like(prose, match) or _allowed(prose, match, lines):
            continue
        line = prose.count("\n", 0, match.start())
        found.append((line + 1, match.group(1), text.split("\n")[line].strip()))
    return found


def doc_pages(root: Path = ROOT) -> list[Path]:
    """The Markdown pages of :data:`FOLDERS`."""
    return sorted(p for folder in FOLDERS for p in (root / folder).rglob("*.md")
                  if not set(SKIP_PARTS) & set(p.relative_to(root).parts))


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_typed_numbers(page):
    found = typed_numbers(page.read_text(encoding="utf-8"))
    assert not found, (
        f"{page.relative_to(ROOT)}: numbers of ours typed into the page (generate them from a "
        "results file with a '<!-- result NAME:PATH -->' region, label them as the paper's, "
        "or remove them):\n" + "\n".join(f"  line {line}: {number}: {context[:160]}"
                                         for line, number, context in found))


#: Sentences of issue #46 that the rules must not allow (typed numbers of
#: ours, one of them beside a paper's number).
ISSUE_EXAMPLES = (
    "In the reproduction notebook (3 seeds, digits of 24 × 24 pixels) it is ahead of dense "
    "attention after the same short training (0.63 ± 0.08 against 0.83 ± 0.07 bits/dim), in "
    "line with the paper's CIFAR-10 result (2.80 bits/dim against 2.82 for dense).",
    "At n = 4096 and k = 128 one layer, forward and backward on jax/CPU, was 17x faster than "
    "full attention with 14x less peak memory (the paper, inference on a V100: 3.4x and 14x).",
    "A query key lands in the cluster of its stored copy 94% of the time, and the model finds "
    "a key stored once in 0.92 of the cases against 0.20 for random clusters.",
    "At n = 16,384, causal window 256, kernel calls interleaved in one process: 43 / 123 ms "
    "(forward / backward).",
    "| full | 29.2 | 22.2 | 50.0 | 81.6 | 50.0 | 46.6 | 72.3 | 306 | 1.00× | 1.00× |",
)


@pytest.mark.parametrize("sentence", ISSUE_EXAMPLES)
def test_the_rules_catch_the_issues_examples(sentence):
    found = [number for _, number, _ in typed_numbers(sentence + "\n")]
    assert found, sentence
    if "paper" in sentence:
        # the paper's own numbers are allowed, ours beside them are not
        assert "2.80" not in found and "3.4" not in found
        assert "0.63" in found or "17" in found


def test_the_rules_allow_labelled_and_generated_numbers():
    text = (
        "The paper reports 2.80 bits/dim (Table 2). With window 256 and dropout 0.1, "
        "at least 1.5x; ours: <!-- result x:metrics.y fmt=.2f -->0.63<!-- /result --> "
        "bits/dim, `1.7x` in code, jax 0.4.30, 1.5-entmax, arXiv:2006.04768.\n\n"
        "```text\n17.9 s\n```\n\n"
        "## What the paper claims\n\nIt is 1.7x faster.\n\n"
        "| layer | paper |\n|---|---|\n| local | 3.48 |\n"
    )
    assert typed_numbers(text) == []


#: Absolute paths of a machine (POSIX homes and scratch folders, Windows
#: user folders): a page names files relative to the checkout.
MACHINE_PATH = re.compile(r"(?<![\w.~])(?:/(?:work|home|Users|tmp|root|mnt|scratch)/|"
                          r"[A-Za-z]:\\Users\\)")


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_machine_paths(page):
    lines = [f"  line {i}: {line.strip()[:160]}"
             for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert not lines, (f"{page.relative_to(ROOT)} names a path of a machine (name files "
                       "relative to the checkout):\n" + "\n".join(lines))


def _gen_figures():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_gen_figures_paths",
                                                  ROOT / "docs" / "gen_figures.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_the_benchmark_page_names_no_machine_path():
    """The generated benchmark page lists the merged runs by file: a run
    file named by an absolute path (the measuring machine's) is left out."""
    gen = _gen_figures()
    document = {"runs": [
        {"file": "/tmp/exp/final/bench-1.json", "config": {}, "started": "2026-11-25T17:20:17"},
        {"file": "C:\\Users\\me\\bench-2.json", "config": {}, "started": "2026-11-25"},
        {"file": "build/bench/latest.json", "config": {}, "started": "2026-11-25"},
    ]}
    text = "\n".join(gen._setting_lines(document, rows=[]))
    assert "/tmp/" not in text and "Users" not in text
    assert "`build/bench/latest.json`" in text



def test_the_notebook_pages_name_no_machine_path():
    """The notebooks' pages show the committed runs' outputs: the machine's
    folders are cut from the paths in them (a failed assert's traceback
    named ``/work/runs/keras_longattn/...``), the checkout-relative rest
    kept; the committed notebooks themselves are left as they are."""
    gen = _gen_figures()
    traceback = "\x1b[32m/work/runs/keras_longattn/reproductions/claims.py:283\x1b[39m"
    assert gen._relative_paths(traceback) == (
        "\x1b[32mkeras_longattn/reproductions/claims.py:283\x1b[39m")
    assert gen._relative_paths("/home/u/.venv/lib/python3.11/site-packages/keras/x.py") == (
        "site-packages/keras/x.py")
    assert gen._relative_paths("https://host.org/work/keras_longattn/") == (
        "https://host.org/work/keras_longattn/")
    for path in sorted((ROOT / "docs" / "results").glob("*.ipynb")):
        notebook = gen._clean_outputs(json.loads(path.read_text(encoding="utf-8")))
        outputs = json.dumps([cell.get("outputs", []) for cell in notebook["cells"]])
        # after an ANSI colour code too ("\u001b[32m/work/...")
        assert not re.search(r"(?:^|[^\w.~/]|\[[0-9;]*m)/(?:work|home|Users|tmp)/",
                             outputs), path.name


if __name__ == "__main__":
    total = 0
    for page in doc_pages():
        for line, number, context in typed_numbers(page.read_text(encoding="utf-8")):
            total += 1
            print(f"{page.relative_to(ROOT)}:{line}: {number}: {context[:150]}")
    print(total, "typed numbers", file=sys.stderr)
