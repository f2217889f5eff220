"""Pipeline parallelism: GPipe or a circular schedule in one SPMD program, inside the train
step's shard_map.

On a mesh with a `pp` axis the block stacks (models/family.py: the layers blocks are made of)
are sharded over `pp` along their layer axis, so stage s holds blocks s·n/pp … (s+1)·n/pp - 1
and every device of a stage runs the same program on its own slice. Where pp does not divide
the n blocks (gemma3_4b: 5), each stage runs ⌊n/pp⌋ and the n mod pp left over run after the
stages, with the trailing layers (`stages.Stages`); the stacks, which JAX cannot split unevenly, are
then stored whole over pp and split over fsdp × pp by ZeRO, and a stage's rows reach it by an
all-to-all over pp (collectives.FsdpHook.stage_rows). Each micro-batch of a
device's rows is cut into M pipeline micro-batches (`training.pipeline_microbatches`), and a
scan of M + pp - 1 iterations moves them through the stages:

    iteration t, stage s:  takes micro-batch t - s (stage 0 from the embedding, the others
                           from their predecessor), runs its blocks, and passes the result on
                           with one `ppermute` over pp (a collective-permute in the program)

Autodiff of that scan is the GPipe backward: the transposed permutes carry the cotangents back
stage by stage. The first and last pp - 1 iterations leave some stage idle: the bubble,
(pp - 1) / (M + pp - 1) of the step. A stage's blocks are materialized once per micro-batch,
before the scan (ZeRO-3: one all-gather over fsdp, not one per iteration), and stay so until
the backward pass has gone through every iteration; their gradient is then reduced once. The
cost is that stage's gathered weights alive for the whole pipeline, and their gradient summed
over the iterations in the compute dtype before the reduction.

The circular schedule (`training.pipeline_repeats` = v > 1, MaxText's "pipeline repeats",
Megatron's interleaved stages) cuts the blocks into pp × v chunks; stage s holds chunks s,
s + pp, s + 2·pp, …, and a micro-batch goes round the ring of stages v times, one chunk per
visit. An iteration then runs 1/v of a stage's blocks, and the scan has v·M + pp - 1 of them:
the idle pp - 1 iterations at either end are v times shorter, a bubble of
(pp - 1) / (v·M + pp - 1), for the same FLOPs and v times the activation permutes. The last stage
sends a finished round back to stage 0 (the ring's closing edge), which parks it until its next
round starts: M ≥ pp, so it never waits. A stage's chunks are not consecutive layers, so the
stacks are stored whole over pp as for left-over blocks (storage keeps the model's layer order,
so checkpoints move between schedules and meshes) and each stage's rows are taken in its chunks'
order: below ZeRO-3 that is a full copy of the stacks on every stage, at ZeRO-3 the all-to-all
over pp above moves a stage's weights each micro-step, which GPipe's storage avoids.

Where the rest lives, and why. The embedding is a row lookup: every stage does it for all M
micro-batches (no FLOPs worth splitting, and no activations to move), only stage 0's result
is used. The output head and the loss are the largest single cost after the blocks (gemma3_1b:
~30% of the FLOPs), and so are the trailing layers: the last stage's outputs are spread over
the stages (a reduce-scatter over pp) and each stage computes the trailing layers, the head and
the loss of M / pp micro-batches. Everything outside the blocks is therefore used by every
stage, and its gradient is summed over pp (parallel/collectives.py); it is stored as ZeRO says over
all the devices that use it, fsdp × pp (sharding.spread_over_ranks), so that per-device bytes of
parameters (ZeRO-3), gradients (2) and optimizer state (1) halve from pp=1 to pp=2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.models import params as model_params, router_losses
from tunix_train.models.head import VocabChunks
from tunix_train.parallel.collectives import FsdpHook, cpu_safe_reduction
from tunix_train.parallel.mesh import PP
from tunix_train.parallel.stages import Schedule, Stages


def rotate(stage_fn: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]],
           inputs_MxBxLxD: jax.Array, plan: Schedule, unroll: bool = False
           ) -> tuple[jax.Array, Any]:
    """Runs `stage_fn(x, micro-batch index, round)` → (y, sums) (this stage's layers, its chunk
    of that round, and a pytree of sums over them, e.g. router statistics) over the M
    micro-batches, `plan.repeats` rounds each, inside a shard_map manual over pp: GPipe order
    with one round, circular with more. Returns this stage's share of the last stage's final
    outputs: micro-batches [s·k, (s+1)·k) with k = `plan.per_stage`, zero past M; and this
    stage's sums over its own work (idle iterations left out). `unroll`
    (`model.unroll_layers`) unrolls the iterations; compile time then grows with them. Rolled
    or not is a measurement per machine (docs/performance.md, pipeline bubble)."""
    stage = jax.lax.axis_index(PP)
    last, M, rounds = plan.stages - 1, plan.microbatches, plan.repeats
    edges = [(s, s + 1) for s in range(last)] + ([(last, 0)] if rounds > 1 else [])

    def iteration(carry, t):
        incoming, parked = carry
        first = inputs_MxBxLxD[jnp.minimum(t, M - 1)]
        if rounds > 1:
            # Stage 0 receives what the last stage finished at t - 1 and keeps it until that
            # micro-batch's next round starts, M - pp iterations later. (Idle stages
            # send their clipped repeats of other work: those land in slots no round reads.)
            parked = jax.lax.dynamic_update_index_in_dim(parked, incoming, (t - 1 - last) % M, 0)
            first = jnp.where(t < M, first, parked[t % M])
        x = jnp.where(stage == 0, first, incoming)
        work = jnp.clip(t - stage, 0, rounds * M - 1)  # this stage's (round, micro-batch)
        y, sums = stage_fn(x, work % M, work // M)
        busy = (t >= stage) & (t - stage < rounds * M)  # else it repeats clipped work
        sums = jax.tree.map(lambda v: jnp.where(busy, v, jnp.zeros_like(v)), sums)
        return (jax.lax.ppermute(y, PP, edges), parked), (y, sums)

    carry = (jnp.zeros_like(inputs_MxBxLxD[0]),
             jnp.zeros_like(inputs_MxBxLxD) if rounds > 1 else None)
    _, (ys, sums) = jax.lax.scan(iteration, carry, jnp.arange(plan.iterations), unroll=unroll)
    return _spread_outputs(ys, plan, stage), jax.tree.map(lambda v: jnp.sum(v, axis=0), sums)


def _spread_outputs(ys: jax.Array, plan: Schedule, stage: jax.Array) -> jax.Array:
    """This stage's share of the last stage's final outputs, from every stage's outputs at
    every iteration (`ys`): micro-batches [s·k, (s+1)·k), zero past M."""
    last, M = plan.stages - 1, plan.microbatches
    # The last stage finishes micro-batch m's last round at iteration (v - 1)·M + m + pp - 1.
    outputs = ys[(plan.repeats - 1) * M + last:]
    slots = plan.per_stage * plan.stages
    outputs = jnp.concatenate([outputs, jnp.zeros((slots - M, *outputs.shape[1:]),
                                                   outputs.dtype)])
    # Only the last stage's buffer holds outputs: summing with the others' zeros scatters them.
    outputs = jnp.where(stage == last, outputs, jnp.zeros_like(outputs))
    return cpu_safe_reduction(
        lambda x: jax.lax.psum_scatter(x, PP, scatter_dimension=0, tiled=True))(outputs)


def loss_sums(graphdef: nnx.GraphDef, params: Any, batch: dict, plan: Schedule,
              vocab_chunks: VocabChunks = VocabChunks(),
              router: router_losses.LossWeights = router_losses.LossWeights()
              ) -> tuple[jax.Array, dict]:
    """training/train_step.py's `loss_sums` on one pipeline stage: this stage's share of the
    loss sum and token count over one [B, L] micro-batch (summed over pp by the caller). A
    mixture of experts' router statistics, of every stage's layers over all M micro-batches,
    are summed over pp first: each stage adds the router's losses of the whole micro-batch
    once per token of its share. (The layers after the stages also route the zero
    micro-batches past M: setup refuses the router's losses where pp does not divide M.)"""
    model = nnx.merge(graphdef, params)  # outside the blocks: the embedding, trailing layers, head
    split = Stages.of(model.stacking, plan.stages, plan.repeats)
    stage_stacks, after = _stage_stacks(graphdef, params, split)
    ropes, segments = _ropes_and_segments(model, batch)
    ropes_M = jax.tree.map(lambda t: _micro_batches(t, plan), ropes)
    segments_M = None if segments is None else _micro_batches(segments, plan)

    def stage_fn(x, micro, round_):
        chunk, hook = _round_chunk(graphdef, params, stage_stacks, split, round_)
        with model_params.hooked(hook):
            return chunk.blocks(x, jax.tree.map(lambda t: t[micro], ropes_M),
                                None if segments_M is None else segments_M[micro])

    embedded = _micro_batches(model.embed(batch["inputs"]), plan)
    outputs, stats = rotate(stage_fn, embedded, plan, model.cfg.unroll_layers)
    hidden = outputs.reshape(-1, batch["inputs"].shape[1], outputs.shape[-1])
    share = lambda x: None if x is None else _stage_share(x, plan)  # noqa: E731
    hidden, more_stats = _after_stages(model, after, hidden, jax.tree.map(share, ropes),
                                       share(segments))
    token_loss = model.head_losses(hidden, share(batch["targets"]), vocab_chunks)
    weights = share(batch["weights"])
    stats = router_losses.added(stats, more_stats)
    if stats is not None:
        stats = jax.lax.psum(stats, PP)  # fp32 sums
    tokens = jnp.sum(weights)
    loss_sum, metrics = router_losses.with_losses(jnp.sum(token_loss * weights), tokens, stats,
                                                  router)
    return loss_sum, {"tokens": tokens, **metrics}


def _ropes_and_segments(model: Any, batch: dict) -> tuple[Any, jax.Array | None]:
    """The whole batch's RoPE tables (once for all micro-batches, not at every iteration) and
    segment ids (None: one sequence per row)."""
    rows, length = batch["inputs"].shape
    positions = batch.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
    return model.rope(positions), batch.get("segment_ids")


def _after_stages(model: nnx.Module, after: nnx.Module | None, hidden: jax.Array, ropes: Any,
                  segments: jax.Array | None) -> tuple[jax.Array, router_losses.Statistics | None]:
    """This stage's share of the last stage's outputs through the left-over blocks (if any),
    the trailing layers and the final norm; and their router statistics."""
    after_stats = None
    if after is not None:
        hidden, after_stats = after.blocks(hidden, ropes, segments)
    hidden, tail_stats = model.tail(hidden, ropes, segments)
    return hidden, router_losses.added(after_stats, tail_stats)


def _round_chunk(graphdef: nnx.GraphDef, params: Any, stage_stacks: dict[str, Any],
                 split: Stages, round_: jax.Array) -> tuple[nnx.Module, "_ChunkRows"]:
    """The model whose block stacks are round `round_`'s chunk of the stage's (materialized)
    stacks, as row indices, and the hook that turns them into rows while it runs: each layer
    picks its row inside its own remat'ed step, so the backward pass picks it again rather than
    keeping a chunk of weights per iteration (slicing the chunk here kept one: +4 GB per device
    for gemma3_1b at pp 2 × fsdp 8, M = 4, 2 rounds; GPipe's one round needs 0.26 GB less than
    when its layers were scanned over slices of the stage's stacks)."""
    stacks, rows_of = {}, {}
    for s, state in stage_stacks.items():
        n = split.rows(s) // split.repeats
        leaves, treedef = jax.tree.flatten(state)
        stacks.update({(s, i): leaf for i, leaf in enumerate(leaves)})
        rows_of[s] = jax.tree.unflatten(
            treedef, [_RowOf(jnp.arange(n) + round_ * n, (s, i)) for i in range(len(leaves))])
    return nnx.merge(graphdef, {**params, **rows_of}), _ChunkRows(stacks)


def _stage_stacks(graphdef: nnx.GraphDef, params: Any, split: Stages
                  ) -> tuple[dict[str, Any], nnx.Module | None]:
    """This stage's block stacks (its chunks one after the other), materialized once for all
    its iterations (ZeRO-3: gathered once, their gradients reduced once after the pipeline's
    backward pass), and the model with the leftover blocks that run after the stages (None
    when there are none)."""
    stacks = split.stacking.block_stacks
    if not split.stored_whole:
        return {s: model_params.materialize_stack(params[s]) for s in stacks}, None
    # The stacks are stored whole over pp (sharding.resolve_rules). A circular stage's chunks
    # are apart: its rows are first brought together, in the order it runs them.
    cut = {}
    for s in stacks:
        rows = params[s]
        if split.repeats > 1:
            rows = jax.tree.map(lambda a, o=split.row_order(s): jnp.take(a, o, axis=0), rows)
        cut[s] = model_params.stage_rows(rows, split.stages, split.rows(s))
    after = (nnx.merge(graphdef, {**params, **{s: cut[s][1] for s in stacks}})
             if split.leftover else None)
    return {s: cut[s][0] for s in stacks}, after


@functools.partial(jax.tree_util.register_dataclass, data_fields=["index"],
                   meta_fields=["key"])
@dataclass(frozen=True)
class _RowOf:
    """A layer's row of a stage's stack, by index (the stack itself is a loop constant)."""
    index: jax.Array
    key: tuple


class _ChunkRows:
    """models/params.py's hook while a stage runs one round's chunk: `_RowOf` leaves → their
    rows, through `_pick`, which recomputation policies never save (`materializer`). The
    stacks are already materialized (`_stage_stacks`)."""

    def __init__(self, stacks: dict):
        self.stacks = stacks

    def exchange(self, rows: jax.Array) -> jax.Array:
        return FsdpHook().exchange(rows)

    def materialize(self, state: Any) -> Any:
        return jax.tree.map(
            lambda r: _pick(self.stacks[r.key].shape[0], self.stacks[r.key], r.index)
            if isinstance(r, _RowOf) else r, state, is_leaf=lambda r: isinstance(r, _RowOf))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
@model_params.materializer  # never saved for the backward pass: picked again there
def _pick(rows: int, stack: jax.Array, index: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(stack, index, keepdims=False)


def _pick_fwd(rows, stack, index):
    return _pick(rows, stack, index), index


def _pick_bwd(rows, index, grad):
    whole = jnp.zeros((rows, *grad.shape), grad.dtype)
    return jax.lax.dynamic_update_index_in_dim(whole, grad, index, 0), None


_pick.defvjp(_pick_fwd, _pick_bwd)


def _micro_batches(x: jax.Array, plan: Schedule) -> jax.Array:
    """[B, ...] → [M, B / M, ...]: the pipeline micro-batches, consecutive rows each."""
    return x.reshape(plan.microbatches, x.shape[0] // plan.microbatches, *x.shape[1:])


def _stage_share(x: jax.Array, plan: Schedule) -> jax.Array:
    """The rows of the micro-batches whose loss this stage computes (those `rotate` returns it),
    zero past M: [B, L] → [per_stage · B / M, L]."""
    x = _micro_batches(x, plan)
    padding = jnp.zeros((plan.per_stage * plan.stages - plan.microbatches, *x.shape[1:]),
                        x.dtype)
    x = jnp.concatenate([x, padding])
    x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(PP) * plan.per_stage,
                                     plan.per_stage)
    return x.reshape(-1, *x.shape[2:])
