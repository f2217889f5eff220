"""Profiler traces of a few steps, and device memory counters for the metrics.

`training.profile_communication=true` traces steps 2-4 (the step is compiled ahead of time, so
none of them compiles) into `<run dir>/tensorboard/plugins/profile/`, where TensorBoard's
profile plugin (`pip install tensorboard-plugin-profile`) shows each collective on a timeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import jax

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
        return out

    return step


def memory_scalars() -> dict[str, float]:
    """Peak bytes in use on this process's busiest device, in GB; empty where the backend
    keeps no counters (CPU)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    return {"peak_memory_gb": max(peaks) / GB} if peaks else {}
