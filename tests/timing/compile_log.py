"""Where a test's time goes: XLA compilation (or a cache read) against everything else.

Opt-in: with TUNIX_TEST_TIMING=<dir> set, every test process (pytest's workers through
tests/conftest.py, and every subprocess a test starts through this folder's sitecustomize.py)
appends one JSON line per test to <dir>/<pid>.jsonl with the seconds JAX spent tracing, lowering
and compiling (a persistent-cache read counts as compiling), and its cache hits and misses.
`python tests/timing/report.py <dir> <pytest's durations file>` sums them per test and per file.
"""

import atexit
import json
import os
import time
from collections import defaultdict

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
        self._log_programs()

    def _log_programs(self) -> None:
        """Each persistent-cache lookup's program name and key, under the running test: a key
        looked up twice in one process is a program traced and lowered twice (a shared fixture
        could keep it), one looked up in several processes the same program compiled or read
        in each. JAX reports no key of its own, so this wraps its private `_cache_read`."""
        import sys

        from jax._src import compiler

        read = getattr(compiler, "_cache_read", None)
        if read is None:  # a JAX release that moved it: the times are still logged
            print("tests/timing: jax._src.compiler._cache_read is gone; programs not logged",
                  file=sys.stderr)
            return

        def logged_read(module_name, cache_key, *args, **kwargs):
            self.totals[self.test].setdefault("programs", []).append([module_name, cache_key])
            return read(module_name, cache_key, *args, **kwargs)

        compiler._cache_read = logged_read

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
    _after_import("jax", log.listen)
    atexit.register(log.flush)  # atexit runs last-in first-out: the wall time below is taken first
    atexit.register(lambda: log.totals[log.test].__setitem__(
        "wall_s", time.perf_counter() - started))


def _after_import(name: str, then) -> None:
    """Runs `then()` right after module `name` is first imported (nothing for processes that
    never import it)."""
    import importlib.abc
    import importlib.machinery
    import sys

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_then(module):
                exec_module(module)
                then()

            spec.loader.exec_module = exec_and_then
            return spec

    sys.meta_path.insert(0, Finder())
