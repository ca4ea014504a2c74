"""Results current by behaviour (issue #46 item 1): the recorder, the
fingerprints and the staleness check, both ways.

* a fingerprint is the same twice, and differs for another config, other
  weights (another seed) or another path;
* the recorder, started in a fresh process before Keras is imported, records
  the package's layers and models with their call arguments;
* a results file written by a recording run stays current when a library
  file changes by bytes only (a comment), goes stale when the same file
  changes behaviour (the attention scale), and goes stale when the notebook
  (harness) changes.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest

from keras_longattn.layers import LocalAttention
from keras_longattn.reproductions import behaviour, provenance

ROOT = Path(__file__).resolve().parents[2]
RECORDER = ROOT / "keras_longattn" / "reproductions" / "recording.py"


def _subject(layer, length=16, causal=True):
    return {"layer": keras.saving.serialize_keras_object(layer),
            "arguments": {"query": {"tensor": [None, length, 16], "dtype": "float32"},
                          "value": {"tensor": [None, length, 16], "dtype": "float32"},
                          "use_causal_mask": causal}}


def test_fingerprint_repeats_and_sees_config_weights_and_arguments():
    subject = _subject(LocalAttention(num_heads=2, key_dim=8, window=4))
    first, second = behaviour.fingerprint(subject), behaviour.fingerprint(subject)
    assert "error" not in first, first
    assert first["implementations"], first
    assert behaviour.compare(first, second) == []
    other_window = behaviour.fingerprint(_subject(LocalAttention(num_heads=2, key_dim=8, window=3)))
    assert behaviour.compare(first, other_window)
    other_weights = behaviour.fingerprint(subject, seed=5)
    assert behaviour.compare(first, other_weights)
    not_causal = behaviour.fingerprint(_subject(LocalAttention(num_heads=2, key_dim=8, window=4),
                                                causal=False))
    assert behaviour.compare(first, not_causal)
    broken = json.loads(json.dumps(subject))
    broken["layer"]["class_name"] = broken["layer"]["registered_name"] = "NoSuchAttention"
    assert "error" in behaviour.fingerprint(broken)
    assert behaviour.compare(first, behaviour.fingerprint(broken))


@pytest.mark.backend_free  # registration, not numerics: one backend's fingerprint
def test_a_class_a_paper_module_registers_in_a_factory_is_rebuilt(tmp_path):
    # Linformer's recording arm: Keras knows its name only once the module's
    # class factory has run, which a fresh fingerprint process must do itself.
    from keras_longattn.reproductions import linformer

    recording = linformer._recording_class()(num_heads=2, key_dim=8)
    subject = _subject(recording)
    assert subject["layer"]["module"] == "keras_longattn.reproductions.linformer"
    prints = provenance.fingerprint_subjects([subject], keras.backend.backend(), cache=False)
    (fingerprint,) = prints.values()
    assert "error" not in fingerprint, fingerprint


def test_a_planted_class_a_paper_module_does_not_register_is_rebuilt():
    # Planted variants are top-level classes of a paper module that never
    # register with Keras: the fingerprint finds them by module and name.
    from keras_longattn.reproductions import sparse_transformer

    layer = sparse_transformer.CausalLeakSparseAttention(num_heads=2, key_dim=8, block_length=4)
    subject = _subject(layer, length=16)
    assert subject["layer"]["module"] == "keras_longattn.reproductions.sparse_transformer"
    with pytest.raises(TypeError, match="Could not locate class"):
        keras.saving.deserialize_keras_object(json.loads(json.dumps(subject["layer"])))
    fingerprint = behaviour.fingerprint(subject)
    assert "error" not in fingerprint, fingerprint
    assert fingerprint["implementations"][0].startswith("CausalLeakSparseAttention:")


def test_compare_tolerates_rounding_only():
    fingerprint = behaviour.fingerprint(_subject(LocalAttention(num_heads=2, key_dim=8, window=4)))
    nudged = json.loads(json.dumps(fingerprint))
    tensor = nudged["tensors"][0]
    tensor["proj"] = [p + 1e-5 * tensor["norm"] for p in tensor["proj"]]
    assert behaviour.compare(fingerprint, nudged) == []
    tensor["proj"][0] += 0.05 * tensor["norm"]
    assert behaviour.compare(fingerprint, nudged)


def _run(code, env_extra, cwd):
    env = dict(os.environ, **env_extra)
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


_RECORDING_RUN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("keras_longattn.reproductions.recording", {recorder!r})
recorder = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = recorder
spec.loader.exec_module(recorder)
recorder.start()
assert "keras" not in sys.modules
import numpy as np
import keras
from keras_longattn.layers import LocalAttention
from keras_longattn.reproductions.provenance import write_results
layer = LocalAttention(num_heads=2, key_dim=8, window=4)
x = np.random.RandomState(0).normal(size=(3, 16, 16)).astype("float32")
layer(x, x, use_causal_mask=True)
layer(x, x, use_causal_mask=True)  # a second call records nothing new
keras.layers.Dense(4)(x)           # not the package's: not recorded
{write}
"""


