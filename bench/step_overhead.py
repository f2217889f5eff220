"""Framework train step vs a hand-written minimal `jax.jit` step: same model, batch and mesh.

    python bench/step_overhead.py                      # all local devices on fsdp
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/step_overhead.py \
        'model.mesh_shape=[[4,2],["fsdp","tp"]]' training.micro_batch_size=2

Any Hydra override of run_training.py is accepted. Both steps are compiled, warmed up, then
timed in alternating rounds so that machine noise hits both alike. The last line is JSON with
`ratio` = framework / hand-written median step time (goal <= 1.03).
"""

from __future__ import annotations

import json
import statistics
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tunix_train import cli
from timing import timed
from tunix_train.training.setup import Setup

ROUNDS, STEPS_PER_ROUND, WARMUP = 5, 4, 2


def hand_written_step(graphdef, optimizer, compute_dtype):
    """What a user would write by hand: mean cross-entropy, grad, optax update. Nothing else."""

    def step(params, opt_state, inputs, targets):
        def loss_fn(p):
            p = jax.tree.map(lambda x: x.astype(compute_dtype), p)
            logits = nnx.merge(graphdef, p)(inputs).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def main(overrides: list[str]) -> dict:
    cfg = cli.compose(overrides)
    setup = Setup.create(cfg)
    assert setup.batch.accum == 1, "compare without accumulation: the hand-written step has none"
    batch = setup.random_batch()

    framework = setup.train_step()
    fw_state = [setup.fresh_state()]

    def framework_step():
        fw_state[0], metrics = framework(fw_state[0], batch)
        return metrics["loss"]

    hand = hand_written_step(setup.params.graphdef, setup.optimizer, setup.options.compute_dtype)
    init = setup.fresh_state()
    hw_state = [init["params"], init["opt_state"]]
    hw_batch = batch["inputs"][0], batch["targets"][0]  # [B, L], rows sharded as the framework's

    def hand_step():
        hw_state[0], hw_state[1], loss = hand(hw_state[0], hw_state[1], *hw_batch)
        return loss

    for fn in (framework_step, hand_step):
        timed(fn, WARMUP)
    fw_times, hw_times = [], []
    for _ in range(ROUNDS):
        fw_times.append(timed(framework_step, STEPS_PER_ROUND))
        hw_times.append(timed(hand_step, STEPS_PER_ROUND))
    fw, hw = statistics.median(fw_times), statistics.median(hw_times)
    result = {
        "ratio": round(fw / hw, 4), "framework_step_s": round(fw, 5),
        "hand_written_step_s": round(hw, 5), "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind, "mesh": dict(setup.mesh.shape),
        "model": cfg.model.name, "tokens_per_step": setup.tokens_per_step,
    }
    print(f"framework {fw * 1e3:.1f} ms/step, hand-written {hw * 1e3:.1f} ms/step")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
