"""Where a test's time goes: XLA compilation (or a cache read) against everything else.

Opt-in: with TUNIX_TEST_TIMING=<dir> set, every test process (pytest's workers through
tests/conftest.py, and every subprocess a test starts through tests/site/sitecustomize.py)
appends one JSON line per test to <dir>/<pid>.jsonl with the seconds JAX spent tracing, lowering
and compiling (a persistent-cache read counts as compiling), and its cache hits and misses.
`python tests/timing/report.py <dir> <pytest's durations file>` sums them per test and per file.
"""

import atexit
import json
import os
import time
from collections import defaultdict

import suite_cache  # tests/site, on the path of every process of the suite

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
}
COUNTS = {"/jax/compilation_cache/cache_hits": "hits",
          "/jax/compilation_cache/cache_misses": "misses"}


class CompileLog:
    """Sums JAX's compile events under the name of the test that is running."""

    def __init__(self, out_dir: str, subprocess: bool):
        self.path = os.path.join(out_dir, f"{os.getpid()}.jsonl")
        self.subprocess = subprocess
        self.test = "(outside a test)"
        self.totals: dict = defaultdict(lambda: defaultdict(float))

    def listen(self) -> None:
        import jax.monitoring as monitoring

        def on_duration(event: str, seconds: float, **_) -> None:
            if event in EVENTS:
                self.totals[self.test][EVENTS[event]] += seconds

        def on_event(event: str, **_) -> None:
            if event in COUNTS:
                self.totals[self.test][COUNTS[event]] += 1

        monitoring.register_event_duration_secs_listener(on_duration)
        monitoring.register_event_listener(on_event)

    def flush(self) -> None:
        with open(self.path, "a") as f:
            for test, totals in self.totals.items():
                f.write(json.dumps({"test": test, "subprocess": self.subprocess, **totals}) + "\n")
        self.totals.clear()


def for_subprocess() -> None:
    """Called by sitecustomize.py: log under the test that started this process, once JAX loads."""
    out_dir = os.environ.get("TUNIX_TEST_TIMING")
    current = os.environ.get("PYTEST_CURRENT_TEST")
    if not out_dir or not current:
        return
    log = CompileLog(out_dir, subprocess=True)
    log.test = current.rsplit(" (", 1)[0]
    started = time.perf_counter()
    log.totals[log.test]["processes"] += 1
    suite_cache.after_import("jax", log.listen)
    atexit.register(log.flush)  # atexit runs last-in first-out: the wall time below is taken first
    atexit.register(lambda: log.totals[log.test].__setitem__(
        "wall_s", time.perf_counter() - started))