# The two tests below start fresh processes (several seconds each); the code
# they check is the same on every backend except the fingerprint's gradients,
# which the tests above run on each one. They run on torch, the fastest
# backend here (the ``grid`` marker), and everywhere under --run-slow.
@pytest.mark.grid
def test_recorder_records_the_package_layers_of_a_fresh_process(tmp_path):
    code = _RECORDING_RUN.format(recorder=str(RECORDER), write=(
        "import json; print(json.dumps(recorder.subjects()))"))
    subjects = json.loads(_run(code, {}, tmp_path).strip().splitlines()[-1])
    assert [s["layer"]["class_name"] for s in subjects] == ["LocalAttention"]
    assert subjects[0]["arguments"]["query"] == {"tensor": [3, 16, 16], "dtype": "float32"}
    assert subjects[0]["arguments"]["use_causal_mask"] is True


def _copy_checkout(tmp_path):
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "keras_longattn", root / "keras_longattn",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (root / "notebooks").mkdir()
    (root / "notebooks" / "demo.ipynb").write_text(_notebook("x = 1"), encoding="utf-8")
    return root


def _notebook(code):
    return json.dumps({"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# Demo"]},
                                 {"cell_type": "code", "metadata": {}, "source": [code]}]})


@pytest.mark.grid
def test_a_result_is_current_by_behaviour_both_ways(tmp_path):
    """A comment keeps the result current; a changed scale or notebook makes
    it stale."""
    root = _copy_checkout(tmp_path)
    results = root / "results" / "demo.json"
    code = _RECORDING_RUN.format(
        recorder=str(root / "keras_longattn" / "reproductions" / "recording.py"),
        write=f"write_results({str(results)!r}, {{'value': 1}})")
    _run(code, {"PYTHONPATH": str(root), "KERAS_BACKEND": keras.backend.backend(),
                "KERAS_LONGATTN_NOTEBOOK": str(root / "notebooks" / "demo.ipynb")}, tmp_path)
    record = json.loads(results.read_text())["provenance"]
    assert record["notebook"]["path"] == "notebooks/demo.ipynb"
    assert len(record["behaviour"]["subjects"]) == 1
    assert "keras_longattn/layers/base_attention.py" in record["source_files"]

    check = provenance.check_results(results, root)
    assert not check.stale, check.describe()

    base = root / "keras_longattn" / "layers" / "base_attention.py"
    text = base.read_text()
    base.write_text(text + "\n# a comment: bytes change, behaviour does not\n")
    assert provenance.needed_fingerprints(results, root) is not None
    check = provenance.check_results(results, root)
    assert not check.stale, check.describe()
    assert check.behaviour_files == ("keras_longattn/layers/base_attention.py",)

    scale = "self._inverse_sqrt_key_dim = 1.0 / float(self.key_dim) ** 0.5"
    assert scale in text
    base.write_text(text.replace(scale, "self._inverse_sqrt_key_dim = 0.5 / float(self.key_dim) ** 0.5"))
    check = provenance.check_results(results, root)
    assert check.stale and check.reason == "behaviour changed", check.describe()
    assert check.differences and "LocalAttention" in check.differences[0]

    base.write_text(text)
    assert not provenance.check_results(results, root).stale
    # The notebook counts by what it runs: prose and comments do not.
    notebook = root / "notebooks" / "demo.ipynb"
    notebook.write_text(_notebook("x = 1  # a comment").replace("# Demo", "# Prose"))
    assert not provenance.check_results(results, root).stale
    notebook.write_text(_notebook("x = 2"), encoding="utf-8")
    check = provenance.check_results(results, root)
    assert check.stale and check.changed == ("notebooks/demo.ipynb",), check.describe()


