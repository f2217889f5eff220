"""One parameter inside the train step's shard_map: the collectives that fetch it for compute
and reduce its gradient, as custom VJPs (parallel/fsdp.py builds the step's gradients on them).

    fetch         all-gather a shard over fsdp (and cp, pp) in the compute dtype; backward:
                  reduce the gradient over fsdp and cp (reduce-scatter where it is sharded,
                  else all-reduce)
    fetch_stage   a pipeline stage's rows of a layer stack stored whole over pp
    take          rows of an embedding table: ids and rows travel, never the [V, D] gradient
    exchange      a routed layer's rows to their experts' devices over ep, or back (all-to-all)

`FsdpHook` serves them to model code through models/params.py's hook. A `How` says what each
does for one parameter; the reductions run under the named scope `SYNC_SCOPE`, which the
communication report reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tunix_train import backend
from tunix_train.models import params as model_params
from tunix_train.parallel.mesh import EP, FSDP, PP
from tunix_train.parallel.sharding import to_device

SYNC_SCOPE = "gradient_sync"  # named scope of the reductions; the comm report looks for it
WIDENED = "cpu_widened_from_"  # + dtype: a 16-bit reduction carried in fp32 on a CPU backend


@dataclass(frozen=True)
class How:
    """What `fetch` does for one parameter (hashable: a static argument of the custom VJP)."""

    gather_axis: int | None  # the axis its shard is cut along (ZeRO-3); None = held whole
    scatter_axis: int | None  # the reduced gradient's sharded axis; None = all-reduce
    gather_group: tuple[str, ...]  # the mesh axes that axis is split over: fsdp (and pp)
    scatter_group: tuple[str, ...]
    tp_spec: P  # its layout over the other (automatic) mesh axes, e.g. tp: kept explicitly
    reduce: bool  # False: leave the gradient local and unreduced (sync_every > 1)
    over_pp: bool  # held by every pipeline stage: its gradient is summed over pp as well
    compute_dtype: Any  # the shard is cast to it before the gather: bf16 gathers, no bf16 copy
    reduce_dtype: Any
    grad_dtype: Any
    # The axes whose devices compute on different tokens, over which every gradient is summed:
    # fsdp, and cp where the step's shard_map is manual over it (parallel/fsdp.py).
    data_group: tuple[str, ...] = (FSDP,)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["param", "target"],
                   meta_fields=["how"])
@dataclass(frozen=True)
class Fetch:
    """A parameter as this device holds it, and a stand-in for its gradient: differentiating
    the loss with respect to `target` (whose value is never read) yields the gradient laid
    out as `how` says, reduced or not."""

    param: jax.Array
    target: jax.Array
    how: How


def is_fetch(x: Any) -> bool:
    return isinstance(x, Fetch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
@model_params.materializer  # never saved for the backward pass: gathered again there
def _fetch(param: jax.Array, target: jax.Array, how: How) -> jax.Array:
    del target
    param = to_device(param).astype(how.compute_dtype)  # offloaded: this layer's copy comes in
    if how.gather_axis is None or _size(how.gather_group) == 1:
        return param
    gather = lambda p: _gathered(p, how.gather_group, how.gather_axis)  # noqa: E731
    return per_tp_shard(gather, how.tp_spec)(param)


def _fetch_fwd(param, target, how):
    return _fetch(param, target, how), None


def _fetch_bwd(how: How, _, grad: jax.Array):
    if how.reduce:
        with jax.named_scope(SYNC_SCOPE):
            grad = per_tp_shard(lambda g: reduce_one(g.astype(how.reduce_dtype),
                                                     how.scatter_axis, how.scatter_group,
                                                     how.over_pp, how.data_group),
                                how.tp_spec)(grad)
    return None, grad.astype(how.grad_dtype)


def per_tp_shard(collective: Callable, tp_spec: P) -> Callable:
    """`collective` (over fsdp) on this device's block of a value also sharded by `tp_spec`.

    Inside the shard_map only fsdp is manual; XLA would replicate a value over the other axes
    before a collective on fsdp (a tp-sharded weight gathered whole over tp, its gradient
    reduced at full width). Making those axes manual for the collective keeps it to each
    device's own block.
    """
    axes = {axis for axis in tp_spec if axis is not None}
    if not axes:
        return collective
    return jax.shard_map(collective, in_specs=tp_spec, out_specs=tp_spec, axis_names=axes,
                         check_vma=False)


_fetch.defvjp(_fetch_fwd, _fetch_bwd)


class FsdpHook:
    """models/params.py's hook inside the shard_map: `Fetch` leaves → parameters for compute."""

    def materialize(self, state: Any) -> Any:
        """Parameters for compute; leaves already materialized (`materialize_stack`) pass."""
        return jax.tree.map(lambda f: _fetch(f.param, f.target, f.how) if is_fetch(f) else f,
                            state, is_leaf=is_fetch)

    def materialize_stack(self, state: Any) -> Any:
        """A stack of layers materialized whole (axes count from the stack, not one layer)."""
        return jax.tree.map(lambda f: _fetch(f.param, f.target, _stack_how(f.how)), state,
                            is_leaf=is_fetch)

    def stage_rows(self, state: Any, stages: int, rows: int) -> tuple[Any, Any]:
        """A stack not split over pp by rows (its blocks do not divide into the stages): this
        pipeline stage's `rows` rows materialized at once, and the rows after every stage's
        (from `stages` × `rows` on), still to be materialized one by one."""
        mine = jax.tree.map(
            lambda f: _fetch_stage(f.param, f.target, _stack_how(f.how), stages, rows,
                                   f.param.shape[0]), state,
            is_leaf=is_fetch)
        rest = jax.tree.map(lambda f: Fetch(f.param[stages * rows:], f.target[stages * rows:],
                                            f.how), state, is_leaf=is_fetch)
        return mine, rest

    def exchange(self, rows_SxCx: jax.Array) -> jax.Array:
        """Row block s to the s-th device of this device's ep group, block s of the result from
        it: the transpose is the same exchange, so the backward pass sends gradients home."""
        return jax.lax.all_to_all(rows_SxCx, EP, split_axis=0, concat_axis=0, tiled=True)

    def take(self, table: Fetch, ids: jax.Array) -> jax.Array:
        rows_TxD = _take(table.param, table.target, ids.reshape(-1), table.how,
                         table.target.shape[0])
        return rows_TxD.reshape(*ids.shape, rows_TxD.shape[-1])


