"""Where the unit tests' time goes: sums the test times of pytest's JUnit
reports (scripts/test.sh writes build/test-logs/unit-<lane>.xml) by test file,
and by folder, largest first:

    python scripts/test_times.py build/test-logs/unit-*.xml [--top 40]
"""

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path


def times(paths):
    """``{(report name, test file): seconds}`` over every test case."""
    totals = collections.Counter()
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")
            # classname: tests.layers.test_x[.TestClass]
            parts = [p for p in module if not p[:1].isupper()]
            totals[(Path(path).stem, "/".join(parts) + ".py")] += float(case.get("time") or 0)
    return totals


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    totals = times(args.reports)
    by_lane = collections.Counter()
    by_folder = collections.Counter()
    by_file = collections.Counter()
    for (lane, name), seconds in totals.items():
        by_lane[lane] += seconds
        by_folder[(lane, name.rsplit("/", 1)[0])] += seconds
        by_file[name] += seconds
    print("by report:")
    for lane, seconds in by_lane.most_common():
        print(f"  {seconds:8.0f} s  {lane}")
    print("by folder and report:")
    for (lane, folder), seconds in by_folder.most_common(args.top):
        print(f"  {seconds:8.0f} s  {folder}  ({lane})")
    print("by file, all reports:")
    for name, seconds in by_file.most_common(args.top):
        print(f"  {seconds:8.0f} s  {name}")


if __name__ == "__main__":
    main()
