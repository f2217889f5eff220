"""Shared by the benchmarks: the wall time of a few dispatched steps, waited on at the end."""

import time

import jax


def timed(fn, steps: int) -> float:
    """Seconds per call of `fn` over `steps` calls; `fn` returns something to wait on."""
    start = time.perf_counter()
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps
