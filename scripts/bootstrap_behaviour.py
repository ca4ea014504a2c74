"""Gives committed full-size results that predate behaviour fingerprints a
behaviour record, taken at the commit each one ran on.

For each results file ``docs/results/<slug>.json`` named on the command line,
with commit ``C`` and backend ``B`` in its provenance:

1. a git worktree of ``C`` (under ``--work``);
2. the notebook of ``C`` at its CI size on ``B``, with the package of ``C``
   (first on ``PYTHONPATH``) and this checkout's recorder
   (``keras_longattn/reproductions/recording.py``), which writes the layers
   and models the notebook calls (the subjects) to a file; the CI size runs
   the same arms and options as the full size, at smaller shapes;
3. the subjects' fingerprints with the package of ``C``
   (``provenance.fingerprint_subjects(..., root=C)``);
4. when the run's parameters equal the full-size parameters of the notebook
   at ``C`` (the notebook is what the run executed), the results file gets
   ``provenance.behaviour`` (subjects, fingerprints, and a ``bootstrap``
   note saying how they were taken) and ``provenance.notebook`` (the
   notebook of ``C``). Otherwise it is left as it is, and stays checked by
   bytes.

``keras-longattn reproduce --stale`` then compares these fingerprints with
today's code. Usage::

    python scripts/bootstrap_behaviour.py adamra sparse_transformer ...
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


provenance = _load("_bootstrap_provenance", ROOT / "keras_longattn/reproductions/provenance.py")
reproduce = _load("_bootstrap_reproduce", ROOT / "keras_longattn/reproduce.py")


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def worktree(commit: str, work: Path) -> Path:
    path = work / f"wt-{commit[:10]}"
    if not path.is_dir():
        git("worktree", "add", "--detach", str(path), commit)
    return path


def parameters_match(results: dict, notebook: dict) -> list[str]:
    """The parameters where the run differs from the notebook's full size."""
    expected = reproduce.resolve_parameters(notebook, full=True, backend=None, overrides={})
    ran = results.get("parameters") or {}
    return sorted(name for name, value in ran.items()
                  if name in expected and name not in ("backend", "results_path")
                  and expected[name] != value)


def bootstrap(slug: str, work: Path) -> str:
    path = ROOT / "docs" / "results" / f"{slug}.json"
    results = json.loads(path.read_text(encoding="utf-8"))
    record = results.get("provenance") or {}
    commit, backend = record.get("commit"), record.get("backend")
    if not commit or not backend:
        return f"{slug}: no commit or backend recorded: left as it is"
    if isinstance(record.get("behaviour"), dict):
        return f"{slug}: has a behaviour record already"
    tree = worktree(commit, work)
    notebook_path = f"notebooks/{slug}.ipynb"
    notebook_bytes = subprocess.run(["git", "show", f"{commit}:{notebook_path}"], cwd=ROOT,
                                    check=True, capture_output=True).stdout
    notebook = json.loads(notebook_bytes)
    mismatched = parameters_match(results, notebook)
    if mismatched:
        return (f"{slug}: the run's parameters {mismatched} differ from the full size of the "
                f"notebook at {commit[:10]}: left as it is (checked by bytes)")
    subjects_file = work / f"{slug}-subjects.json"
    subjects_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tree), KERAS_LONGATTN_RECORD_TO=str(subjects_file))
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, str(ROOT / "keras_longattn/reproduce.py"), slug,
                          "--record", "--backend", backend,
                          "--notebooks-dir", str(tree / "notebooks"),
                          "--output-dir", str(work / f"ci-{slug}")],
                         env=env, capture_output=True, text=True)
    (work / f"{slug}-ci-run.log").write_text(run.stdout + "\n" + run.stderr, encoding="utf-8")
    if not subjects_file.is_file():
        return f"{slug}: the CI-size run recorded nothing (rc {run.returncode}): {run.stderr[-800:]}"
    subjects = json.loads(subjects_file.read_text(encoding="utf-8"))
    fingerprints = provenance.fingerprint_subjects(subjects, backend, tree)
    failed = [k for k, v in fingerprints.items() if "error" in v]
    record["behaviour"] = {
        "schema": provenance.BEHAVIOUR_SCHEMA,
        "backend": backend,
        "subjects": subjects,
        "skipped": {},
        "fingerprints": fingerprints,
        "bootstrap": (f"subjects recorded by the notebook's CI-size run at {commit[:10]} (the "
                      f"same arms at smaller shapes), fingerprinted with the package of "
                      f"{commit[:10]}, on {datetime.now(timezone.utc).date().isoformat()}; the "
                      f"full-size run itself predates the recording"),
    }
    record["notebook"] = {"path": notebook_path,
                          "sha256": hashlib.sha256(notebook_bytes).hexdigest(),
                          "size": "full",
                          "code_sha256": provenance.notebook_code_sha256(notebook_bytes, "full"),
                          "committed": True}
    results["provenance"] = record
    path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    note = f" ({len(failed)} could not be fingerprinted there)" if failed else ""
    return (f"{slug}: {len(subjects)} subjects, fingerprinted at {commit[:10]}{note}; "
            f"CI-size run rc {run.returncode}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("slugs", nargs="+")
    parser.add_argument("--work", default="/tmp/keras-longattn-bootstrap")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    for slug in args.slugs:
        print(bootstrap(slug, work), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
