"""Whether an XLA flag makes the suite compile faster: one fresh process per setting and round,
alternating, each with an empty compilation cache of its own and the suite's XLA flags
(tests/compile_flags.py), with and without `--flags`. Each builds train steps the suite
compiles (the one-stack tiny model on one device, the pipeline tests' model on a 2x2x2 mesh, the
MoE family on fsdp 4 x tp 2) and times tracing, lowering and compiling them cold, then again
from the cache (warm). Prints the medians without -> with the flags; the last line is JSON.

    python tests/timing/xla_flags_ab.py --flags=--xla_disable_hlo_passes=hlo-verifier --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from compile_flags import FAST_COMPILE  # noqa: E402
from helpers import ONE_STACK, TINY, family_tiny, mesh_arg, mesh_of  # noqa: E402

PROGRAMS = {  # name -> (overrides, devices)
    "one stack, 1 device": ([*ONE_STACK, mesh_arg(1, 1)], 1),
    "pipeline 2x2x2": ([*TINY, "model.num_layers=9", "model.global_every=2",
                        "training.global_batch_size=16", "training.gradient_accumulation_steps=2",
                        mesh_of([[2, 2, 2], ["pp", "fsdp", "tp"]])], 8),
    "qwen3_moe 4x2": (family_tiny("qwen3_moe", mesh_arg(4, 2)), 8),
}
PHASES = ("trace", "lower", "compile")

CHILD = """
import json, sys, time
import jax
sys.path.insert(0, {tests!r})
import helpers
from tunix_train import gc_policy
from tunix_train.training.setup import Setup
gc_policy.collect_less_often()
setup = Setup.create(helpers.compose_config(*{overrides!r}), jax.devices()[:{devices}])
args = (setup.state.with_shardings(), setup.abstract_batch(None))
out = {{}}
for when in ("cold", "warm"):
    t0 = time.perf_counter(); traced = setup.train_step().trace(*args)
    t1 = time.perf_counter(); lowered = traced.lower()
    t2 = time.perf_counter(); lowered.compile()
    t3 = time.perf_counter()
    out[when] = dict(trace=t1 - t0, lower=t2 - t1, compile=t3 - t2)
print(json.dumps(out))
"""


def suite_flags(tested: str) -> list[str]:
    """The suite's XLA flags but those `tested` sets (the run without them)."""
    names = {flag.split("=")[0] for flag in tested.split()}
    return [flag for flag in FAST_COMPILE if flag.split("=")[0] not in names]


def one_process(program: tuple[list[str], int], flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": cache,
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
               "XLA_FLAGS": " ".join(["--xla_force_host_platform_device_count=8", *flags])}
        overrides, devices = program
        code = CHILD.format(tests=str(TESTS), overrides=overrides, devices=devices)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flags", required=True, help="XLA flags to add, as in XLA_FLAGS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="the programs whose name holds this")
    args = parser.parse_args()
    report = {}
    for name, program in PROGRAMS.items():
        if args.only not in name:
            continue
        times: dict = {False: [], True: []}
        for _ in range(args.rounds):
            for flagged in (False, True):
                extra = args.flags.split() if flagged else []
                times[flagged].append(one_process(program, [*suite_flags(args.flags), *extra]))
        row = {}
        for when in ("cold", "warm"):
            for phase in PHASES:
                medians = [statistics.median(t[when][phase] for t in times[flagged])
                           for flagged in (False, True)]
                row[f"{when}_{phase}"] = {"without": round(medians[0], 3),
                                          "with": round(medians[1], 3),
                                          "ratio": round(medians[1] / medians[0], 3)}
            print(f"{name:22s} {when}: " + "  ".join(
                f"{phase} {row[f'{when}_{phase}']['without']:.2f} -> "
                f"{row[f'{when}_{phase}']['with']:.2f} s" for phase in PHASES), flush=True)
        report[name] = row
    print(json.dumps(report))


if __name__ == "__main__":
    main()