def _stack_how(how: How) -> How:
    """`how` for a whole stack of layers: axes count from the stack, not one layer."""
    return dataclasses.replace(
        how, tp_spec=P(None, *how.tp_spec),
        **{axis: None if getattr(how, axis) is None else getattr(how, axis) + 1
           for axis in ("gather_axis", "scatter_axis")})


# One pipeline stage's rows of a stack stored whole over pp (not split by rows): ZeRO-3 splits
# it over fsdp × pp along another axis, so an all-to-all over pp brings this stage's rows the
# other stages' columns (then gathered over fsdp), and its transpose sends each stage's
# gradient columns home; below ZeRO-3 a stage takes its rows from its own copy, and the
# reduced gradient rows of all stages are gathered over pp.

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fetch_stage(param: jax.Array, target: jax.Array, how: How, stages: int, rows: int,
                 total: int) -> jax.Array:
    del target, total

    def gather(p):
        if PP in how.gather_group:  # column blocks in (fsdp, cp)-major order: (f, c, stage)
            p = jax.lax.all_to_all(p.reshape(stages, rows, *p.shape[1:]), PP, split_axis=0,
                                   concat_axis=how.gather_axis + 1, tiled=True)[0]
        else:
            p = jax.lax.dynamic_slice_in_dim(p, jax.lax.axis_index(PP) * rows, rows)
        if how.gather_axis is not None:
            p = _gathered(p, _without_pp(how.gather_group), how.gather_axis)
        return p

    return per_tp_shard(gather, how.tp_spec)(param[:stages * rows].astype(how.compute_dtype))


