"""Issue #48, item 1: trust in an accelerator path that survives ordinary
edits, and the fallback of a path that fails on a device.

* A proof (``keras_longattn/kernels/proven.json``) is per backend and GPU
  vendor, and covers the path's own sources
  (:data:`keras_longattn.kernels.proven.PATH_SOURCES`): an edit to another
  file keeps it current, an edit to one of those voids it. Edits happen in
  a temporary copy of the sources, never in the checkout.
* A proof naming a file that does not exist fails here.
* The device check's report writes proofs from one complete run only.
* A path that ``"auto"`` chose and that raises (fails to compile or
  launch) falls back with one warning naming the error.
"""

import json
import shutil
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_longattn.benchmarks import device_report as dr
from keras_longattn.kernels import proven
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import dispatch

ROOT = Path(__file__).resolve().parents[2]
#: Files that are no path's source, edited in the copy to show that trust
#: survives them: a layer's docstring, the decoding code, another layer.
UNRELATED = ("keras_longattn/layers/local_attention.py",
             "keras_longattn/layers/base_attention.py",
             "keras_longattn/layers/routing_attention.py")


@pytest.fixture
def copy_root(tmp_path):
    """A copy of every path's sources and of :data:`UNRELATED`, laid out as
    in the checkout."""
    names = {name for files in proven.PATH_SOURCES.values() for name in files}
    for name in names | set(UNRELATED):
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
    return tmp_path


def _append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(proven, "_WARNED", set())
    monkeypatch.setattr(dispatch, "_FAILED", {})
    monkeypatch.delenv(proven.TRUST_VARIABLE, raising=False)


# ------------------------------------------------------------ the table
def test_every_path_lists_sources_that_exist():
    assert set(proven.PATH_SOURCES) == set(proven.KNOWN_KINDS) == set(proven.PATH_BACKENDS)
    for kind, files in proven.PATH_SOURCES.items():
        assert files and len(set(files)) == len(files)
        for name in files:
            assert (ROOT / name).is_file(), f"{kind!r} lists {name}, which does not exist"


def test_committed_proofs_name_only_existing_files():
    """Fails when a proof names a source or run file that is gone (the
    proof could never be current again) or covers other files than its
    path lists."""
    entries = json.loads(proven.SOURCE.read_text())
    assert entries
    for entry in entries:
        assert proven.proof_problems(entry) == [], entry["kind"]
        assert set(entry["sources"]) == set(proven.PATH_SOURCES[entry["kind"]])


def test_a_proof_naming_a_missing_file_is_reported():
    entry = dict(json.loads(proven.SOURCE.read_text())[0])
    entry["sources"] = dict(entry["sources"], **{"keras_longattn/kernels/gone.py": "0" * 64})
    entry["runs"] = entry["runs"] + ["docs/benchmarks/device_runs/gone.jsonl"]
    problems = proven.proof_problems(entry)
    assert any("source file that does not exist: keras_longattn/kernels/gone.py" in p
               for p in problems)
    assert any("run file that does not exist" in p for p in problems)
    assert not proven.is_current(entry["kind"], entry)
    assert any("gone.py" in p for p in proven.changed_sources(entry["kind"], entry))


def test_committed_proofs_match_the_run_they_cite():
    """The hashes a proof records are those the cited run recorded for the
    files it imported, on the devices it names, every case passing."""
    for entry in json.loads(proven.SOURCE.read_text()):
        rows = [r for name in entry["runs"] for r in dr.load(ROOT / name)]
        backend, kind = entry["backend"], entry["kind"]
        seen = {}
        for r in rows:
            if r.get("kind") == "provenance" and r["backend"] == backend:
                seen.update(r["source_files"])
        imported = [name for name in entry["sources"] if name in seen]
        assert imported, kind
        for name in imported:
            assert seen[name] == entry["sources"][name], (kind, name)
        cases = {c["case"]: c["status"] for c in dr.correctness_table(rows)
                 if c["backend"] == backend and c["path"] == kind}
        assert sorted(cases) == sorted(entry["cases"]) and set(cases.values()) == {"pass"}
        assert {r["name"] for r in rows if r.get("kind") == "device"} <= set(entry["devices"])
        assert proven.vendor_of(entry["devices"][0]) == entry["vendor"]