def test_harness_presentation_and_library_files():
    assert provenance.is_harness("notebooks/x.ipynb") is True
    assert provenance.is_harness("keras_longattn/reproductions/linformer.py") is True
    assert provenance.is_harness("keras_longattn/datasets/text.py") is True
    assert provenance.is_harness("keras_longattn/layers/local_attention.py") is False
    assert provenance.is_harness("keras_longattn/ops/blocked.py") is False
    assert provenance.is_harness("keras_longattn/reproductions/claims.py") is None
    assert provenance.is_harness("keras_longattn/reproductions/planted.py") is None
    assert provenance.is_harness("keras_longattn/reproductions/planted.py", "planted_bugs") is True
    generation = "keras_longattn/models/generation.py"
    assert provenance.is_harness(generation, "x", ["keras_longattn/layers/a.py"]) is False
    assert provenance.is_harness(generation, "x", ["keras_longattn/hub/longify.py"]) is True


# ---------------------------------------------------------------------------
# Pre-registered checks (issue #46 item 2)
# ---------------------------------------------------------------------------


def _git_repo(tmp_path):
    root = tmp_path / "repo"
    (root / "notebooks").mkdir(parents=True)
    (root / "keras_longattn" / "reproductions").mkdir(parents=True)
    (root / "notebooks" / "demo.ipynb").write_text('{"cells": []}\n', encoding="utf-8")
    (root / "keras_longattn" / "reproductions" / "demo.py").write_text("X = 1\n", encoding="utf-8")
    for command in (["init", "-q"], ["add", "-A"],
                    ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "checks"]):
        subprocess.run(["git", *command], cwd=root, check=True, capture_output=True)
    return root


def test_full_size_runs_need_committed_checks(tmp_path, monkeypatch):
    from keras_longattn import reproduce

    root = _git_repo(tmp_path)
    monkeypatch.setattr(reproduce, "_checkout_root", lambda: root)
    assert reproduce.unregistered_files("demo", root / "notebooks") == []
    (root / "notebooks" / "demo.ipynb").write_text('{"cells": [1]}\n', encoding="utf-8")
    (root / "keras_longattn" / "reproductions" / "demo.py").write_text("X = 2\n", encoding="utf-8")
    assert reproduce.unregistered_files("demo", root / "notebooks") == [
        "notebooks/demo.ipynb", "keras_longattn/reproductions/demo.py"]

    def no_run(*args, **kwargs):
        raise AssertionError("a full-size run with uncommitted checks must not start")

    monkeypatch.setattr(reproduce, "execute_notebook", no_run)
    status = reproduce.main(["demo", "--full", "--notebooks-dir", str(root / "notebooks"),
                             "--output-dir", str(tmp_path / "out")])
    assert status == 2


def _results(threshold, verdict, commit):
    return {"parameters": {"backend": "jax", "threshold": threshold, "steps": 10},
            "claims": [{"name": "claim_a", "verdict": verdict, "asserted": True,
                        "ours": f"0.5 (needs <= {threshold})"},
                       {"name": "claim_b", "verdict": "reproduced", "asserted": False, "ours": "x"}],
            "provenance": {"commit": commit, "date": "2026-12-01T00:00:00+00:00",
                           "notebook": {"sha256": "ab" * 32}}}


def test_a_new_run_keeps_the_runs_it_replaces(tmp_path):
    from keras_longattn import reproduce
    from keras_longattn.reproductions import pages

    path = tmp_path / "demo.json"
    first = _results(0.4, "not reproduced", "1" * 40)
    second = _results(0.6, "reproduced", "2" * 40)
    path.write_text(json.dumps(second))
    reproduce.keep_history(path, first)
    third = _results(0.6, "reproduced", "3" * 40)
    kept = json.loads(path.read_text())
    path.write_text(json.dumps(third))
    reproduce.keep_history(path, kept)
    history = json.loads(path.read_text())["history"]
    assert [entry["commit"] for entry in history] == ["1" * 40, "2" * 40]
    assert history[0]["parameters"] == {"threshold": 0.4, "steps": 10}
    assert history[0]["failed"] == ["claim_a"] and history[1]["failed"] == []
    text = pages._history_text(json.loads(path.read_text()))
    assert "`threshold = 0.4`: failed `claim_a`" in text
    assert "not reproduced, 0.5 (needs <= 0.4)" in text
    assert "under the same checks: no asserted claim failed" in text
