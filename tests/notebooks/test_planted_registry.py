"""The planted-variant registry itself (no training): what counts as caught,
clear errors for a variant that names no claim or an unknown one, the
variants against the claims of the committed full-size runs, and the
committed planted run against the registry."""

import json
from pathlib import Path

import pytest

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import planted as pl

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _claims(verdict, asserted=True):
    return [cl.Claim("beats_control", "x beats y", "paper", "0.9 vs 0.1", verdict, asserted)]


def _set(real_verdict, planted_verdict, asserted=True, targets=("beats_control",)):
    def run(variant):
        return _claims(real_verdict if variant is None else planted_verdict, asserted)
    return pl.PlantedSet("demo", run, (pl.PlantedVariant("broken", "a broken layer", targets),))


def test_caught_needs_real_pass_and_planted_failure():
    assert pl.check(_set("reproduced", "not reproduced"), "broken").caught
    assert not pl.check(_set("reproduced", "reproduced"), "broken").caught
    # The real layers must pass at the size the variant ran at.
    item = pl.check(_set("direction only", "not reproduced"), "broken")
    assert not item.caught and "real layers" in item.problems()[0]
    # A claim that is only reported cannot catch anything.
    assert not pl.check(_set("reproduced", "not reproduced", asserted=False), "broken").caught


def test_table_names_claim_variant_and_verdicts():
    table = pl.results_table([pl.check(_set("reproduced", "not reproduced"), "broken")])
    row = table.splitlines()[2]
    assert "beats_control" in row and "`broken`" in row and "not reproduced" in row
    assert row.endswith("| yes |")


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="targets no claim"):
        pl.PlantedVariant("broken", "bug", ())
    with pytest.raises(KeyError, match="no claim named"):
        pl.check(_set("reproduced", "not reproduced", targets=("missing",)), "broken")
    with pytest.raises(KeyError, match="no planted variant"):
        _set("reproduced", "reproduced").variant("other")
    with pytest.raises(ValueError, match="slugs"):
        pl.planted_sets(["nope"])


# ------------------------------------------- the registry against full size
#
# The variants name the claims of the small planted run; the full-size run
# (docs/results/<slug>.json) names the same checks at its own sizes. Every
# claim the full-size run asserts must be targeted by a variant (through its
# family: Linformer's beats_control_k64 by a variant of beats_control_k8),
# and every target must be a claim the full-size run has.

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
SETS = pl.planted_sets()


def _targeted_families(planted):
    return {pl.claim_family(name) for v in planted.variants for name in v.claims}


def _full_size_claims(slug):
    return json.loads((RESULTS / f"{slug}.json").read_text())["claims"]


def test_claim_family_drops_the_size_only():
    assert pl.claim_family("beats_control_k64") == pl.claim_family("beats_control_k8")
    assert pl.claim_family("cost_grows_with_n_k1024") == "cost_grows_with_n_k<k>"
    # Names that carry no size parameter are their own family.
    for name in ("parity_entmax15", "zeros_entmax15", "recall_vanilla_beats_dense+random",
                 "task_needs_attention", "k1"):
        assert pl.claim_family(name) == name


@pytest.mark.parametrize("planted", SETS, ids=[s.slug for s in SETS])
def test_full_size_asserted_claims_are_targeted(planted):
    asserted = {c["name"] for c in _full_size_claims(planted.slug) if c["asserted"]}
    missing = sorted(n for n in asserted if pl.claim_family(n) not in _targeted_families(planted))
    assert not missing, (f"{planted.slug}: claims the full-size run asserts that no planted "
                         f"variant targets (at any size): {missing}")


@pytest.mark.parametrize("planted", SETS, ids=[s.slug for s in SETS])
def test_every_target_is_a_full_size_claim(planted):
    full = {pl.claim_family(c["name"]) for c in _full_size_claims(planted.slug)}
    unknown = sorted(_targeted_families(planted) - full)
    assert not unknown, (f"{planted.slug}: planted variants target claims the full-size run "
                         f"does not have: {unknown}")