# ---------------------------------------------------------- trust rules
@pytest.mark.parametrize("kind", sorted(proven.PATH_SOURCES))
def test_unrelated_edits_keep_trust_and_source_edits_void_it(copy_root, kind):
    proof = {"sources": proven.source_hashes(kind, root=copy_root)}
    assert proven.is_current(kind, proof, root=copy_root)
    # A docstring of a layer, a decoding method, another layer: still current.
    _append(copy_root / UNRELATED[0], '\n"""An edited docstring."""\n')
    _append(copy_root / UNRELATED[1], "\n\ndef _decode_cache_helper():\n    return None\n")
    _append(copy_root / UNRELATED[2], "\n# another layer changed\n")
    assert proven.is_current(kind, proof, root=copy_root)
    # One of the path's own sources: stale, and the file is named.
    source = proven.PATH_SOURCES[kind][-1]
    _append(copy_root / source, "\n# the kernel changed\n")
    assert not proven.is_current(kind, proof, root=copy_root)
    assert proven.changed_sources(kind, proof, root=copy_root) == [f"{source}: changed"]
    # A source that is gone.
    (copy_root / source).unlink()
    assert proven.changed_sources(kind, proof, root=copy_root) == [f"{source}: missing"]


def test_a_proof_must_cover_every_source_the_path_lists_today(copy_root):
    proof = {"sources": proven.source_hashes("pallas", root=copy_root)}
    fewer = {"sources": dict(list(proof["sources"].items())[1:])}
    assert not proven.is_current("pallas", fewer, root=copy_root)
    more = {"sources": dict(proof["sources"], **{UNRELATED[0]: "0" * 64})}
    assert any("no longer a source" in p
               for p in proven.changed_sources("pallas", more, root=copy_root))


def test_auto_trusts_a_path_per_vendor_on_its_own_sources(monkeypatch, copy_root, fresh):
    """A proof for NVIDIA GPUs on one backend lets "auto" try the path on
    any NVIDIA GPU (here an L4 the check never ran on); an edit to an
    unrelated file keeps it, an edit to a source voids it (one warning
    naming the file)."""
    backend = keras.backend.backend()
    kind = {"jax": "pallas", "torch": "flex"}.get(backend, "pallas")
    monkeypatch.setattr(proven, "PACKAGE_PARENT", copy_root)
    monkeypatch.setattr(proven, "active_device_kind", lambda b: "NVIDIA L4")
    assert proven.active_vendor(backend) == "nvidia"
    monkeypatch.setitem(proven.PROVEN, (proven.PATH_BACKENDS[kind], "nvidia"), {kind: {
        "devices": ["NVIDIA H200"], "commit": "test",
        "sources": proven.source_hashes(kind, root=copy_root)}})
    assert kind in proven.trusted_kinds(proven.PATH_BACKENDS[kind], "nvidia")
    assert proven.trusted_kinds(proven.PATH_BACKENDS[kind], "amd") == frozenset()
    layer = LocalAttention(num_heads=2, key_dim=8, window=4)
    if proven.PATH_BACKENDS[kind] == backend:
        assert layer.auto_order()[0] == kind
    _append(copy_root / UNRELATED[0], "\n# a docstring edit\n")
    assert kind in proven.trusted_kinds(proven.PATH_BACKENDS[kind], "nvidia")
    source = proven.PATH_SOURCES[kind][0]
    _append(copy_root / source, "\n# a kernel edit\n")
    with pytest.warns(UserWarning, match=f"{source}: changed"):
        assert kind not in proven.trusted_kinds(proven.PATH_BACKENDS[kind], "nvidia")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert kind not in proven.trusted_kinds(proven.PATH_BACKENDS[kind], "nvidia")
        if proven.PATH_BACKENDS[kind] == backend:
            assert kind not in layer.auto_order()


def test_vendors():
    assert proven.vendor_of("NVIDIA H100 80GB HBM3") == "nvidia"
    assert proven.vendor_of("NVIDIA L4", "cuda 12080") == "nvidia"
    assert proven.vendor_of("AMD Instinct MI300X", "rocm 6.2") == "amd"
    assert proven.vendor_of("TPU v5 lite", "tpu") == "google"
    assert proven.vendor_of("cpu") is None
    # Never on the CPU.
    assert proven.trusted_kinds("jax", None) == frozenset()


