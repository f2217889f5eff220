"""Shared by the benchmarks: the wall time of a few dispatched steps, waited on at the end, and
the real train step of a configuration as a thing to time."""

import statistics
import time

import jax


def timed(fn, steps: int) -> float:
    """Seconds per call of `fn` over `steps` calls; `fn` returns something to wait on."""
    start = time.perf_counter()
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def train_stepper(overrides: list[str], devices: int | None = None):
    """(setup, run): `run()` takes one real train step of the configuration on a fixed random
    batch, carrying the state, and returns the loss to wait on; on the first `devices` devices
    (default: all)."""
    from tunix_train import cli
    from tunix_train.training.setup import Setup

    setup = Setup.create(cli.compose(overrides), jax.devices()[:devices])
    step, batch, state = setup.train_step(), setup.random_batch(), [setup.fresh_state()]

    def run():
        state[0], metrics = step(state[0], batch)
        return metrics["loss"]

    return setup, run


def alternating_medians(runs: dict, warmup: int, rounds: int, steps: int) -> dict:
    """Median seconds per call of each of `runs`, timed in alternating rounds of `steps` calls
    after `warmup` calls each, so that machine noise hits every variant alike."""
    for run in runs.values():
        timed(run, warmup)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(timed(run, steps))
    return {name: statistics.median(t) for name, t in times.items()}
