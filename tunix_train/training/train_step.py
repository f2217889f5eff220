"""The jitted train and eval steps. Pure functions of (state, batch); no I/O.

Loss is the masked next-token cross-entropy in fp32. Gradient accumulation scans over
micro-batches summing unnormalised losses and gradients, then normalises once by the total
token count, so accumulation k × micro-batch b equals one batch of k·b exactly (up to float
summation order). How gradients are summed and reduced over fsdp is parallel/fsdp.py's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from tunix_train.models import (context, lora, params as model_params, quantization,
                                router_losses)
from tunix_train.models.head import VocabChunks
from tunix_train.parallel import fsdp, pipeline, stages
from tunix_train.parallel.mesh import CP
from tunix_train.parallel.sharding import LogicalRules, activate, per_shard_rules
from tunix_train.training.offload import OnDevice, StreamedUpdate
from tunix_train.training.optim import skipped_updates
from tunix_train.training.state import FROZEN, HOST, StateLayout, TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


@dataclass(frozen=True)
class StepOptions:
    compute_dtype: jnp.dtype  # bf16: fp32 master weights cast for compute
    sync: fsdp.GradientSync
    mesh: Mesh
    rules: LogicalRules  # logical → mesh axes for the model's activation constraints
    vocab_chunks: VocabChunks  # how the fused output head + loss cuts the vocabulary
    pipeline: stages.Schedule | None = None  # with a pp axis: the pipeline schedule
    dropout_seed: int | None = None  # LoRA dropout's seed (training.seed); None = no dropout
    # the router's losses (mixture of experts)
    router: router_losses.LossWeights = router_losses.LossWeights()
    streamed: StreamedUpdate | None = None  # training.offload_params: the update layer by layer


def loss_sums(graphdef: nnx.GraphDef, params: Any, batch: Batch,
              vocab_chunks: VocabChunks = VocabChunks(),
              router: router_losses.LossWeights = router_losses.LossWeights()
              ) -> tuple[jax.Array, dict]:
    """(sum of token losses, {"tokens": number of counted tokens}) for one [B, L] batch;
    `params` already in the compute dtype. The logits are formed a vocabulary chunk at a time,
    never whole. A mixture of experts adds its router's losses of this batch, weighted by
    `router` and counted once per token (as transformers adds them to the mean token loss),
    and its `router_losses.METRICS` as sums over tokens."""
    model = nnx.merge(graphdef, params)
    token_loss_BxL, stats = model.losses(batch["inputs"], batch["targets"],
                                         batch.get("positions"), batch.get("segment_ids"),
                                         vocab_chunks)
    weights_BxL = batch["weights"]
    tokens = jnp.sum(weights_BxL)
    loss_sum, metrics = router_losses.with_losses(jnp.sum(token_loss_BxL * weights_BxL), tokens,
                                                  stats, router)
    return loss_sum, {"tokens": tokens, **metrics}


# (graphdef, params, micro-batch, vocab chunks) → (loss sum, sums with "tokens"): the loss a
# step minimises is loss sum / tokens over the whole batch; other sums become metrics.
LossFn = Callable[..., tuple[jax.Array, dict]]


def with_dropout(micro_loss: Callable, seed: int | None) -> Callable:
    """`micro_loss` with LoRA's dropout on: its key comes from the seed and the micro-batch's own
    tokens, so it differs from micro-batch to micro-batch and device to device, and a resumed
    run draws the masks the uninterrupted one drew."""
    if seed is None:
        return micro_loss

    def dropped(params, micro_batch):
        inputs = micro_batch["inputs"].astype(jnp.uint32)
        digest = jnp.sum(inputs * (jnp.arange(inputs.size, dtype=jnp.uint32).reshape(
            inputs.shape) % 65_521 + 1))
        with lora.dropout_key(jax.random.fold_in(jax.random.key(seed), digest)):
            return micro_loss(params, micro_batch)

    return dropped


def train_step_fn(layout: StateLayout, optimizer: optax.GradientTransformation,
                  schedule: optax.Schedule, options: StepOptions,
                  loss_fn: LossFn = loss_sums) -> Callable:
    """The un-jitted step: state, batch → new state, metrics. With another `loss_fn` (GRPO's),
    its sums other than "tokens" are added to the metrics as sums (not yet divided)."""

    micro_loss_fn = _on_the_mesh(loss_fn, options.pipeline)
    routed = {"router": options.router} if loss_fn is loss_sums else {}

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        micro_loss = with_dropout(partial(micro_loss_fn, layout.params.graphdef,
                                          vocab_chunks=options.vocab_chunks, **routed),
                                  options.dropout_seed)
        # Inside the shard_map over fsdp each device sees its own rows: no fsdp constraint.
        # Parameters go in as fp32 shards: each is cast where it is gathered (parallel/fsdp.py).
        with activate(options.mesh, per_shard_rules(options.rules)):  # in effect while jit traces
            grad_sums, loss_sum, sums = fsdp.accumulated_gradients(
                options.sync, micro_loss, state["params"], in_cp_order(batch, options.mesh),
                state.get(FROZEN))
        tokens, per_token = _per_token(sums)
        # A non-finite loss makes every gradient NaN here (in the division that happens anyway),
        # so the optimizer's finiteness guard skips the update even if the gradients were finite.
        denominator = jnp.where(jnp.isfinite(loss_sum), jnp.maximum(tokens, 1.0), jnp.nan)
        params, opt_state, grad_norm = _updated(layout, optimizer, options.streamed, state,
                                                grad_sums, denominator)
        # LoRA's frozen base passes through (donated: no copy).
        new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
        metrics = {
            "loss": loss_sum / denominator,
            "grad_norm": grad_norm,
            "lr": schedule(state["step"]),
            "tokens": tokens,
            "skipped_steps": skipped_updates(opt_state),
            **sums,
            **per_token,
        }
        return new_state, metrics

    return step


def _per_token(sums: Metrics) -> tuple[jax.Array, Metrics]:
    """Takes the token count and the router's loss sums out of `sums`: the count, and those
    sums divided by it."""
    tokens = sums.pop("tokens")
    return tokens, {name: sums.pop(name) / jnp.maximum(tokens, 1.0)
                    for name in router_losses.METRICS if name in sums}


def _on_the_mesh(loss_fn: LossFn, plan: stages.Schedule | None) -> LossFn:
    """A micro-batch's loss sums: `loss_fn`, or on a pp mesh the pipeline's next-token loss."""
    if plan is None:
        return loss_fn
    if loss_fn is not loss_sums:  # config validation refuses these trainers by name first
        raise ValueError("the pipeline schedule computes the next-token loss only; this "
                         "trainer's loss cannot run on a pp mesh")
    return partial(pipeline.loss_sums, plan=plan)


def _updated(layout: StateLayout, optimizer: optax.GradientTransformation,
             streamed: StreamedUpdate | None, state: TrainState, grad_sums: Any,
             denominator: jax.Array) -> tuple[Any, Any, jax.Array]:
    """(parameters, optimizer state, gradient norm) after the optimizer's update."""
    if streamed is not None:  # the parameters in host memory: a layer at a time
        return streamed(grad_sums, denominator, state["opt_state"], state["params"],
                        layout.shardings)
    grads = gradients(grad_sums, denominator)
    opt_state = layout.on_device(state["opt_state"])  # offloaded: host → device
    updates, opt_state = optimizer.update(grads, opt_state, state["params"])
    params, opt_state = (optax.apply_updates(state["params"], updates),
                         layout.to_home(opt_state))
    return params, opt_state, optax.global_norm(grads)


def gradients(sums: Any, denominator: jax.Array) -> Any:
    """The step's fp32 gradients: its gradient sums over the loss's denominator."""
    return jax.tree.map(lambda g: (g / denominator).astype(jnp.float32), sums)


def jit_train_step(layout: StateLayout, optimizer, schedule, options: StepOptions,
                   batch_sharding: NamedSharding, loss_fn: LossFn = loss_sums) -> Callable:
    # The state is donated: the step updates it in place, halving peak state memory.
    return jax.jit(
        train_step_fn(layout, optimizer, schedule, options, loss_fn),
        in_shardings=(layout.shardings, batch_sharding),
        out_shardings=(layout.shardings, None),
        donate_argnums=(0,),
    )


def in_cp_order(batch: Batch, mesh: Mesh) -> Batch:
    """The batch's [..., seq_len] entries in the order cp devices hold a sequence, an early and
    a late piece each (models/context.py: balanced causal attention); unchanged without cp.
    Every entry is per token, and the loss a sum over tokens, so only attention sees the order
    (through the batch's positions and segment ids)."""
    cp = mesh.shape.get(CP, 1)
    if cp == 1:
        return batch
    order = context.balanced_order(batch["inputs"].shape[-1], cp)
    return jax.tree.map(lambda x: x[..., order], batch)


def out_of_cp_order(x: jax.Array, mesh: Mesh) -> jax.Array:
    """A [..., seq_len] result computed `in_cp_order`, back in the sequence's own order."""
    cp = mesh.shape.get(CP, 1)
    if cp == 1:
        return x
    return x[..., np.argsort(context.balanced_order(x.shape[-1], cp))]


def jit_eval_step(layout: StateLayout, options: StepOptions, batch_sharding: NamedSharding,
                  loss_fn: LossFn = loss_sums):
    """(merged params, one [1, rows, seq_len] batch) → (loss sum, the loss's other sums)."""
    def evaluate(params, batch: Batch) -> tuple[jax.Array, dict]:
        single = jax.tree.map(lambda x: x[0], in_cp_order(batch, options.mesh))
        with activate(options.mesh, options.rules):
            if layout.params_offloaded:  # cast a layer at a time, as each reaches the device
                with model_params.hooked(OnDevice(options.compute_dtype)):
                    return loss_fn(layout.params.graphdef, params, single,
                                   vocab_chunks=options.vocab_chunks)
            return loss_fn(layout.params.graphdef,
                           quantization.cast(params, options.compute_dtype),
                           single, vocab_chunks=options.vocab_chunks)

    merged = layout.params.merged_shardings()
    if layout.params_offloaded:
        merged = jax.tree.map(lambda s: s.with_memory_kind(HOST), merged)
    return jax.jit(evaluate, in_shardings=(merged, batch_sharding))
