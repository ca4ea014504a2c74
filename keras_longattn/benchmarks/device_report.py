"""Summary of a device check (``scripts/device_check.sh``): the results
file behind the benchmark page's GPU table, and the issue's criteria.

    python -m keras_longattn.benchmarks.device_report RUN1/results.jsonl \\
        [RUN2/results.jsonl ...] [--write docs/benchmarks/gpu_results.json] \\
        [--commit SHA1 --commit SHA2 ...]

reads the JSON lines the stages wrote and prints (or writes) one document:
the device and versions, every correctness case per backend and dtype,
every timing with its ratio to full attention measured in the same run,
useful-FLOP throughput against the bf16 matrix-product peak measured in the
same process, and each criterion with the numbers it was judged on.
"""

import argparse
import json
import subprocess
import sys
from datetime import datetime
from datetime import timezone
from pathlib import Path

#: The full-attention row each backend's timings are divided by.
FULL = {"jax": "full_cudnn", "torch": "full_sdpa"}
#: The size at which the criteria are judged.
CRITERIA_LENGTH = 65536
#: Tokens of the one-device run.
MILLION = 1 << 20


def load(path):
    """The rows of a results file (JSON lines)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return rows


def _device(rows):
    for row in rows:
        if row.get("kind") == "device":
            return row
    return {}


def _timings(rows):
    """``{(backend, method, n): row}`` of the ok timing rows."""
    return {(r["backend"], r["method"], r["n"]): r for r in rows
            if r.get("kind") == "bench" and r.get("status") == "ok" and "ms" in r}


def _peaks(rows):
    return {r["backend"]: r["tflops"] for r in rows
            if r.get("kind") == "peak" and r.get("status") == "ok"}


def run_peak(rows):
    """The run's bf16 matrix-product peak: the fastest of the products each
    backend timed on the same device in the same run (a product timed
    while the clocks still ramp up reads low)."""
    peaks = _peaks(rows)
    return max(peaks.values()) if peaks else None


def timing_table(rows):
    """One entry per timing: ms, ratio of full attention's time (same
    backend, same n) to this one, useful TFLOP/s and fraction of the run's
    peak (:func:`run_peak`)."""
    timings = _timings(rows)
    peak = run_peak(rows)
    out = []
    for (backend, method, n), row in sorted(timings.items(),
                                            key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        full = timings.get((backend, FULL.get(backend), n))
        entry = {"backend": backend, "method": method, "n": n, "ms": row["ms"],
                 "speedup_vs_full": (full["ms"] / row["ms"]) if full else None,
                 "useful_tflops": row.get("useful_tflops"),
                 "fraction_of_peak": (row["useful_tflops"] / peak
                                      if peak and row.get("useful_tflops") else None)}
        out.append(entry)
    failures = [{"backend": r["backend"], "method": r.get("method"), "n": r.get("n"),
                 "status": r.get("status"), "error": r.get("error") or r.get("reason")}
                for r in rows if r.get("kind") == "bench" and r.get("status") != "ok"]
    return out, failures


def correctness_table(rows):
    out = []
    for r in rows:
        if r.get("kind") != "correct":
            continue
        entry = {"backend": r["backend"], "case": r.get("case"), "path": r.get("path"),
                 "status": r.get("status")}
        if r.get("status") == "error":
            entry["error"] = r.get("error")
        for dtype in ("float32", "bfloat16", "float16"):
            if dtype in r:
                d = r[dtype]
                entry[dtype] = {k: d.get(k) for k in (
                    "passed", "error_out", "error_grad", "reference_error_out",
                    "reference_error_grad", "same_dtype_error_out", "same_dtype_error_grad",
                    "ran")}
        out.append(entry)
    return out


def criteria(rows):
    """The issue's GPU criteria, each with the numbers it is judged on
    (``passed`` None where a number is missing)."""
    t = _timings(rows)
    peak = run_peak(rows)
    n = CRITERIA_LENGTH
    get = lambda backend, method, size=n: t.get((backend, method, size))  # noqa: E731
    out = []

    def add(name, passed, numbers=None, **more):
        out.append({"criterion": name, "passed": passed, **(numbers or {}), **more})

    pallas, cudnn = get("jax", "local_pallas"), get("jax", "local_cudnn_window")
    if pallas and cudnn:
        ratio = pallas["useful_tflops"] / cudnn["useful_tflops"]
        add("Pallas Local >= 0.8x the useful throughput of cuDNN's sliding window",
            ratio >= 0.8, ratio=ratio, pallas_ms=pallas["ms"], cudnn_ms=cudnn["ms"])
    else:
        add("Pallas Local >= 0.8x the useful throughput of cuDNN's sliding window", None)
    flex, direct = get("torch", "local_flex"), get("torch", "local_flex_direct")
    if flex and direct:
        ratio = flex["ms"] / direct["ms"]
        add("Flex Local at most 1.1x the time of FlexAttention used directly", ratio <= 1.1,
            ratio=ratio, flex_ms=flex["ms"], direct_ms=direct["ms"])
    else:
        add("Flex Local at most 1.1x the time of FlexAttention used directly", None)
    for backend, method in (("jax", "local_pallas"), ("torch", "local_flex")):
        row, full = get(backend, method), get(backend, FULL[backend])
        name = f"{method} at least 20x faster than full attention"
        if row and full:
            add(name, full["ms"] / row["ms"] >= 20, speedup=full["ms"] / row["ms"],
                ms=row["ms"], full_ms=full["ms"])
        else:
            add(name, None)
        name = f"{method} at least 35% of the measured bf16 matrix-product peak"
        if row and peak and row.get("useful_tflops"):
            add(name, row["useful_tflops"] / peak >= 0.35,
                fraction=row["useful_tflops"] / peak, useful_tflops=row["useful_tflops"],
                peak_tflops=peak)
        else:
            add(name, None)
    million = [r for (b, m, size), r in t.items() if size == MILLION and m.startswith("local")]
    add("1,048,576 tokens of Local forward+backward on one GPU", bool(million) or None,
        runs=[{"backend": r["backend"], "method": r["method"], "ms": r["ms"]} for r in million])
    add(ALL_PATHS, *_all_paths(correctness_table(rows)))
    return out


#: The correctness criterion's name.
ALL_PATHS = ("every Pallas, Flex and cuDNN path equals the reference (float32, bfloat16, "
             "float16 for cuDNN, values and gradients)")


def _all_paths(cases):
    """``(passed, numbers)`` of the correctness criterion: False where a
    case failed or raised, None where none failed but some were not
    checked (cut off by a stage's time limit), True where all passed."""
    failed = [f"{c['backend']}:{c['case']}" for c in cases if c["status"] in ("fail", "error")]
    unchecked = [f"{c['backend']}:{c['case']}" for c in cases
                 if c["status"] not in ("pass", "fail", "error")]
    if failed:
        passed = False
    elif unchecked or not cases:
        passed = None
    else:
        passed = True
    return passed, {"cases": len(cases), "passed_cases": sum(c["status"] == "pass"
                                                              for c in cases),
                    "failed": failed, "unchecked": unchecked}


def sweep_table(rows):
    return [{k: r.get(k) for k in ("variant", "n", "fwd_ms", "bwd_ms", "fwd_bwd_ms",
                                  "fwd_tflops", "tiling", "status", "error")}
            for r in rows if r.get("kind") == "sweep"]


def provenance_record(rows, commit=None):
    """One provenance record (:mod:`keras_longattn.reproductions.provenance`)
    for the whole check: the source files every stage imported, with the
    hashes they had on the device, and the commit they came from."""
    stages = [r for r in rows if r.get("kind") == "provenance"]
    files = {}
    for r in stages:
        files.update(r.get("source_files") or {})
    if not stages:
        return None
    first = stages[0]
    return {"schema": first.get("schema"), "commit": commit or first.get("commit"),
            "date": first.get("date"), "backend": ",".join(sorted({r["backend"] for r in stages})),
            "source_files": dict(sorted(files.items())),
            "machine": first.get("machine")}


def summarize_runs(runs):
    """One document from several runs on one device kind, ``runs`` a list
    of ``(rows, commit)`` in the order they ran: every timing and every
    criterion is computed within one run (ratios never mix runs); each
    criterion is reported from the last run that measured it, each
    correctness case from the last run that checked it, every entry with
    its run's commit. The provenance is the last run's."""
    docs = [summarize(rows, commit) for rows, commit in runs]
    for i, doc in enumerate(docs):
        for key in ("criteria", "correctness", "timings", "timing_failures", "tiling_sweep",
                    "keras_layers"):
            for entry in doc[key]:
                entry["run"] = i + 1
                entry["commit"] = doc["commit"]
    last = dict(docs[-1])
    criteria = {}
    for doc in docs:
        for c in doc["criteria"]:
            if c["passed"] is not None or c["criterion"] not in criteria:
                criteria[c["criterion"]] = c
    last["criteria"] = list(criteria.values())
    cases = {}
    for doc in docs:
        for c in doc["correctness"]:
            if c["status"] in ("pass", "fail") or (c["backend"], c["case"]) not in cases:
                cases[(c["backend"], c["case"])] = c
    last["correctness"] = list(cases.values())
    for key in ("timings", "timing_failures", "tiling_sweep", "keras_layers"):
        last[key] = [e for doc in docs for e in doc[key]]
    last["runs"] = [{"run": i + 1, "commit": d["commit"], "peak_tflops": d["peak_tflops"],
                     "versions": d["versions"]} for i, d in enumerate(docs)]
    # The whole-check criterion again, over the merged cases.
    for c in last["criteria"]:
        if c["criterion"] == ALL_PATHS:
            passed, numbers = _all_paths(last["correctness"])
            c.update(passed=passed, run=None, commit=None, **numbers)
    return last


def summarize(rows, commit=None):
    devices = {r["backend"]: r for r in rows if r.get("kind") == "device"}
    timings, failures = timing_table(rows)
    return {
        "provenance": provenance_record(rows, commit),
        "device": _device(rows).get("name"),
        "dry": any(r.get("dry") for r in rows),
        "commit": commit,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "versions": {b: d.get("versions") for b, d in devices.items()},
        "peak_tflops": _peaks(rows),
        "run_peak_tflops": run_peak(rows),
        "criteria": criteria(rows),
        "correctness": correctness_table(rows),
        "timings": timings,
        "timing_failures": failures,
        "tiling_sweep": sweep_table(rows),
        "keras_layers": [{k: v for k, v in r.items() if k not in ("kind", "dry")}
                         for r in rows if r.get("kind") == "bench"
                         and r.get("method") == "keras_layers" and r.get("status") == "ok"],
    }


def planned_cases(rows):
    """``{(backend, path): [case, ...]}``: the cases the ``correct`` stage
    planned (its ``plan`` lines: every case of the check, whatever shard or
    filter ran), in order."""
    plan = {}
    for r in rows:
        if r.get("kind") != "plan":
            continue
        for c in r.get("cases") or []:
            names = plan.setdefault((r["backend"], c["path"]), [])
            if c["case"] not in names:
                names.append(c["case"])
    return plan


def proof_entries(rows, commit, check, run_files=None):
    """The ``proven.json`` entries one run proves, and those it voids:
    ``(entries, voided)``.

    A path kind on a backend is proven when the run was on an accelerator
    of a known vendor and every case the ``correct`` stage planned for it
    (:func:`planned_cases`) passed in this run: an incomplete run (a case
    cut off by a time limit, filtered out, or unavailable) proves nothing.
    The proof records the vendor, the device, the date, the versions,
    ``check`` (what was run), ``run_files`` (where the run's results are
    committed), the commit and the path's own sources
    (:data:`keras_longattn.kernels.proven.PATH_SOURCES`) with the hashes the
    stage recorded for them on the device (its ``path_sources`` lines,
    which must agree across the stage's processes). ``voided``: the
    ``(backend, vendor, kind)`` of every path with a failed case (its proof
    for that vendor is removed)."""
    from keras_longattn.kernels import proven

    devices = {}
    for r in rows:
        if r.get("kind") == "device":
            devices.setdefault(r["backend"], r)
    cases = correctness_table(rows)
    entries, voided = [], []
    for (backend, kind), planned in sorted(planned_cases(rows).items()):
        device = devices.get(backend) or {}
        vendor = device.get("vendor") or proven.vendor_of(device.get("name"))
        if not device.get("accelerator") or vendor is None or any(r.get("dry") for r in rows):
            continue
        mine = {c["case"]: c for c in cases if c["backend"] == backend and c["path"] == kind}
        if any(c["status"] in ("fail", "error") for c in mine.values()):
            voided.append((backend, vendor, kind))
            continue
        if kind not in proven.PATH_SOURCES or not planned or any(
                mine.get(name, {}).get("status") != "pass" for name in planned):
            continue
        recorded = [r.get("files") for r in rows if r.get("kind") == "path_sources"
                    and r.get("backend") == backend and r.get("path") == kind]
        if not recorded or any(files != recorded[0] for files in recorded):
            continue
        files = dict(sorted(recorded[0].items()))
        if set(files) != set(proven.PATH_SOURCES[kind]) or "missing" in files.values():
            continue
        versions = device.get("versions") or {}
        entries.append({
            "backend": backend,
            "vendor": vendor,
            "kind": kind,
            "devices": [device.get("name")],
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "software": ", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if v),
            "check": check,
            "cases": list(planned),
            "runs": list(run_files or []),
            "commit": commit,
            "sources": files,
        })
    return entries, voided


def merge_proofs(old, new, voided=()):
    """``proven.json``'s entries after a run: each new entry replaces the
    old one of its backend, vendor and kind (keeping the old devices where
    the sources are the same); entries ``voided`` are removed."""
    key = lambda e: (e["backend"], e["vendor"], e["kind"])  # noqa: E731
    gone = set(map(tuple, voided))
    fresh = {key(e): e for e in new}
    out = []
    for e in old:
        k = key(e)
        if k in gone:
            continue
        if k in fresh:
            entry = fresh.pop(k)
            if entry["sources"] == e.get("sources"):
                entry["devices"] = sorted(set(e.get("devices") or []) | set(entry["devices"]))
            out.append(entry)
        else:
            out.append(e)
    out.extend(fresh.values())
    return out


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+",
                        help="results.jsonl of scripts/device_check.sh, one per run, "
                             "in the order they ran")
    parser.add_argument("--write", help="write the summary JSON here")
    parser.add_argument("--commit", action="append",
                        help="commit each run ran on, in the same order (default: HEAD)")
    parser.add_argument("--prove", metavar="PROVEN_JSON",
                        help="write into this proven.json the proofs of the last run: an entry "
                             "for each path kind whose every planned case passed (replacing "
                             "the entry of its backend, vendor and kind), none left for a kind "
                             "with a failed case")
    parser.add_argument("--run-file", action="append",
                        help="where the last run's results.jsonl is committed in the "
                             "repository (the proofs cite it; default: the path given)")
    args = parser.parse_args(argv)
    commits = args.commit or [_git_commit()] * len(args.results)
    if len(commits) != len(args.results):
        parser.error(f"give one --commit per results file. Received: {len(commits)} commits "
                     f"for {len(args.results)} files")
    summary = summarize_runs([(load(path), commit)
                              for path, commit in zip(args.results, commits)])
    if args.prove:
        rows = load(args.results[-1])
        new, voided = proof_entries(rows, commits[-1], (
            "scripts/device_check.sh correct stage: every planned case, outputs and input "
            "gradients against the reference path (float32 and bfloat16; cuDNN: float16 and "
            "bfloat16)"), run_files=args.run_file or [args.results[-1]])
        path = Path(args.prove)
        old = json.loads(path.read_text()) if path.is_file() else []
        path.write_text(json.dumps(merge_proofs(old, new, voided), indent=1) + "\n")
        for e in new:
            print(f"proved {e['kind']} on {e['vendor']} GPUs ({e['backend']}, "
                  f"{e['devices'][0]}): {len(e['cases'])} cases", file=sys.stderr)
        for backend, vendor, kind in voided:
            print(f"removed the proof of {kind} on {vendor} GPUs ({backend}): a case failed",
                  file=sys.stderr)
    text = json.dumps(summary, indent=1, default=str)
    if args.write:
        Path(args.write).write_text(text + "\n")
    else:
        print(text)
    for c in summary["criteria"]:
        mark = {True: "PASS", False: "FAIL", None: "----"}[c["passed"]]
        numbers = {k: v for k, v in c.items() if k not in ("criterion", "passed")}
        print(f"{mark} {c['criterion']} {json.dumps(numbers, default=str)[:200]}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
