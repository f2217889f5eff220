"""Tests run on CPU with 8 forced devices; configs are composed through Hydra's compose API."""

import os

from compile_flags import with_fast_compile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
with_fast_compile(os.environ)  # type: ignore[arg-type]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, shared with the CLI subprocesses (they inherit
# the environment): most of them compile the same tiny programs, and compiling dominates their
# time on a 2-core machine. Compiled programs are keyed by their HLO and devices, so numerics are
# unchanged. Every program is kept, the ~60 small ones a run compiles to initialise its state
# included (together ~2 s of a run's ~16 s when found in the cache).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", __import__("tempfile").mkdtemp(prefix="jaxcc-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


# xdist hands whole files to its two workers in collection order (`--dist loadfile`,
# `--no-loadscope-reorder` in pyproject.toml). The files with the longest runs go first, so that
# none of them starts last and keeps one worker busy while the other has finished; the rest
# follow in pytest's order. Worker minutes measured on a 2-core VM (2026-11-25): docs as typed
# ~19, grpo ~10, the three pipeline files ~13 together, launch ~8, lora ~6, resume ~5, dpo ~5.
LONGEST_FIRST = ["test_docs_as_typed.py", "test_grpo.py", "test_schedulers.py", "test_launch.py",
                 "test_lora.py", "test_pipeline.py", "test_resume.py",
                 "test_pipeline_leftover.py", "test_pipeline_circular.py", "test_dpo.py",
                 "test_blockwise.py"]


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
