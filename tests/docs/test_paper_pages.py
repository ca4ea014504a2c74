"""The paper pages' generated numbers (`keras_longattn.reproductions.pages`).

The committed pages must match the committed results files (a typed-in or
outdated number in a region fails here); the marker parsing, the values,
the claims tables and the command line are checked on small pages written
to a temporary checkout. Nothing here runs a notebook or imports Keras.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import pages
from keras_longattn.reproductions import provenance

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]
PAPER_NOTEBOOKS = ("adamra", "linformer", "longformer", "routing_transformer",
                   "sparse_transformer", "synthesizer")

RESULTS = {
    "notebook": "demo",
    "backend": "jax",
    "metrics": {"full_acc_mean": 80.13, "k64_acc_mean": 86.35, "missing": None,
                "dotted.key": 7},
    "per_seed": {"accuracy_percent": {"full": {"mean": 80.13, "values": [85.2368, 74.6518]}}},
    "bench": [
        {"backend": "torch", "n": 1024, "causal": True, "ratio": 4.38},
        {"backend": "torch", "n": 2048, "causal": False, "ratio": 8.59},
        {"backend": "jax", "n": 2048, "causal": True, "ratio": 9.1},
    ],
    "table": "| a | b |\n|---|---|\n| 1 | 2 |\n",
    "claims": [
        {"name": "parity", "statement": "k = 64 is not behind full attention",
         "paper": "parity (Table 2)", "ours": "86.4 vs 80.1",
         "verdict": "not testable at this scale", "asserted": False},
        {"name": "bench", "statement": "k = 128 is faster", "paper": "",
         "ours": "17.32x", "verdict": "reproduced", "asserted": True},
    ],
    "wall_time_s": 1811.6,
}

PAGE = """# Demo

Full attention <!-- result demo:metrics.full_acc_mean fmt=.1f -->80.1<!-- /result --> %,
k = 64 <!-- result demo:{metrics.k64_acc_mean} - {metrics.full_acc_mean} fmt=+.1f -->+6.2<!-- /result -->
points ahead; seeds <!-- result demo:per_seed.accuracy_percent.full.values fmt=.1f join=" / " -->85.2 / 74.7<!-- /result -->.

<!-- results-table demo:claims -->

| claim | paper | ours (mean ± spread over seeds) | verdict |
|---|---|---|---|
| k = 64 is not behind full attention | parity (Table 2) | 86.4 vs 80.1 | not testable at this scale |
| k = 128 is faster | — | 17.32x | holds (asserted) |

<!-- /results-table -->

<!-- results-provenance demo -->

Committed run: `docs/results/demo.json` (backend jax) holds no provenance record: the commit and the date it ran on are not recorded.

<!-- /results-provenance -->

<!-- results-stale demo -->

Stale: no provenance recorded for this run.

<!-- /results-stale -->