def _fetch_stage_fwd(param, target, how, stages, rows, total):
    return _fetch_stage(param, target, how, stages, rows, total), None


def _fetch_stage_bwd(how: How, stages: int, rows: int, total: int, _, grad: jax.Array):
    def reduce(g):
        if how.scatter_axis is None:
            g = _sum(g, how.data_group)
        else:
            g = _sum_scattered(g, _without_pp(how.scatter_group), how.scatter_axis)
            g = _summed_over_rest(g, how.data_group, how.scatter_group)
            if PP in how.scatter_group:
                g = jax.lax.all_to_all(g[None], PP, split_axis=how.scatter_axis + 1,
                                       concat_axis=0, tiled=True)
                return g.reshape(stages * rows, *g.shape[2:])
        return jax.lax.all_gather(g, PP, axis=0, tiled=True)  # every stage's rows, in order

    if how.reduce:
        with jax.named_scope(SYNC_SCOPE):
            grad = per_tp_shard(cpu_safe_reduction(reduce), how.tp_spec)(
                grad.astype(how.reduce_dtype))
    else:  # local and unreduced: this stage's rows in place, the others' zero
        grad = jax.lax.dynamic_update_slice_in_dim(
            jnp.zeros((stages * rows, *grad.shape[1:]), grad.dtype), grad,
            jax.lax.axis_index(PP) * rows, 0)
    after = jnp.zeros((total - stages * rows, *grad.shape[1:]), grad.dtype)  # not the stages'
    return None, jnp.concatenate([grad, after]).astype(how.grad_dtype)


_fetch_stage.defvjp(_fetch_stage_fwd, _fetch_stage_bwd)


def _without_pp(group: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in group if a != PP)


def _summed_over_rest(grad: jax.Array, data_group: tuple[str, ...],
                      scatter_group: tuple[str, ...]) -> jax.Array:
    """A gradient reduce-scattered over `scatter_group`, summed over the data-parallel axes
    that group leaves out (cp, where a dimension splits over fsdp but not fsdp × cp)."""
    return _sum(grad, tuple(a for a in data_group if a not in scatter_group))


# The embedding lookup. A [V, D] gradient of a few hundred looked-up rows would be almost all
# zeros, and reducing it over fsdp would move the whole table: instead, rows and their
# gradients travel between devices (all-to-all), a few megabytes, and each device adds the
# gradient rows into its own shard. Tables are sharded over fsdp (and pp: sharding.
# spread_over_ranks) along D (axis 1), if at all; on a pipeline mesh every stage looks up the same
# rows, and only the first stage's lookup has a gradient.

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _take(param: jax.Array, target: jax.Array, ids_T: jax.Array, how: How,
          vocab: int) -> jax.Array:
    del target, vocab
    param = param.astype(how.compute_dtype)
    if how.gather_axis is None or _size(how.gather_group) == 1:  # the table is whole here
        return jnp.take(param, ids_T, axis=0)
    # Every device looks up every device's ids in its own columns; all-to-all sends each
    # device's rows home, the columns concatenated in the group's order.
    group = how.gather_group
    rows_NxTxd = jnp.take(param, jax.lax.all_gather(ids_T, group), axis=0)
    return jax.lax.all_to_all(rows_NxTxd, group, split_axis=0, concat_axis=2, tiled=True)[0]


def _take_fwd(param, target, ids_T, how, vocab):
    return _take(param, target, ids_T, how, vocab), ids_T


