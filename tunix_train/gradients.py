"""Gradients of one optimizer step, and where and how often they are reduced over `fsdp`.

Each fsdp shard's gradient is computed *unreduced* (a `vmap` over a leading shard axis that is
itself sharded over fsdp, so no device talks to another), summed locally over
`sync_every` micro-batches, then reduced explicitly:

    zero_stage 0, 1   psum          (all-reduce: every device keeps the whole gradient)
    zero_stage 2, 3   psum_scatter  (reduce-scatter: each device keeps its shard)

Making the reduction explicit, rather than leaving it to XLA's partitioner, is what fixes its
kind, its dtype (the compute dtype: bf16 under mixed precision) and its count
(accumulation / sync_every per optimizer step) on every backend; left to itself, XLA reduces
each layer's gradient inside the backward pass in whatever kind and dtype its backend chooses
(on CPU: fp32 all-reduces, even at ZeRO-3). The price is a local buffer: between reductions
each device holds one full, unreduced gradient (its tp share) in the compute dtype, plus an fp32
accumulator when `sync_every` > 1. Reducing layer by layer inside the backward pass would avoid
the buffer at `sync_every` = 1, but needs the model's layer scan to call the reduction (an FSDP
formulation in `shard_map`); not done yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train.mesh import FSDP

SYNC_SCOPE = "gradient_sync"  # named scope of the reductions; the comm report looks for it


@dataclass(frozen=True)
class GradientPlan:
    """Static facts about one step's gradients."""

    mesh: Mesh
    grad_specs: Any  # PartitionSpec per parameter: the reduced gradient's layout
    accumulation_steps: int
    sync_every: int  # micro-steps summed locally between reductions
    reduce_dtype: jnp.dtype  # dtype the reductions travel in

    @property
    def fsdp(self) -> int:
        return self.mesh.shape[FSDP]

    @property
    def reductions_per_step(self) -> int:
        return self.accumulation_steps // self.sync_every


