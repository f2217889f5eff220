"""XLA flags for every test process and every command a test starts (no JAX import here: the
flags must be set before JAX starts its backend).

Most of the suite's time is XLA compiling small programs (58% of its worker time is XLA's
backend compile, 2026-11-28, tests/timing/report.py). What a test compares (runs against runs)
is compiled alike on both sides; numerics agree within float tolerance.

- `--xla_backend_optimization_level=0` (SAME_PROGRAM): no LLVM optimisation of the generated
  code; the HLO, its fusion, buffer assignment and memory analysis are a user's. Measured on
  tests/test_pipeline.py's fixtures: 30% less CPU time.
- `--xla_disable_hlo_passes=hlo-verifier` (SAME_PROGRAM): XLA does not re-check the HLO's
  invariants between its passes (a check for XLA's own bugs; it changes nothing it compiles).
  Measured 2026-12-04 on this 2-core VM (fresh processes, empty caches, alternating, medians of
  3 and of 5 rounds): the backend compile of a one-stack tiny step 0.81 -> 0.75 and 1.12 ->
  0.91 s, the 2x2x2 pipeline step 5.78 -> 4.95 and 6.69 -> 6.28 s, the qwen3_moe 4x2 step 4.36
  -> 4.15 and 5.01 -> 4.48 s.
- `--xla_cpu_use_fusion_emitters=false`: fusions through XLA's older LLVM emitters rather than
  its MLIR fusion emitters, which cost more to compile than a tiny program's step costs to run
  (2026-11-28, jax 0.10.2, this 2-core VM: a pipeline and a mixture-of-experts train step on 8
  devices compile in 6.3 and 5.9 s instead of 8.0 and 8.0, and step in 0.86 and 1.47 s instead
  of 0.61 and 1.05; tests/test_lora.py, test_pipeline.py and test_moe.py cold on 2 workers:
  185 s instead of 261; the three docs-as-typed files in fresh-clone cold runs of the suite:
  9.4 worker-minutes with it, 13.1 without). It changes XLA's CPU memory analysis (the
  fusions' temporaries), so a planner command a page shows (tests/typed_docs.py) runs without
  it: the figures it prints are the ones a user's prints. jaxlib 0.11 has no such flag (its
  XLA aborts the process on a flag it does not know; the MLIR emitters are its CPU compiler's
  only ones), so there the suite compiles with them.

Neither pays where a command runs many steps: a page's full-length example (docs/grpo.md's 48
GRPO steps, the checkpointing page's 600) runs as a user's does, with XLA's defaults
(`Typed.run(..., many_steps=True)`).
"""

from importlib.metadata import version

SAME_PROGRAM = ("--xla_backend_optimization_level=0", "--xla_disable_hlo_passes=hlo-verifier")
_OLD_EMITTERS = (("--xla_cpu_use_fusion_emitters=false",)
                 if tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11)
                 else ())
FAST_COMPILE = (*SAME_PROGRAM, *_OLD_EMITTERS)


def with_fast_compile(env: dict, flags: tuple[str, ...] = FAST_COMPILE) -> dict:
    """`env` (a subprocess environment) with `flags` added to its XLA_FLAGS."""
    given = env.get("XLA_FLAGS", "")
    missing = [flag for flag in flags if flag.split("=")[0] not in given]
    env["XLA_FLAGS"] = " ".join([*missing, given]).strip()
    return env