def _take_bwd(how: How, vocab: int, ids_T: jax.Array, grad_TxD: jax.Array):
    rows, ids = grad_TxD, ids_T  # unreduced (sync_every > 1): this device's own rows
    if how.reduce:  # every device's gradient rows, in all columns or in this device's own
        group = how.scatter_group or how.data_group
        ids = _gathered(ids_T, group, 0)
        with jax.named_scope(SYNC_SCOPE):
            rows = grad_TxD.astype(how.reduce_dtype)
            if how.over_pp:  # the rows of every pipeline stage's lookup (only the first's count)
                rows = cpu_safe_reduction(lambda r: jax.lax.psum(r, PP))(rows)
            if how.scatter_axis is None:
                rows = _gathered(rows, group, 0)
            elif _size(group) > 1:
                rows = jax.lax.all_to_all(rows[None], group, split_axis=2, concat_axis=0,
                                          tiled=True).reshape(ids.shape[0], -1)
            rest = tuple(a for a in how.data_group if a not in group)
            # the rows of the data-parallel devices outside the group (cp) as well
            ids, rows = (_gathered(a, rest, 0) for a in (ids, rows))
    grad = jax.ops.segment_sum(rows.astype(jnp.float32), ids, num_segments=vocab)
    return None, grad.astype(how.grad_dtype), None


_take.defvjp(_take_fwd, _take_bwd)


def reduce_one(grad: jax.Array, scatter_axis: int | None, scatter_group: tuple[str, ...],
                over_pp: bool = False, data_group: tuple[str, ...] = (FSDP,)) -> jax.Array:
    """The sum over the data-parallel axes (`data_group`: fsdp, and cp where it is manual),
    scattered along `scatter_axis` over `scatter_group` (a part of them, and pp where it is
    spread over pp) if there is one, and a sum over pp too if asked."""
    def reduce(grad):
        if scatter_axis is None:
            grad = _sum(grad, data_group)
        else:
            grad = _sum_scattered(grad, scatter_group, scatter_axis)
            grad = _summed_over_rest(grad, data_group, scatter_group)
        return _sum(grad, (PP,)) if over_pp else grad

    return cpu_safe_reduction(reduce)(grad)


def cpu_safe_reduction(reduce: Callable[[jax.Array], jax.Array]) -> Callable:
    """`reduce` (a sum over mesh axes), carried in fp32 on a CPU backend.

    CPU backends reduce 16-bit floats in fp32 anyway (XLA's AllReducePromotion), and that pass
    aborts on the reductions Shardy emits inside nested loops (XLA 0.10): widening here gives
    the same program, named so that the communication report counts the narrow dtype."""
    def widened(x: jax.Array) -> jax.Array:
        dtype = jnp.dtype(x.dtype)
        if not backend.is_cpu() or dtype == jnp.float32:
            return reduce(x)
        with jax.named_scope(WIDENED + dtype.name):
            return reduce(x.astype(jnp.float32)).astype(dtype)

    return widened


# A parameter's gather and its gradient's reduction (an embedding's ids and rows too) over a
# group of one device (fsdp = 1: one device, tp-only meshes) are left out, not left to XLA:
# XLA's CPU compiler keeps them as copies, lays their results out along the collective's axis,
# and the tiles' weight gathers then read every expert weight through a transposed view
# (bench/moe.py's one-device MoE step went 890 → 815 ms, docs/performance.md).

def _size(group: tuple[str, ...]) -> int:
    """Devices in a group of mesh axes (inside the shard_map)."""
    return math.prod(jax.lax.axis_size(axis) for axis in group)


def _gathered(x: jax.Array, group: tuple[str, ...], axis: int) -> jax.Array:
    """x's blocks over `group` concatenated along `axis`."""
    return jax.lax.all_gather(x, group, axis=axis, tiled=True) if _size(group) > 1 else x


def _sum(x: jax.Array, group: tuple[str, ...]) -> jax.Array:
    """x summed over the devices of `group`."""
    return jax.lax.psum(x, group) if _size(group) > 1 else x


def _sum_scattered(x: jax.Array, group: tuple[str, ...], axis: int) -> jax.Array:
    """x summed over `group`, each device keeping its block along `axis`."""
    if _size(group) == 1:
        return x
    return jax.lax.psum_scatter(x, group, scatter_dimension=axis, tiled=True)
