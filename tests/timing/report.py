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


def program_lookups(folder: Path) -> tuple[dict, dict]:
    """From the compilation-cache lookups (program name, key) of every process: by program
    name, [lookups of a program the same process had looked up before (traced and lowered
    again: a fixture shared across tests, or one function jitted once, would keep it), the
    files of the tests that made them], and [programs looked up in several processes, the
    processes beyond each one's first (each compiled or read it itself)]."""
    again: dict = defaultdict(lambda: [0, set()])
    processes: dict = defaultdict(set)  # (name, key) → the processes that looked it up
    for file in folder.glob("*.jsonl"):
        seen: set = set()
        for record in map(json.loads, file.read_text().splitlines()):
            for name, key in record.get("programs", []):
                processes[name, key].add(file.stem)
                if (name, key) in seen:
                    again[name][0] += 1
                    again[name][1].add(record["test"].split("::")[0])
                seen.add((name, key))
    shared: dict = defaultdict(lambda: [0, 0])
    for (name, _), pids in processes.items():
        if len(pids) > 1:
            shared[name][0] += 1
            shared[name][1] += len(pids) - 1
    return again, shared


def repeated_programs(folder: Path, top: int) -> str:
    """program_lookups() as two tables, the most repeated programs first."""
    again, shared = program_lookups(folder)
    lines = [f"## Programs looked up again in the same process "
             f"({sum(n for n, _ in again.values())} lookups)\n",
             "| lookups again | program | files |", "|---:|---|---|"]
    for name, (n, files) in sorted(again.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {n} | {name} | {len(files)} |")
    lines += [f"\n## Programs looked up in more than one process "
              f"({sum(p for _, p in shared.values())} processes beyond each program's first)\n",
              "| programs | processes beyond the first | program |", "|---:|---:|---|"]
    for name, (n, extra) in sorted(shared.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {n} | {extra} | {name} |")
    return "\n".join(lines)


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
    print("\n" + repeated_programs(args.timing, args.top))


if __name__ == "__main__":
    main()
