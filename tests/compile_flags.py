"""XLA flags for every test process and every command a test starts (no JAX import here: the
flags must be set before JAX starts its backend).

Most of the suite's time is XLA compiling small programs. `--xla_backend_optimization_level=0`
turns off LLVM's optimisation of the generated CPU code only: the HLO, its fusion, buffer
assignment and memory analysis are the same, numerics agree within float tolerance, and what a
test compares (runs against runs) is compiled alike on both sides. Measured on
tests/test_pipeline.py's fixtures: 30% less CPU time.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def with_fast_compile(env: dict) -> dict:
    """`env` (a subprocess environment) with FAST_COMPILE added to its XLA_FLAGS."""
    flags = env.get("XLA_FLAGS", "")
    if FAST_COMPILE not in flags:
        env["XLA_FLAGS"] = f"{FAST_COMPILE} {flags}".strip()
    return env