def test_linformer_full_size_claims_from_the_claims_function():
    """Linformer's names depend on the size (k of the arms, n and k of the
    cost grid): its claims function, called with the notebook's full-size
    parameters on made-up results (no training), names the claims a
    full-size run asserts, the comparisons whose seeds do not separate the
    arms included; each is targeted."""
    from keras_longattn.reproductions import linformer as lf
    from keras_longattn.reproduce import notebook_metadata, notebook_parameters

    notebook = json.loads((RESULTS.parents[1] / "notebooks" / "linformer.ipynb").read_text())
    params = {**notebook_parameters(notebook), **notebook_metadata(notebook)["full_parameters"]}
    ks, lengths, bench_ks = params["parity_ks"], params["bench_lengths"], params["bench_ks"]
    # Full attention's seeds spread wider than every margin: the comparisons
    # with it are not testable, and stay asserted.
    accuracy = {"full": [60.0, 90.0, 75.0], "k1": [20.0, 21.0, 22.0]}
    accuracy.update({f"k{k}": [70.0, 71.0, 72.0] for k in ks})
    grid = {n: {"full": {"flops": 1e12, "temp_bytes": 2**34},
                **{k: {"flops": 1e12 * k / n, "temp_bytes": int(2**34 * k / n)}
                   for k in bench_ks if k < n}} for n in lengths}
    results = {"limit": 0.0, "padding": 0.0, "slot_rank": {"k": 3, "linformer": 3, "full": 15},
               "accuracy": accuracy, "control": "k1", "chance": 10.0, "task": params["task"],
               "cost": lf.cost_rows(grid), "table3": [], "backend": "jax"}
    claims = lf.linformer_claims(results, params)
    asserted = {c.name for c in claims if c.asserted}
    assert {f"beats_control_k{k}" for k in ks} | {f"parity_k{k}" for k in ks} <= asserted
    assert {f"cost_grows_with_n_k{k}" for k in bench_ks if k < lengths[-1]
            and sum(k < n for n in lengths) >= 2} <= asserted
    (planted,) = pl.planted_sets(["linformer"])
    missing = sorted(n for n in asserted if pl.claim_family(n) not in _targeted_families(planted))
    assert not missing, f"linformer: full-size asserted claims no variant targets: {missing}"


# ------------------------------------ the committed planted run (no re-run)

#: Variants registered after the committed planted run
#: (docs/results/planted_bugs.json, whose table papers/README.md shows):
#: none since its re-run of 2026-12-01 (``python -m
#: keras_longattn.reproductions.planted --write`` on JAX, with keras_hub).
#: A variant registered later goes here until the next re-run adds it.
AWAITING_RERUN = frozenset()


def test_committed_planted_run_against_the_registry():
    committed = json.loads((RESULTS / f"{pl.RESULTS_NAME}.json").read_text())
    ran = {(v["slug"], v["variant"]) for v in committed["variants"]}
    registered = {(s.slug, v.name) for s in SETS for v in s.variants}
    # Nothing in the committed run was removed or renamed since.
    assert not ran - registered, sorted(ran - registered)
    # What the run lacks is exactly what a re-run must add (listed above).
    lacking = registered - ran
    assert lacking == AWAITING_RERUN, (
        f"registered, not in the committed run and not listed in AWAITING_RERUN: "
        f"{sorted(lacking - AWAITING_RERUN)}; listed but not lacking (in the run, or not "
        f"registered): {sorted(AWAITING_RERUN - lacking)}")
    assert committed["caught"] == committed["total"] == len(ran)


def _record_in(tmp_path):
    """The committed planted run, its recorded files replaced by one file of
    tmp_path (so that the test does not depend on today's sources)."""
    from keras_longattn.provenance import file_sha256

    record = json.loads((Path(pl.__file__).resolve().parents[2] / "docs" / "results"
                         / "planted_bugs.json").read_text())
    (tmp_path / "module.py").write_text("x = 1\n")
    record["provenance"]["source_files"] = {"module.py": file_sha256(tmp_path / "module.py")}
    record["asserted"] = {s.slug: sorted({c for v in s.variants for c in v.claims})
                          for s in pl.planted_sets()}
    return record


def _read(tmp_path, record):
    path = tmp_path / "planted_bugs.json"
    path.write_text(json.dumps(record))
    return pl.recorded_run(path, root=tmp_path)


def test_a_recorded_run_is_read_only_while_it_describes_the_code(tmp_path):
    record = _record_in(tmp_path)
    read = _read(tmp_path, record)
    assert read is not None
    assert {key for key in read["checks"]} >= {(s.slug, v.name) for s in pl.planted_sets()
                                                for v in s.variants}
    # caught comes from the recorded verdicts, not from the stored flag
    entry = record["variants"][0]
    key = (entry["slug"], entry["variant"])
    assert read["checks"][key].caught
    entry["claims"][0]["real"]["verdict"] = "not reproduced"
    assert not _read(tmp_path, record)["checks"][key].caught
    # a recorded file that changed, a variant missing, a set's asserted
    # claims missing: the variants must be trained again
    changed = _record_in(tmp_path)
    (tmp_path / "module.py").write_text("x = 2\n")
    assert _read(tmp_path, changed) is None
    shorter = _record_in(tmp_path)
    shorter["variants"] = shorter["variants"][1:]
    assert _read(tmp_path, shorter) is None
    no_asserted = _record_in(tmp_path)
    del no_asserted["asserted"]
    assert _read(tmp_path, no_asserted) is None
