"""Per-step cost of never losing a run: the NaN guard in the step, the loop's one-step-late wait.

    python bench/loop_overhead.py                      # all local devices on fsdp
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/loop_overhead.py \
        'model.mesh_shape=[[4,2],["fsdp","tp"]]' training.micro_batch_size=2

Three ways to run the same steps on the same batch, timed in alternating rounds:
- `free`: the framework step dispatched back to back, one wait at the end (the host never waits);
- `one_late`: the training loop's pattern: after dispatching step s, wait for step s-1;
- `unguarded`: like `free`, with optax.apply_if_finite replaced by a pass-through of the same
  state layout (no finiteness check, no conditional).
The last line is JSON with `guard_ratio` = free / unguarded and `wait_ratio` = one_late / free
(goal for both <= 1.03).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

from tunix_train import cli
from tunix_train.training.setup import Setup

ROUNDS, STEPS_PER_ROUND, WARMUP = 5, 8, 3


def pass_through(inner, max_consecutive_errors):
    """apply_if_finite's state layout without its check: the baseline for the guard's cost."""
    del max_consecutive_errors

    def init(params):
        zero = jnp.zeros([], jnp.int32)
        return optax.ApplyIfFiniteState(zero, jnp.array(True), zero, inner.init(params))

    def update(updates, state, params=None):
        updates, inner_state = inner.update(updates, state.inner_state, params)
        return updates, state._replace(inner_state=inner_state)

    return optax.GradientTransformation(init, update)


def stepper(overrides: list[str]):
    cfg = cli.compose(overrides)
    setup = Setup.create(cfg)
    batch = setup.random_batch()
    step = setup.train_step()
    state = [setup.fresh_state()]

    def run(steps: int, one_late: bool) -> float:
        start, previous = time.perf_counter(), None
        for _ in range(steps):
            state[0], metrics = step(state[0], batch)
            if one_late and previous is not None:
                jax.block_until_ready(previous)
            previous = metrics["loss"]
        jax.block_until_ready(previous)
        return (time.perf_counter() - start) / steps

    return run, setup


def main(overrides: list[str]) -> dict:
    guarded, setup = stepper(overrides)
    real_guard = optax.apply_if_finite
    optax.apply_if_finite = pass_through
    try:
        unguarded, _ = stepper(overrides)
    finally:
        optax.apply_if_finite = real_guard
    variants = {"free": lambda n: guarded(n, False), "one_late": lambda n: guarded(n, True),
                "unguarded": lambda n: unguarded(n, False)}
    for fn in variants.values():
        fn(WARMUP)
    times = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, fn in variants.items():
            times[name].append(fn(STEPS_PER_ROUND))
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "guard_ratio": round(median["free"] / median["unguarded"], 4),
        "wait_ratio": round(median["one_late"] / median["free"], 4),
        **{f"{name}_step_s": round(t, 5) for name, t in median.items()},
        "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
        "mesh": dict(setup.mesh.shape), "model": setup.cfg.model.name,
        "tokens_per_step": setup.tokens_per_step,
    }
    print(", ".join(f"{name} {t * 1e3:.2f} ms/step" for name, t in median.items()))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