```
<!-- result demo:not.a.region -->in a code block: text, not a marker<!-- /result -->
```
"""


def _checkout(tmp_path, results=RESULTS, page=PAGE):
    """A checkout with docs/results/demo.json and papers/demo.md."""
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "papers").mkdir()
    (tmp_path / "docs" / "results" / "demo.json").write_text(json.dumps(results))
    page_path = tmp_path / "papers" / "demo.md"
    page_path.write_text(page, encoding="utf-8")
    return page_path


def _set_json(tmp_path, update):
    path = tmp_path / "docs" / "results" / "demo.json"
    results = json.loads(path.read_text())
    update(results)
    path.write_text(json.dumps(results))


# ---------------------------------------------------------------------------
# The committed pages
# ---------------------------------------------------------------------------


def test_committed_pages_match_the_committed_files():
    found = pages.check_pages(root=ROOT)
    errors = [m for m in found if not m.soft]
    assert not errors, "\n".join(m.describe() for m in errors)
    for note in found:  # an outdated stale note: shown, not failed (reproduce --stale's role)
        print(note.describe())


@pytest.mark.parametrize("slug", PAPER_NOTEBOOKS)
def test_paper_page_generates_its_claims_and_provenance(slug):
    """Each notebook's page shows the committed run's claims table, its
    provenance and its stale note as generated regions."""
    regions = pages.parse_regions((ROOT / "papers" / f"{slug}.md").read_text(encoding="utf-8"))
    labels = {region.label() for region in regions}
    assert f"results-table {slug}:claims" in labels
    assert f"results-provenance {slug}" in labels
    assert f"results-stale {slug}" in labels
    assert sum(region.kind == "result" for region in regions) >= 10


@pytest.mark.parametrize("slug", PAPER_NOTEBOOKS)
def test_claims_table_is_the_notebooks_own(slug):
    """The generated claims table is the one the notebook wrote
    (`claims.claims_table`, kept in the results file): the same claims in
    the same order, statement, paper and ours as written; only the verdict
    column is worded by today's rule (`claims.shown_verdict`), which reads
    the stored verdict, the asserted flag and the detail."""
    results = json.loads((ROOT / "docs" / "results" / f"{slug}.json").read_text(encoding="utf-8"))
    region = pages.Region("results-table", f"{slug}:claims", 0, 0, 1, "")
    generated = pages.render_region(region, pages.Sources(ROOT)).strip().splitlines()
    written = results["claims_table"].strip().splitlines()
    assert len(generated) == len(written) == len(results["claims"]) + 2

    def cells(line):
        return line.strip().strip("|").rsplit("|", 1)

    for made, kept, claim in zip(generated[2:], written[2:], results["claims"]):
        assert cells(made)[0] == cells(kept)[0]
        expected = cl.shown_verdict(claim["verdict"], bool(claim.get("asserted")),
                                    claim.get("detail", ""), claim["ours"])
        assert cells(made)[1].strip() == expected + (" (asserted)" if claim.get("asserted") else "")


# ---------------------------------------------------------------------------
# Markers
# ---------------------------------------------------------------------------


def test_parse_regions_reads_inline_and_block_markers():
    regions = pages.parse_regions(PAGE)
    assert [(r.kind, r.spec) for r in regions] == [
        ("result", "demo:metrics.full_acc_mean fmt=.1f"),
        ("result", "demo:{metrics.k64_acc_mean} - {metrics.full_acc_mean} fmt=+.1f"),
        ("result", 'demo:per_seed.accuracy_percent.full.values fmt=.1f join=" / "'),
        ("results-table", "demo:claims"),
        ("results-provenance", "demo"),
        ("results-stale", "demo"),
    ]
    assert regions[0].text == "80.1"
    assert regions[0].line == 3
    assert regions[3].text.startswith("\n\n| claim |")
    assert PAGE[regions[0].start:regions[0].end] == "80.1"


@pytest.mark.parametrize("text, message", [
    ("a <!-- result demo:x -->1", "is not closed"),
    ("a 1<!-- /result -->", "closes no region"),
    ("a <!-- result demo:x -->1 <!-- result demo:y -->2<!-- /result -->",
     "inside the 'result' region"),
    ("<!-- results-table demo:claims -->\n<!-- /result -->", "closes the 'results-table' region"),
    ("<!-- result demo:x -->1<!-- /result --> is first", "first on its line"),
    ("- <!-- result demo:x -->1<!-- /result --> in a list item", "first on its line"),
])
def test_parse_regions_refuses_broken_markers(text, message):
    with pytest.raises(pages.PageError, match=re.escape(message)):
        pages.parse_regions(text)


def test_markers_in_code_blocks_are_text():
    text = "```\n<!-- result demo:x -->1\n```\nand a <!-- result demo:y -->2<!-- /result -->\n"
    assert [r.spec for r in pages.parse_regions(text)] == ["demo:y"]


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("expression, expected", [
    ("metrics.full_acc_mean", 80.13),
    ("metrics.[dotted.key]", 7),
    ("per_seed.accuracy_percent.full.values.1", 74.6518),
    ("bench[backend=torch,n=2048].ratio", 8.59),
    ("bench[backend=torch,causal=true].n", 1024),
    ("bench[n=2048.0,causal=false].backend", "torch"),
    ("{metrics.k64_acc_mean} - {metrics.full_acc_mean}", 86.35 - 80.13),
    ("{wall_time_s} / 60", 1811.6 / 60),
    ("max({per_seed.accuracy_percent.full.values}) - min({per_seed.accuracy_percent.full.values})",
     85.2368 - 74.6518),
    ("mean({per_seed.accuracy_percent.full.values})", (85.2368 + 74.6518) / 2),
    ("mean({bench[all:backend=torch].ratio})", (4.38 + 8.59) / 2),
    ("bench[all:causal=true].backend", ["torch", "jax"]),
])
def test_evaluate(expression, expected):
    value = pages.evaluate(RESULTS, expression)
    assert value == (pytest.approx(expected) if isinstance(expected, float) else expected)


@pytest.mark.parametrize("expression, message", [
    ("metrics.nothing", "no key 'nothing'"),
    ("bench[n=2048].ratio", "matches 2 elements"),
    ("bench[backend=tensorflow].ratio", "matches 0 elements"),
    ("bench[all:backend=tensorflow].ratio", "matches no element"),
    ("per_seed.accuracy_percent.full.values.5", "outside the list"),
    ("metrics.full_acc_mean.x", "reads into a float"),
    ("{metrics.full_acc_mean}.__class__", "Attribute is not allowed"),
    ("__import__('os')", "no key"),
    ("{metrics.full_acc_mean} + __import__('os')", "may be called"),
    ("{metrics.full_acc_mean} + 'a'", "not a number"),
    ("{metrics.full_acc_mean} / 0", "ZeroDivisionError"),
])
def test_evaluate_refuses(expression, message):
    with pytest.raises(pages.PageError, match=re.escape(message)):
        pages.evaluate(RESULTS, expression)


def test_format_value():
    assert pages.format_value(86.351, ".1f") == "86.4"
    assert pages.format_value(3257.4, ",.0f") == "3,257"
    assert pages.format_value([1.234, 5.0], ".1f", " / ") == "1.2 / 5.0"
    assert pages.format_value(None, none="—") == "—"
    assert pages.format_value("oom") == "oom"
    with pytest.raises(pages.PageError, match="null"):
        pages.format_value(None)
    with pytest.raises(pages.PageError, match="object"):
        pages.format_value({"a": 1})
    with pytest.raises(pages.PageError, match="fmt=d"):
        pages.format_value(1.5, "d")


def test_render_regions(tmp_path):
    _checkout(tmp_path)
    sources = pages.Sources(tmp_path)
    assert pages.render_page(PAGE, sources) == PAGE

    def region(kind, spec):
        return pages.Region(kind, spec, 0, 0, 1, "")

    assert pages.render_region(region("results-table", "demo:table"), sources) == (
        "\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n")
    only = pages.render_region(region("results-table", "demo:claims only=bench"), sources)
    assert "k = 128 is faster" in only and "k = 64" not in only
    assert pages.render_region(region("result", "demo:metrics.missing none=—"), sources) == "—"
    for spec, message in [("demo:claims only=nope", "no claim named nope"),
                          ("demo:metrics", "not a table's text"),
                          ("other:claims", "no file docs/results/other.json")]:
        with pytest.raises(pages.PageError, match=re.escape(message)):
            pages.render_region(region("results-table", spec), sources)


def test_provenance_and_stale_regions(tmp_path):
    """A results file with a provenance record gives its commit and date, and
    whether its sources changed since (a stale note is soft in --check)."""
    page = _checkout(tmp_path)
    source = tmp_path / "keras_longattn" / "layer.py"
    source.parent.mkdir()
    source.write_text("x = 1\n")
    record = {"schema": 1, "commit": "0123456789abcdef", "dirty": False, "dirty_sources": [],
              "date": "2026-11-25T10:00:00+00:00", "backend": "jax",
              "source_files": {"keras_longattn/layer.py": provenance.file_sha256(source)},
              "machine": {"processor": "Test CPU", "usable_cpus": 2}}
    _set_json(tmp_path, lambda r: r.update(provenance=record))
    sources = pages.Sources(tmp_path)
    sentence = pages.render_region(pages.Region("results-provenance", "demo", 0, 0, 1, ""), sources)
    assert sentence.strip() == ("Committed run: `docs/results/demo.json`, commit `0123456789`, "
                                "2026-11-25T10:00:00+00:00, backend jax, Test CPU, 2 usable CPUs.")
    assert pages.render_region(pages.Region("results-stale", "demo", 0, 0, 1, ""),
                               sources).strip().startswith("Up to date")
    pages.write_pages(root=tmp_path)
    assert pages.check_pages(root=tmp_path) == []
    source.write_text("x = 2\n")  # the run's source changed: only the stale note moves
    found = pages.check_pages(root=tmp_path)
    assert [(m.label, m.soft) for m in found] == [("results-stale demo", True)]
    assert "Stale: the sources of this run changed" in found[0].expected
    assert pages.main(["--check", "--root", str(tmp_path)]) == 0
    assert pages.main(["--check", "--strict", "--root", str(tmp_path)]) == 1
    assert page.read_text(encoding="utf-8").count("Up to date") == 1


# ---------------------------------------------------------------------------
# A page out of sync
# ---------------------------------------------------------------------------


def test_a_page_in_sync_passes_the_check(tmp_path):
    _checkout(tmp_path)
    assert pages.check_pages(root=tmp_path) == []
    assert pages.main(["--check", "--root", str(tmp_path)]) == 0


def test_a_changed_result_puts_the_page_out_of_sync(tmp_path, capsys):
    page = _checkout(tmp_path)
    _set_json(tmp_path, lambda r: r["metrics"].update(full_acc_mean=81.27))
    found = pages.check_pages(root=tmp_path)
    assert [(m.label, m.found, m.expected) for m in found] == [
        ("result demo:metrics.full_acc_mean fmt=.1f", "80.1", "81.3"),
        ("result demo:{metrics.k64_acc_mean} - {metrics.full_acc_mean} fmt=+.1f", "+6.2", "+5.1"),
    ]
    assert not any(m.soft for m in found)
    assert pages.main(["--check", "--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "papers/demo.md:3: result demo:metrics.full_acc_mean fmt=.1f" in out.replace("\\", "/")
    assert "files: 81.3" in out

    assert pages.main(["--write", "--root", str(tmp_path)]) == 0
    text = page.read_text(encoding="utf-8")
    assert "-->81.3<!-- /result -->" in text and "-->+5.1<!-- /result -->" in text
    assert pages.main(["--check", "--root", str(tmp_path)]) == 0
    # everything outside the regions is kept as it was
    assert text.replace("81.3", "80.1").replace("+5.1", "+6.2") == PAGE


def test_a_typed_in_number_fails_the_check(tmp_path):
    page = _checkout(tmp_path, page=PAGE.replace("-->80.1<!--", "-->80.2<!--"))
    found = pages.check_pages([page], root=tmp_path)
    assert [(m.found, m.expected) for m in found] == [("80.2", "80.1")]


def test_a_changed_claim_puts_the_table_out_of_sync(tmp_path):
    _checkout(tmp_path)
    _set_json(tmp_path, lambda r: r["claims"][1].update(verdict="not reproduced"))
    found = pages.check_pages(root=tmp_path)
    assert [m.label for m in found] == ["results-table demo:claims"]
    assert "| does not hold (asserted) |" in found[0].expected


def test_a_region_the_files_cannot_give_fails_the_check(tmp_path):
    page = _checkout(tmp_path)
    _set_json(tmp_path, lambda r: r["metrics"].pop("full_acc_mean"))
    found = pages.check_pages(root=tmp_path)
    assert found and all(m.error and "no key 'full_acc_mean'" in m.error for m in found)
    assert pages.main(["--check", "--root", str(tmp_path)]) == 1
    before = page.read_text(encoding="utf-8")
    assert pages.main(["--write", "--root", str(tmp_path)]) == 1
    assert page.read_text(encoding="utf-8") == before  # nothing half-written


def test_broken_markers_fail_the_check(tmp_path):
    page = _checkout(tmp_path, page=PAGE.replace("<!-- /results-stale -->", ""))
    found = pages.check_pages([page], root=tmp_path)
    assert len(found) == 1 and "is not closed" in found[0].error


def test_benchmark_source(tmp_path):
    _checkout(tmp_path)
    bench = tmp_path / "docs" / "benchmarks"
    bench.mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "benchmarks" / "results.json", bench / "results.json")
    region = pages.Region(
        "result", "benchmarks:results[backend=jax,layer=sparse-strided,seq_len=8192].time_ratio "
        "fmt=.1f", 0, 0, 1, "")
    assert re.fullmatch(r"\d+\.\d", pages.render_region(region, pages.Sources(tmp_path)))
