"""The jitted train and eval steps. Pure functions of (state, batch); no I/O.

Loss is the masked next-token cross-entropy in fp32. Gradient accumulation scans over
micro-batches summing unnormalised losses and gradients, then normalises once by the total
token count, so accumulation k × micro-batch b equals one batch of k·b exactly (up to float
summation order). How gradients are summed and reduced over fsdp is gradients.py's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tunix_train import gradients
from tunix_train.gradients import GradientPlan
from tunix_train.optim import skipped_updates
from tunix_train.sharding import LogicalRules, activate, per_shard_rules
from tunix_train.state import StateSpec, TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


@dataclass(frozen=True)
class StepOptions:
    compute_dtype: jnp.dtype  # bf16: fp32 master weights cast for compute
    gradients: GradientPlan
    mesh: Mesh
    rules: LogicalRules  # logical → mesh axes for the model's activation constraints


def _cast(tree: Any, dtype: jnp.dtype) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if x.dtype != dtype else x, tree)


def loss_sums(graphdef: nnx.GraphDef, params: Any, batch: Batch,
              compute_dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """(sum of token losses, number of counted tokens) for one [B, L] batch."""
    model = nnx.merge(graphdef, _cast(params, compute_dtype))
    logits_BxLxV = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
    token_loss_BxL = optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV.astype(jnp.float32), batch["targets"]
    )
    weights_BxL = batch["weights"]
    return jnp.sum(token_loss_BxL * weights_BxL), jnp.sum(weights_BxL)


def train_step_fn(spec: StateSpec, optimizer: optax.GradientTransformation,
                  schedule: optax.Schedule, options: StepOptions) -> Callable:
    """The un-jitted step: state, batch → new state, metrics."""

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        # Cast once, still sharded: FSDP then all-gathers parameters in the compute dtype.
        params = jax.lax.with_sharding_constraint(
            _cast(state["params"], options.compute_dtype), spec.shardings["params"])
        loss_fn = partial(loss_sums, spec.graphdef, compute_dtype=options.compute_dtype)
        # Inside the per-shard vmap the batch axis is the shard axis itself: no fsdp constraint.
        with activate(options.mesh, per_shard_rules(options.rules)):  # in effect while jit traces
            grads, loss_sum, tokens = gradients.accumulated(options.gradients, loss_fn, params,
                                                            batch)
        # A non-finite loss makes every gradient NaN here (in the division that happens anyway),
        # so the optimizer's finiteness guard skips the update even if the gradients were finite.
        denominator = jnp.where(jnp.isfinite(loss_sum), jnp.maximum(tokens, 1.0), jnp.nan)
        grads = jax.tree.map(lambda g: (g / denominator).astype(jnp.float32), grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }
        metrics = {
            "loss": loss_sum / denominator,
            "grad_norm": optax.global_norm(grads),
            "lr": schedule(state["step"]),
            "tokens": tokens,
            "skipped_steps": skipped_updates(opt_state),
        }
        return new_state, metrics

    return step


def jit_train_step(spec: StateSpec, optimizer, schedule, options: StepOptions,
                   batch_sharding: NamedSharding) -> Callable:
    # The state is donated: the step updates it in place, halving peak state memory.
    return jax.jit(
        train_step_fn(spec, optimizer, schedule, options),
        in_shardings=(spec.shardings, batch_sharding),
        out_shardings=(spec.shardings, None),
        donate_argnums=(0,),
    )


def jit_eval_step(spec: StateSpec, options: StepOptions, batch_sharding: NamedSharding):
    def evaluate(params, batch: Batch) -> tuple[jax.Array, jax.Array]:
        single = jax.tree.map(lambda x: x[0], batch)
        with activate(options.mesh, options.rules):
            return loss_sums(spec.graphdef, params, single, options.compute_dtype)

    return jax.jit(evaluate, in_shardings=(spec.shardings["params"], batch_sharding))
