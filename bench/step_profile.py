"""Where a train step's device time goes: a few steps under JAX's profiler, their kernels summed
by kind and by XLA operation, each operation named by the model code it came from.

    python bench/step_profile.py model=gemma3_1b data.seq_len=2048 \\
        training.mixed_precision=bf16 training.micro_batch_size=16 training.remat=full

Any run_training.py override is accepted; the step and its batch are bench/mfu.py's (the
framework's own step, one real batch already on the devices). Prints the step's wall time, the
device's busy time (kernel durations summed; the rest of the wall time is the device waiting on
the host or on launches), the busy time by kind (matmul, attention, fused elementwise and
reductions, copies, collectives), then the `PROFILE_TOP` (default 25) costliest XLA operations
with the `op_name` JAX gave them (the model's call path: which layer part, forward or
backward). On a GPU it reads the kernels of the device's streams; on a CPU, XLA's thunks (so
the script itself can be tried here). The last line is JSON. `PROFILE_DIR` keeps the trace
(TensorBoard's profile plugin or ui.perfetto.dev open it); a temporary directory otherwise.
"""

from __future__ import annotations

import collections
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mfu import _batch  # noqa: E402
from tunix_train import cli  # noqa: E402
from tunix_train.training.setup import Setup  # noqa: E402

STEPS = 3
# A collective by its XLA operation's or kernel's own name (XLA's CPU names some with dashes,
# some with underscores), never by its call path: a tensor-parallel all-reduce carries the
# op_name of the matmul whose partial sums it adds.
COLLECTIVES = ("nccl", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "all_gather",
               "reduce_scatter", "all_to_all", "collective-permute")
KINDS = (  # (kind, words in a kernel's or operation's name), the first that matches
    ("attention", ("fmha", "flash", "cudnn", "attention", "attn")),
    ("matmul", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "dot", "matmul", "wgmma")),
    ("copy", ("memcpy", "memset", "copy", "dynamic-update-slice")),
    ("fusion", ("fusion", "reduce", "convert", "transpose", "broadcast", "loop", "input")),
)


def main(overrides: list[str]) -> dict:
    setup = Setup.create(cli.compose(overrides))
    batch = _batch(setup)
    compiled = setup.train_step().lower(setup.fresh_state(), batch).compile()
    state = setup.fresh_state()
    for _ in range(STEPS):  # warm up
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics["loss"])
    walls = []
    trace_dir = os.environ.get("PROFILE_DIR") or tempfile.mkdtemp(prefix="step_profile_")
    jax.profiler.start_trace(trace_dir)
    for _ in range(STEPS):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics["loss"])
        walls.append(time.perf_counter() - start)
    jax.profiler.stop_trace()
    ops = kernel_times(newest_trace(Path(trace_dir)))
    return report(ops, statistics.median(walls), op_names(compiled.as_text()))


def newest_trace(trace_dir: Path) -> Path:
    return max(trace_dir.glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)


def kernel_times(path: Path) -> dict[tuple[str, str], list[float]]:
    """{(XLA operation, kernel): [total ns, launches]} over the trace's device work: a GPU's
    stream lines, else the host's XLA thunks (the events that name an hlo_op)."""
    planes = list(jax.profiler.ProfileData.from_file(str(path)).planes)  # an iterator
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    times: dict = collections.defaultdict(lambda: [0.0, 0])
    for plane in gpu or [p for p in planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if gpu and not line.name.startswith("Stream"):
                continue  # derived lines (XLA Ops, Modules, Steps) repeat the streams' time
            for event in line.events:
                op = dict(event.stats).get("hlo_op")
                if op is None and not gpu:
                    continue
                entry = times[(op or "?", event.name)]
                entry[0] += event.duration_ns
                entry[1] += 1
    return times


def op_names(hlo: str) -> dict[str, str]:
    """Each instruction of the compiled HLO: its result's shape and the op_name JAX gave it
    (its call path)."""
    found = re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"", hlo,
                        re.M)
    return {m.group(1): f"{re.sub(r'[{].*', '', m.group(2))} {m.group(3)}" for m in found}


def kind_of(op: str, kernel: str, path_end: str = "") -> str:
    if any(w in f"{kernel} {op}".lower() for w in COLLECTIVES):
        return "collective"
    name = f"{kernel} {op} {path_end}".lower()
    return next((kind for kind, words in KINDS if any(w in name for w in words)), "other")


def _short(name: str) -> str:
    """The result's shape and the call path's end (the primitive and what encloses it)."""
    shape, _, path = name.partition(" ")
    return f"{shape[:34]:<34} {path[-70:]}"


def report(ops: dict, wall_s: float, names: dict[str, str]) -> dict:
    busy_s = sum(ns for ns, _ in ops.values()) / 1e9 / STEPS
    kinds: dict = collections.Counter()
    by_op: dict = collections.defaultdict(lambda: [0.0, 0, set()])
    for (op, kernel), (ns, launches) in ops.items():
        kinds[kind_of(op, kernel, names.get(op, "").rpartition("/")[2])] += ns / 1e6 / STEPS
        by_op[op][0] += ns / 1e6 / STEPS
        by_op[op][1] += launches // STEPS
        by_op[op][2].add(kernel)
    print(f"step {wall_s * 1e3:.1f} ms wall, device busy {busy_s * 1e3:.1f} ms "
          f"({busy_s / wall_s:.0%}; summed over streams), {sum(v[1] for v in by_op.values())} "
          "launches a step")
    for kind, ms in kinds.most_common():
        print(f"  {kind:<11} {ms:9.1f} ms  {ms / 1e3 / busy_s:6.1%}")
    top = sorted(by_op.items(), key=lambda item: -item[1][0])[:int(os.environ.get("PROFILE_TOP",
                                                                                  25))]
    for op, (ms, launches, kernels) in top:
        print(f"{ms:8.2f} ms {launches:5d}x {op[:28]:<28} {sorted(kernels)[0][:40]:<40} "
              f"{_short(names.get(op, ''))}")
    result = {"step_ms": round(wall_s * 1e3, 2), "busy_ms": round(busy_s * 1e3, 2),
              "kinds_ms": {k: round(v, 2) for k, v in kinds.items()},
              "top": [[op, round(v[0], 3), v[1]] for op, v in top]}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
