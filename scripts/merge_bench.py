"""Merges benchmark reports (JSON written by `keras-longattn bench`) into one
file for the docs:
`python scripts/merge_bench.py OUT IN [IN ...] [--command TEXT] [--note TEXT]`.

An input is one run (a `config` at the top) or an earlier merged file (a
`runs` list): a merged file's runs and rows are carried over. A row of a
later input replaces an earlier row of the same configuration (backend,
layer, length, mode, causal, scope, batch, heads, head size); a run left
with no row is dropped from `runs`.

Ratios stay as each run computed them: every row's ratio is against the
FullAttention row of its own run.

Each run keeps its provenance record (`keras_longattn.provenance.collect`);
the merged file's `provenance` is their union (`keras-longattn reproduce
--stale` checks it): every source file any run imported with its sha256 (a
file two runs recorded with different bytes gets neither hash, so the merged
file is stale), the last run's commit unless such a file exists, and
`commits` when the runs ran at more than one. A run
without provenance leaves the merged file without one. `--command` records
how the file is re-made, `--note` a description shown on the docs page."""

import argparse
import json

KEY = ("backend", "layer", "seq_len", "mode", "causal", "scope", "batch", "num_heads",
       "head_dim")


def _key(row):
    return tuple(row.get(name) for name in KEY)


def _run_of(row, runs):
    """Index of the run of a merged file that measured ``row`` (None: none
    matches)."""
    for i, run in enumerate(runs):
        config = run.get("config") or {}
        if (row.get("backend") in config.get("backends", [])
                and row.get("seq_len") in config.get("lengths", [])
                and row.get("mode") in config.get("modes", [])
                and row.get("scope", "layer") == config.get("scope", "layer")
                and row.get("causal") == config.get("causal", row.get("causal"))
                and row.get("layer") in set(config.get("layers", []))
                | set((config.get("layer_specs") or {}))):
            return i
    return None


def merged_provenance(runs):
    """One provenance record for ``runs`` (see the module's docstring), or
    None when a run has none."""
    records = [run.get("provenance") for run in runs]
    if not records or any(not isinstance(r, dict) for r in records):
        return None
    files = {}
    for record in records:
        for name, digest in record.get("source_files", {}).items():
            files[name] = digest if files.get(name, digest) == digest else "differs between runs"
    commits = sorted({r.get("commit") for r in records}, key=str)
    merged = dict(records[-1])
    differ = "differs between runs" in files.values()
    merged.update(source_files=dict(sorted(files.items())),
                  commit=None if differ else records[-1].get("commit"),
                  dirty=any(bool(r.get("dirty")) for r in records),
                  backend=",".join(sorted({b for r in records
                                           for b in str(r.get("backend") or "").split(",") if b})))
    merged.pop("source_sha256", None)
    if len(commits) > 1:
        merged["commits"] = commits
    return merged


def main(out, *inputs, command=None, note=None):
    merged = None
    runs, rows = [], {}  # rows: key -> (row, index of its run)
    for path in inputs:
        with open(path) as f:
            report = json.load(f)
        if merged is None:
            merged = dict(report)
        if "runs" in report and "config" not in report:
            offset = len(runs)
            runs.extend(report["runs"])
            for row in report["results"]:
                found = _run_of(row, report["runs"])
                rows[_key(row)] = (row, None if found is None else offset + found)
        else:
            runs.append({"file": path, "config": report["config"],
                         "started": report["started"], "finished": report["finished"],
                         "provenance": report.get("provenance")})
            for row in report["results"]:
                rows[_key(row)] = (row, len(runs) - 1)
    kept = sorted({index for _, index in rows.values() if index is not None})
    merged["runs"] = [runs[i] for i in kept]
    merged["results"] = [row for row, _ in rows.values()]
    merged.pop("config", None)
    merged["provenance"] = merged_provenance(merged["runs"])
    if merged["provenance"] is None:
        merged.pop("provenance")
    if command is not None:
        merged["command"] = command
    if note is not None:
        merged["note"] = note
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"{len(merged['results'])} rows from {len(merged['runs'])} runs -> {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--command", help="how the merged file is re-made (recorded)")
    parser.add_argument("--note", help="a description of the runs (recorded)")
    args = parser.parse_args()
    main(args.out, *args.inputs, command=args.command, note=args.note)
