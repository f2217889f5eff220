"""Where the suite's time goes, per test and per file: wall time (pytest's JUnit XML, setup and
teardown included, so a module fixture counts in the test that built it) against XLA compile
time (tests/timing/compile_log.py's records, in-process and in the test's subprocesses), and
against CPU time (the worker's and that of the subprocesses it waited for; tests/conftest.py):
a test far above both was waiting (or for the cores the other worker held), not working.

    TUNIX_TEST_TIMING=/tmp/timing python -m pytest -q --junitxml=/tmp/junit.xml
    python tests/timing/report.py /tmp/timing /tmp/junit.xml [--top 30]
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def wall_times(junit: Path) -> dict[str, float]:
    """nodeid → seconds, from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        out[f"{path}.py::{case.get('name')}"] = float(case.get("time", 0))
    return out


def compile_times(folder: Path) -> dict[str, dict[str, float]]:
    """nodeid → summed compile records (in-process and subprocess kept apart)."""
    out: dict = defaultdict(lambda: defaultdict(float))
    for file in folder.glob("*.jsonl"):
        for record in map(json.loads, file.read_text().splitlines()):
            prefix = "sub_" if record.pop("subprocess") else ""
            totals = out[record.pop("test")]
            record.pop("programs", None)  # repeated_programs() reads them
            for key, value in record.items():
                totals[prefix + key] += value
    return out


def row(name: str, wall: float, c: dict) -> str:
    compiled = c.get("compile_s", 0) + c.get("trace_s", 0) + c.get("lower_s", 0)
    sub = c.get("sub_compile_s", 0) + c.get("sub_trace_s", 0) + c.get("sub_lower_s", 0)
    return (f"| {wall:7.1f} | {compiled:6.1f} | {int(c.get('misses', 0)):4d} | "
            f"{int(c.get('sub_processes', 0)):3d} | {c.get('sub_wall_s', 0):6.1f} | {sub:6.1f} | "
            f"{c.get('cpu_s', 0):6.1f} | {c.get('sub_cpu_s', 0):6.1f} | {name} |")


HEADER = ("| wall s | compile s | misses | subprocs | their wall s | their compile s | CPU s | "
          "their CPU s | test |\n|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("timing", type=Path)
    parser.add_argument("junit", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    walls, compiles = wall_times(args.junit), compile_times(args.timing)
    print(f"## The {args.top} slowest tests\n\n{HEADER}")
    for name, wall in sorted(walls.items(), key=lambda kv: -kv[1])[:args.top]:
        print(row(name, wall, compiles.get(name, {})))
    files: dict = defaultdict(lambda: [0.0, defaultdict(float)])
    for name, wall in walls.items():
        entry = files[name.split("::")[0]]
        entry[0] += wall
        for key, value in compiles.get(name, {}).items():
            entry[1][key] += value
    print(f"\n## Worker time per file (all {len(walls)} tests: "
          f"{sum(walls.values()) / 60:.1f} worker-minutes)\n\n{HEADER}")
    for name, (wall, c) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(row(name, wall, c))


if __name__ == "__main__":
    main()
