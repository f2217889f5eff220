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
# unchanged.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", __import__("tempfile").mkdtemp(prefix="jaxcc-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
