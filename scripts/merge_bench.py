"""Merges several benchmark reports (JSON written by `keras-longattn bench`)
into one file for the docs: `python scripts/merge_bench.py OUT IN [IN ...]`.

Ratios stay as each run computed them: every row's ratio is against the
FullAttention row of its own run."""

import json
import sys


def main(out, *inputs):
    merged = None
    for path in inputs:
        with open(path) as f:
            report = json.load(f)
        if merged is None:
            merged = dict(report)
            merged["results"] = []
            merged["runs"] = []
        merged["runs"].append({"file": path, "config": report["config"],
                               "started": report["started"], "finished": report["finished"]})
        merged["results"].extend(report["results"])
    merged.pop("config", None)
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"{len(merged['results'])} rows from {len(inputs)} runs -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
