"""Tests run on CPU with 8 forced devices; configs are composed through Hydra's compose API."""

import os

from compile_flags import with_fast_compile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
with_fast_compile(os.environ)  # type: ignore[arg-type]
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hashlib  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def compilation_cache_dir() -> Path:
    """One persistent compilation cache per user and installed versions (constraints.txt and the
    Python), kept between runs of the suite.

    Both xdist workers and every CLI subprocess (they inherit the environment) read and write
    it: most tests compile programs another test or an earlier run compiled, and compiling
    dominates a test's time on a 2-core machine. JAX keys each program by its HLO, devices,
    compile options, XLA flags and jax/jaxlib versions, so a hit is the same program: numerics
    are unchanged. Every program is kept (minimum compile time 0), the ~60 small ones a run
    compiles to initialise its state included."""
    versions = (REPO / "constraints.txt").read_bytes() + sys.version.encode()
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "tunix_train" / f"jax-tests-{hashlib.sha256(versions).hexdigest()[:12]}"


os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(compilation_cache_dir()))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Safe under concurrent writers: without a size limit JAX's cache (jax._src.lru_cache.LRUCache)
# writes an entry in place with no lock, so a process reading a key another is still writing
# gets a truncated file (JAX then warns on stderr and compiles again). With a limit, every read
# and write holds the cache's file lock (filelock), and the least recently used entries are
# evicted past it. tests/test_internals.py checks that JAX still works this way.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 * 10**9))
# In a multi-process job a test starts (torchrun, srun, mpirun, the launcher), process 0
# compiles each program the cache lacks and hands it to the others through the job's
# coordination service (JAX's jax_share_binary_between_hosts), rather than every process
# compiling the same program on the same two cores (docs/multi_node.md's torchrun command, 4
# processes, cold: 55 CPU-seconds instead of 78). The others load process 0's program as a cache
# hit loads it. One that never comes is an error after 5 minutes, not a silent wait.
os.environ.setdefault("JAX_SHARE_BINARY_BETWEEN_HOSTS", "true")
os.environ.setdefault("JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS", str(5 * 60 * 1000))
sys.path.insert(0, str(REPO / "tests"))

from tunix_train import gc_policy  # noqa: E402

# A worker runs hundreds of tests in one process whose heap only grows (JAX's caches of traced
# and compiled programs): at CPython's default thresholds its full collections took 20% of a
# file's time (tests/test_lora.py: 29.5 s of 147). The suite's processes collect as the
# commands do (tunix_train/gc_policy.py), and the test modules' imports are frozen out of full
# collections once collected (pytest_collection_finish).
gc_policy.collect_less_often()


def pytest_collection_finish(session) -> None:
    gc_policy.collect_less_often()


def pytest_configure(config) -> None:
    """Where the environment says PYTHONDONTWRITEBYTECODE (CI's machine, this repo's dev VMs),
    no process writes the package's bytecode, so each of the suite's ~220 command starts
    compiled the package from source again (~0.3 s of a 9-11 s start). The controller writes
    it once before the workers start; processes still read bytecode under that variable, and
    a changed source file is compiled again as usual."""
    if not hasattr(config, "workerinput"):
        import compileall

        for folder in ("tunix_train", "tests"):
            compileall.compile_dir(REPO / folder, quiet=1)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# xdist hands whole files to its two workers in collection order (`--dist loadfile`,
# `--no-loadscope-reorder` in pyproject.toml). The files with the longest runs go first, so that
# none of them starts last and keeps one worker busy while the other has finished; the rest
# follow in pytest's order. Worker seconds measured on a 2-core VM (2026-11-28, cold cache,
# tests/timing/report.py): resume ~280, lora ~225, docs as typed guides ~220 / ~220 / pages
# ~125, grpo ~205, context ~200, schedulers ~195, launch ~185, train_step ~175, moe ~165,
# expert_parallel ~140, the pipeline files ~75-95 each.
LONGEST_FIRST = ["test_resume.py", "test_lora.py", "test_docs_as_typed_guides.py",
                 "test_docs_as_typed.py", "test_grpo.py", "test_context.py", "test_schedulers.py",
                 "test_launch.py", "test_train_step.py", "test_moe.py", "test_expert_parallel.py",
                 "test_docs_as_typed_pages.py", "test_pipeline.py", "test_trackers.py",
                 "test_pipeline_leftover.py", "test_model.py", "test_flash.py", "test_offload.py",
                 "test_dpo.py", "test_pipeline_circular.py", "test_cli.py", "test_tools.py",
                 "test_fsdp.py"]


TIMING_DIR = os.environ.get("TUNIX_TEST_TIMING")
if TIMING_DIR:  # opt-in: where each test's time goes (tests/timing/compile_log.py)
    os.makedirs(TIMING_DIR, exist_ok=True)
    _timing = str(REPO / "tests" / "timing")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_timing, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, _timing)
    from compile_log import CompileLog  # noqa: E402

    COMPILE_LOG = CompileLog(TIMING_DIR, subprocess=False)
    COMPILE_LOG.listen()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        COMPILE_LOG.test = item.nodeid
        before = os.times()
        yield
        # CPU seconds of the worker and of the subprocesses it waited for: a test whose wall
        # time is far above them was waiting (a timeout, a poll, a grace period, or the cores
        # the other worker held), not working.
        after, totals = os.times(), COMPILE_LOG.totals[item.nodeid]
        totals["cpu_s"] += after.user + after.system - before.user - before.system
        totals["sub_cpu_s"] += (after.children_user + after.children_system
                                - before.children_user - before.children_system)
        COMPILE_LOG.flush()
        COMPILE_LOG.test = "(outside a test)"


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
