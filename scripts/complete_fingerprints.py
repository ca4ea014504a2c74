"""Completes the behaviour record of a committed result whose run could not
fingerprint some of its subjects.

A subject whose class a paper module registers only when one of its class
factories runs (Linformer's ``RecordingFullAttention``, the planted layers)
could not be rebuilt by the fingerprint process before
``behaviour._register_factories``; its fingerprint holds an ``error`` and the
whole result is checked by bytes. For each results file named on the command
line, with backend ``B`` in its provenance, this script

1. refuses unless every file the run recorded (and its notebook) has the
   recorded bytes now, those that only record, show or judge a run aside
   (``provenance.PRESENTATION``): the package is the one that ran, so the
   fingerprints computed now are those the run would have computed;
2. computes the fingerprints of the subjects that hold an ``error`` on ``B``
   (``provenance.fingerprint_subjects``, a fresh process);
3. writes them in, with ``behaviour.completed``: the date, the commit, the
   subjects completed and why.

A subject that still fails keeps its error (the result stays checked by
bytes). Usage::

    python scripts/complete_fingerprints.py docs/results/linformer.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from keras_longattn import provenance as floor  # noqa: E402
from keras_longattn.reproductions import provenance  # noqa: E402


def complete(path: Path) -> int:
    record = json.loads(path.read_text(encoding="utf-8"))
    prov = record.get(floor.PROVENANCE_KEY) or {}
    behaviour = prov.get("behaviour")
    if not isinstance(behaviour, dict) or not behaviour.get("subjects"):
        print(f"{path}: no behaviour record to complete", file=sys.stderr)
        return 1
    # the recorded files (and the notebook) that changed, those that only
    # record, show or judge a run (PRESENTATION) aside
    harness, library = provenance._split_changes(prov, ROOT, path.stem)
    changed = harness + library
    if changed:
        print(f"{path}: {len(changed)} recorded files differ from the run's "
              f"({', '.join(sorted(changed)[:5])}...): fingerprints taken now would not be "
              "the run's", file=sys.stderr)
        return 1
    prints = behaviour["fingerprints"]
    subjects = {provenance._subject_key(s): s for s in behaviour["subjects"]}
    failed = [key for key in subjects if key not in prints or "error" in prints[key]]
    if not failed:
        print(f"{path}: every subject has a fingerprint")
        return 0
    fresh = provenance.fingerprint_subjects([subjects[k] for k in failed], prov["backend"], ROOT)
    done = [key for key in failed if key in fresh and "error" not in fresh[key]]
    for key in done:
        prints[key] = fresh[key]
    behaviour["completed"] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": (floor.git(ROOT, "rev-parse", "HEAD") or "").strip() or None,
        "subjects": done,
        "reason": "the run's fingerprint process could not rebuild these subjects "
                  "(classes registered by a paper module's class factory); computed "
                  "afterwards with every recorded file at the run's bytes",
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    left = len(failed) - len(done)
    print(f"{path}: {len(done)} of {len(failed)} fingerprints completed"
          + (f"; {left} still fail" if left else ""))
    return 0 if not left else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args(argv)
    return max(complete(path) for path in args.results)


if __name__ == "__main__":
    sys.exit(main())