# ------------------------------------------------- proofs from a run
def _run_rows(kind="pallas", backend="jax", statuses=("pass", "pass"), dry=False,
              files=None):
    cases = [f"case-{i}" for i in range(len(statuses))]
    rows = [{"kind": "device", "backend": backend, "dry": dry, "name": "NVIDIA A100-SXM4-80GB",
             "accelerator": True, "vendor": "nvidia", "versions": {"keras": "3"}},
            {"kind": "plan", "backend": backend, "dry": dry,
             "cases": [{"case": c, "path": kind} for c in cases]}]
    for _ in range(2):  # two shards, the same sources
        rows.append({"kind": "path_sources", "backend": backend, "dry": dry, "path": kind,
                     "files": files or proven.source_hashes(kind)})
    for case, status in zip(cases, statuses):
        if status is not None:
            rows.append({"kind": "correct", "backend": backend, "dry": dry, "case": case,
                         "path": kind, "status": status})
    return rows


def test_a_complete_run_writes_a_proof_of_the_path_sources():
    (entry,), voided = dr.proof_entries(_run_rows(), "c" * 40, "test", ["run.jsonl"])
    assert voided == []
    assert (entry["backend"], entry["vendor"], entry["kind"]) == ("jax", "nvidia", "pallas")
    assert entry["devices"] == ["NVIDIA A100-SXM4-80GB"] and entry["commit"] == "c" * 40
    assert entry["cases"] == ["case-0", "case-1"] and entry["runs"] == ["run.jsonl"]
    assert entry["sources"] == proven.source_hashes("pallas")
    assert proven.is_current("pallas", entry)
    assert not [p for p in proven.proof_problems(entry) if "run file" not in p]


@pytest.mark.parametrize("statuses", [("pass", None), ("pass", "skipped"),
                                      ("pass", "unavailable")])
def test_an_incomplete_run_proves_nothing(statuses):
    assert dr.proof_entries(_run_rows(statuses=statuses), "c", "test") == ([], [])


def test_sources_that_differ_between_shards_prove_nothing():
    rows = _run_rows()
    rows[3] = dict(rows[3], files=dict(rows[3]["files"], **{
        proven.PATH_SOURCES["pallas"][0]: "0" * 64}))
    assert dr.proof_entries(rows, "c", "test") == ([], [])


def test_a_dry_run_proves_nothing():
    assert dr.proof_entries(_run_rows(dry=True), "c", "test") == ([], [])


def test_a_failed_case_removes_the_vendors_proof(tmp_path):
    rows = _run_rows(statuses=("pass", "fail"))
    assert dr.proof_entries(rows, "c", "test") == ([], [("jax", "nvidia", "pallas")])
    old = {"backend": "jax", "vendor": "nvidia", "kind": "pallas", "devices": ["NVIDIA H200"],
           "sources": {}}
    other = dict(old, kind="flex", backend="torch")
    assert dr.merge_proofs([old, other], [], [("jax", "nvidia", "pallas")]) == [other]


def test_the_report_refreshes_proven_json(tmp_path):
    """``device_report --prove`` (what scripts/device_check.sh runs last):
    the new proof replaces the vendor's old one, keeping the devices the
    old one ran on where the sources are the same."""
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in _run_rows()))
    target = tmp_path / "proven.json"
    old = {"backend": "jax", "vendor": "nvidia", "kind": "pallas", "devices": ["NVIDIA H200"],
           "sources": proven.source_hashes("pallas")}
    keep = dict(old, backend="torch", kind="flex")
    target.write_text(json.dumps([old, keep]))
    assert dr.main([str(results), "--write", str(tmp_path / "summary.json"), "--prove",
                    str(target), "--run-file", "docs/benchmarks/device_runs/x.jsonl",
                    "--commit", "d" * 40]) == 0
    written = json.loads(target.read_text())
    assert written[1] == keep
    assert written[0]["devices"] == ["NVIDIA A100-SXM4-80GB", "NVIDIA H200"]
    assert written[0]["runs"] == ["docs/benchmarks/device_runs/x.jsonl"]
    assert written[0]["commit"] == "d" * 40


