"""Merges benchmark reports (JSON written by `keras-longattn bench`) into one
file for the docs: `python scripts/merge_bench.py OUT IN [IN ...]`.

An input is one run (a `config` at the top) or an earlier merged file (a
`runs` list): a merged file's runs and rows are carried over. A row of a
later input replaces an earlier row of the same configuration (backend,
layer, length, mode, causal, scope, batch, heads, head size); a run left
with no row is dropped from `runs`.

Ratios stay as each run computed them: every row's ratio is against the
FullAttention row of its own run."""

import json
import sys

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


def main(out, *inputs):
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
                         "started": report["started"], "finished": report["finished"]})
            for row in report["results"]:
                rows[_key(row)] = (row, len(runs) - 1)
    kept = sorted({index for _, index in rows.values() if index is not None})
    merged["runs"] = [runs[i] for i in kept]
    merged["results"] = [row for row, _ in rows.values()]
    merged.pop("config", None)
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"{len(merged['results'])} rows from {len(merged['runs'])} runs -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