def _padded(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _without_fsdp(spec: tuple) -> tuple:
    return tuple(None if axis == FSDP else axis for axis in spec)


def unreduced_spec(spec: P, ndim: int) -> P:
    """[fsdp shards, *param] layout of an unreduced gradient: shards over fsdp, the rest as tp."""
    return P(FSDP, *_without_fsdp(_padded(spec, ndim)))


def reduce(plan: GradientPlan, grads_S: Any) -> Any:
    """Sums [shards, *param] gradients over fsdp: reduce-scatter where the reduced gradient is
    sharded over fsdp, all-reduce where it is not. Travels in `plan.reduce_dtype`."""
    leaves, treedef = jax.tree.flatten(grads_S)
    specs = [_padded(s, g.ndim - 1) for s, g in
             zip(treedef.flatten_up_to(plan.grad_specs), leaves)]

    def reduce_local(*blocks):
        out = []
        for block, spec in zip(blocks, specs):
            g = block[0].astype(plan.reduce_dtype)
            if FSDP in spec:
                out.append(jax.lax.psum_scatter(g, FSDP, scatter_dimension=spec.index(FSDP),
                                                tiled=True))
            else:
                out.append(jax.lax.psum(g, FSDP))
        return tuple(out)

    with jax.named_scope(SYNC_SCOPE):
        reduced = jax.shard_map(
            reduce_local, mesh=plan.mesh,
            in_specs=tuple(P(FSDP, *_without_fsdp(s)) for s in specs),
            out_specs=tuple(P(*s) for s in specs),
        )(*leaves)
    return treedef.unflatten([g.astype(jnp.float32) for g in reduced])


def local_gradient_bytes(plan: GradientPlan, params: Any, dtype: jnp.dtype) -> int:
    """Per-device bytes of one unreduced gradient: this device's tp share of every parameter.
    It is also what one reduction carries per device (the reduce-scatter's input)."""
    leaves, treedef = jax.tree.flatten(params)
    total = 0
    for p, spec in zip(leaves, treedef.flatten_up_to(plan.grad_specs)):
        local = NamedSharding(plan.mesh, P(*_without_fsdp(_padded(spec, p.ndim))))
        total += math.prod(local.shard_shape(p.shape)) * jnp.dtype(dtype).itemsize
    return total


def _split_shards(plan: GradientPlan, micro_batch: dict) -> dict:
    """[B, L] → [fsdp, B / fsdp, L]: each shard's rows, where they already live."""
    sharding = NamedSharding(plan.mesh, P(FSDP))
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            x.reshape(plan.fsdp, x.shape[0] // plan.fsdp, *x.shape[1:]), sharding),
        micro_batch,
    )


def local_grads(plan: GradientPlan, loss_fn: Callable, params: Any, micro_batch: dict):
    """(unreduced [fsdp, *param] gradients, loss sum, token count) of one micro-batch.

    `loss_fn(params, batch) -> (loss_sum, tokens)` sees one shard's rows; the model's batch
    constraint must not name fsdp inside (the vmap puts the shard axis on fsdp itself).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss_S, tokens_S), grads_S = jax.vmap(
        grad_fn, in_axes=(None, 0), spmd_axis_name=FSDP)(params, _split_shards(plan, micro_batch))
    leaves, treedef = jax.tree.flatten(grads_S)
    shardings = [NamedSharding(plan.mesh, unreduced_spec(s, g.ndim - 1))
                 for s, g in zip(treedef.flatten_up_to(plan.grad_specs), leaves)]
    grads_S = treedef.unflatten(
        [jax.lax.with_sharding_constraint(g, s) for g, s in zip(leaves, shardings)])
    return grads_S, jnp.sum(loss_S), jnp.sum(tokens_S)


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _zeros(plan: GradientPlan, params: Any, unreduced: bool) -> tuple[Any, jax.Array, jax.Array]:
    """fp32 zeros for (gradients, loss sum, tokens), gradients laid out reduced or unreduced."""
    leaves, treedef = jax.tree.flatten(params)
    zeros = []
    for p, spec in zip(leaves, treedef.flatten_up_to(plan.grad_specs)):
        if unreduced:
            z, spec = jnp.zeros((plan.fsdp, *p.shape), jnp.float32), unreduced_spec(spec, p.ndim)
        else:
            z = jnp.zeros(p.shape, jnp.float32)
        zeros.append(jax.lax.with_sharding_constraint(z, NamedSharding(plan.mesh, spec)))
    scalar = jnp.zeros((), jnp.float32)
    return treedef.unflatten(zeros), scalar, scalar


def _scan_sum(fn: Callable, init: Any, xs: Any) -> Any:
    """init + Σ fn(x) over the leading axis of xs (lax.scan: the body is compiled once)."""

    def body(carry, x):
        return jax.tree.map(jnp.add, carry, fn(x)), None

    total, _ = jax.lax.scan(body, init, xs)
    return total


def accumulated(plan: GradientPlan, loss_fn: Callable, params: Any, batch: dict):
    """(reduced fp32 gradient sums, loss sum, token count) over the [accum, B, L] batch."""
    K = plan.sync_every
    rounds = jax.tree.map(lambda x: x.reshape(plan.reductions_per_step, K, *x.shape[1:]), batch)

    def one_round(round_batch):  # K micro-batches, summed locally, then one reduction
        if K == 1:  # reduce the compute-dtype gradient directly: no fp32 copy needed
            grads_S, loss, tokens = local_grads(plan, loss_fn, params, _first(round_batch))
        else:  # fp32 accumulator: bf16 sums over micro-batches would lose precision
            grads_S, loss, tokens = _scan_sum(
                lambda mb: _as_f32(local_grads(plan, loss_fn, params, mb)),
                _zeros(plan, params, unreduced=True), round_batch)
        return reduce(plan, grads_S), loss, tokens

    if plan.reductions_per_step == 1:
        return one_round(_first(rounds))
    return _scan_sum(one_round, _zeros(plan, params, unreduced=False), rounds)


def _as_f32(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32), tree)
