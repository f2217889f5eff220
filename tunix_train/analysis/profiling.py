"""Profiler traces of a few steps, and device memory counters for the metrics.

`training.profile_communication=true` traces steps 2-4 (the step is compiled ahead of time, so
none of them compiles) into `<run dir>/tensorboard/plugins/profile/<time>/`, where TensorBoard's
profile plugin (the `[profile]` extra) shows each collective on a timeline; the
`<host>.trace.json.gz` beside the `.xplane.pb` opens in Perfetto (ui.perfetto.dev) as it is. The
run says where the trace went and how to open it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import jax

log = logging.getLogger("tunix_train")

GB = 1e9


def traced(step_fn: Callable, log_dir: Path, total_steps: int, skip: int = 1,
           steps: int = 3) -> Callable:
    """`step_fn`, with calls skip+1 … skip+steps (as many as the run has) traced."""
    first = min(skip + 1, total_steps)
    last = min(skip + steps, total_steps)
    calls = 0

    def step(*args):
        nonlocal calls
        calls += 1
        if calls == first:
            jax.profiler.start_trace(str(log_dir))
        out = step_fn(*args)
        if calls == last:
            jax.block_until_ready(out)  # the trace must hold the device work, not just dispatch
            jax.profiler.stop_trace()
            say_where(log_dir, first, last)
        return out

    return step


def say_where(log_dir: Path, first: int, last: int) -> None:
    """One line: the trace just written, and the two ways to look at it."""
    traces = sorted(log_dir.glob("plugins/profile/*/*.trace.json.gz"),
                    key=lambda path: path.stat().st_mtime)
    if not traces:  # a backend that wrote only the .xplane.pb
        log.info("profiler trace of steps %d-%d in %s: view it with tensorboard --logdir %s "
                 "(pip install -e '.[profile]', tab Profile)", first, last,
                 log_dir / "plugins" / "profile", log_dir)
        return
    log.info("profiler trace of steps %d-%d: %s (open it at https://ui.perfetto.dev, nothing to "
             "install; or tensorboard --logdir %s with pip install -e '.[profile]', tab Profile)",
             first, last, traces[-1], log_dir)


def memory_scalars() -> dict[str, float]:
    """Peak bytes in use on this process's busiest device, in GB; empty where the backend
    keeps no counters (CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    return {"peak_memory_gb": max(peaks) / GB} if peaks else {}
