"""XLA flags for every test process and every command a test starts (no JAX import here: the
flags must be set before JAX starts its backend).

Most of the suite's time is XLA compiling small programs (58% of its worker time is XLA's
backend compile, 2026-11-28, tests/timing/report.py). Both flags change only how the CPU
backend generates code for the HLO it has optimised: the HLO, its fusion, buffer assignment
and memory analysis are the same, numerics agree within float tolerance, and what a test
compares (runs against runs) is compiled alike on both sides.

- `--xla_backend_optimization_level=0`: no LLVM optimisation of the generated code. Measured
  on tests/test_pipeline.py's fixtures: 30% less CPU time.
- `--xla_cpu_use_fusion_emitters=false`: fusions through XLA's older LLVM emitters rather than
  its MLIR fusion emitters, which cost more to compile than a tiny program's step costs to run
  (2026-11-28, jax 0.10.2, this 2-core VM: a pipeline and a mixture-of-experts train step on 8
  devices compile in 6.3 and 5.9 s instead of 8.0 and 8.0, and step in 0.86 and 1.47 s instead
  of 0.61 and 1.05; tests/test_lora.py, test_pipeline.py and test_moe.py cold on 2 workers:
  185 s instead of 261).
"""

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def with_fast_compile(env: dict) -> dict:
    """`env` (a subprocess environment) with FAST_COMPILE added to its XLA_FLAGS."""
    flags = env.get("XLA_FLAGS", "")
    missing = [flag for flag in FAST_COMPILE if flag.split("=")[0] not in flags]
    env["XLA_FLAGS"] = " ".join([*missing, flags]).strip()
    return env