# -------------------------------------------------------------- fallback
def _planted_failure(monkeypatch, layer_cls, message):
    """Makes the "pallas" path of ``layer_cls`` runnable on every backend
    and "auto" try it first; running it raises ``message``."""
    from keras_longattn.layers import base_attention

    path = layer_cls._implementation_table["pallas"]

    def launch(layer, query, key, value, context):
        raise RuntimeError(message)

    monkeypatch.setattr(path, "fn", launch)
    monkeypatch.setattr(path, "_refusal", lambda layer, context: None)
    monkeypatch.setattr(base_attention, "dispatch_auto_preference",
                        lambda: ("pallas", "explicit", "fused"))


def test_a_failing_accelerator_path_falls_back_with_one_warning(monkeypatch, fresh):
    _planted_failure(monkeypatch, LocalAttention, "planted launch failure: no kernel image")
    x = np.random.default_rng(0).standard_normal((2, 24, 8)).astype("float32")
    layer = LocalAttention(num_heads=2, key_dim=4, window=6)
    layer.build(x.shape, x.shape)
    assert layer.auto_order()[0] == "pallas"
    with pytest.warns(UserWarning, match="planted launch failure: no kernel image") as record:
        out = layer(x, x, use_causal_mask=True)
    assert len(record) == 1 and "'pallas'" in str(record[0].message)
    assert layer.last_implementation not in ("pallas", "reference")
    reference = LocalAttention(num_heads=2, key_dim=4, window=6, implementation="reference")
    reference.build(x.shape, x.shape)
    reference.set_weights(layer.get_weights())
    np.testing.assert_allclose(keras.ops.convert_to_numpy(out),
                               keras.ops.convert_to_numpy(reference(x, x,
                                                                    use_causal_mask=True)),
                               rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning: later calls, other layers of the class
        layer(x, x, use_causal_mask=True)
        LocalAttention(num_heads=2, key_dim=4, window=6)(x, x)
    assert layer.select_implementation(use_causal_mask=True) != "pallas"
    assert "planted launch failure" in dispatch.path_failure(layer, "pallas")
    # Named, the path raises what it raised.
    named = LocalAttention(num_heads=2, key_dim=4, window=6, implementation="pallas")
    with pytest.raises(RuntimeError, match="planted launch failure"):
        named(x, x)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jit compiles after tracing")
def test_a_kernel_that_fails_to_compile_under_jit_falls_back(monkeypatch, fresh):
    """Under ``jax.jit`` the Pallas kernel is lowered with the whole
    program, after the layer returned: the path is compiled on its own
    first (``JaxOps.probe``). Here the real kernel is built for compiling
    on a CPU, which Pallas refuses ("Only interpret mode is supported"),
    as a GPU's Triton may refuse a kernel."""
    import jax
    import jax.numpy as jnp

    from keras_longattn.kernels.jax import pallas_attention as pa

    monkeypatch.setattr(proven, "active_vendor", lambda backend: "testvendor")
    monkeypatch.setenv(proven.TRUST_VARIABLE, "pallas")
    monkeypatch.setattr(pa, "default_interpret", lambda: False)
    x = np.random.default_rng(1).standard_normal((2, 32, 8)).astype("float32")
    layer = LocalAttention(num_heads=2, key_dim=4, window=4)
    layer.build(x.shape, x.shape)
    assert layer.auto_order()[0] == "pallas"

    def loss(x):
        return jnp.sum(layer(x, x, use_causal_mask=True) ** 2)

    with pytest.warns(UserWarning, match="'pallas' failed to compile or run.*interpret"):
        grad = jax.jit(jax.grad(loss))(x)
    assert layer.last_implementation == "blocked"
    blocked = LocalAttention(num_heads=2, key_dim=4, window=4, implementation="blocked")
    blocked.build(x.shape, x.shape)
    blocked.set_weights(layer.get_weights())
    expected = jax.grad(lambda x: jnp.sum(blocked(x, x, use_causal_mask=True) ** 2))(x)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-5, atol=1e-6)
