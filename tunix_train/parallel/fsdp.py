"""Gradients of one optimizer step: FSDP written out in `shard_map`, reduced layer by layer.

The loss and its gradient run in one `shard_map` that is manual over `fsdp` and leaves `tp` to
XLA's partitioner. Each device computes on its own batch rows, and every parameter reaches the
model through `fetch` (parallel/collectives.py, installed as models/params.py's hook), a
custom VJP that spells out FSDP's two collectives:

    forward    all-gather the parameter's shard over fsdp, in the compute dtype    (ZeRO-3)
    backward   reduce the gradient over fsdp in `training.grad_reduce_dtype`:
               reduce-scatter where the gradient is sharded (ZeRO-2, 3), else all-reduce (0, 1)

Model code materializes each scanned layer inside the layer loop and the output head one
vocabulary chunk at a time (models/head.py), so the backward half runs where the backward pass
has just produced that gradient: each reduction can overlap the next layer's backward compute,
and the largest unreduced gradient alive is one layer's or one chunk's. Gathered parameters are
not kept for the backward pass: a layer is gathered again when it is reached. The embedding
lookup (`take`) never forms a [V, D] gradient at all: rows travel by all-to-all instead.

Why explicit rather than left to XLA's partitioner, measured with the planner (8 simulated CPU
devices, gemma3_1b, fsdp 8, ZeRO-3, bf16, 1 × 256 tokens per device): the previous explicit
path (a whole unreduced gradient reduced after the backward pass) needed 9.40 GB per device; a
plain `jax.grad` of sharded parameters reduces inside the loop too, but as all-reduces of each
whole layer gradient (on CPU), with the tied embedding's whole gradient in fp32: 7.19 GB; this
file's step needs 4.78 GB (5.31 GB with 4 accumulated micro-batches), and the kind, dtype and
count of every gradient collective are its own on every backend.

On a mesh with pipeline stages (`pp`, parallel/pipeline.py) the shard_map is manual over pp
too: a stage's block stacks arrive as its own slices and are fetched whole once per
micro-batch (`FsdpHook.materialize_stack`); what every stage uses (embedding, final norm,
trailing layers) is split over fsdp and pp together where ZeRO splits it (sharding.
spread_over_ranks): it is gathered and reduce-scattered over both axes, and where its gradient is
not split, summed over pp after fsdp.

On a mesh with expert parallelism (`ep`) the shard_map is manual over ep too: an ep device has
batch rows of its own, so ep is a data axis like fsdp for every weight (ZeRO splits them over
fsdp × ep, their gradients are reduced over both), except a mixture's experts, which are split
over ep itself: a device receives only its experts' slice, and their gradients are summed over
fsdp alone (`reduction_group`). The routed layers' rows cross ep by all-to-all
(collectives.py's `exchange`).

LoRA's frozen base (parallel/layout.py) comes in as a second tree: fetched like any parameter
(gathered over fsdp at ZeRO-3, in the dtype it is stored in), merged with the adapters for the
model, never differentiated, so no reduction of it exists at all.

`training.sync_gradients_every` = K > 1 trades memory for fewer reductions: `fetch` then leaves
gradients local and unreduced, K micro-batches are summed into an fp32 buffer the size of this
device's (tp) share of the whole model, and one reduction follows. K = 1 (the default) keeps
only the sharded fp32 accumulator (4Ψ/N bytes at ZeRO-2/3) across micro-batches.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train.models import params as model_params
from tunix_train.parallel.collectives import (SYNC_SCOPE, Fetch, FsdpHook, How, per_tp_shard,
                                              reduce_one)
from tunix_train.parallel.layout import merged
from tunix_train.parallel.mesh import CP, DATA_AXES, EP, FSDP, PP
from tunix_train.parallel.sharding import to_device


@dataclass(frozen=True)
class GradientSync:
    """Static facts about one step's gradients."""

    mesh: Mesh
    param_specs: Any  # PartitionSpec per parameter: how it is stored (sharded over fsdp at ZeRO-3)
    grad_specs: Any  # PartitionSpec per parameter: the reduced gradient's layout
    stacked: Any  # bool per parameter: a scanned layer stack (materialized one layer at a time)
    accumulation_steps: int
    sync_every: int  # micro-steps summed locally between reductions
    compute_dtype: jnp.dtype  # parameters are gathered and used in it
    reduce_dtype: jnp.dtype  # dtype the reductions travel in
    frozen_specs: Any = None  # PartitionSpec per leaf of LoRA's frozen base; None: no base
    frozen_stacked: Any = None  # bool per frozen parameter

    @property
    def fsdp(self) -> int:
        return self.mesh.shape[FSDP]

    @property
    def pp(self) -> int:
        return self.mesh.shape.get(PP, 1)

    @property
    def reduces_per_layer(self) -> bool:
        """Whether each layer's gradient is reduced inside the backward pass (not with
        `sync_every` > 1). A pipeline stage's layers count as one: they are gathered once per
        micro-batch and their gradients reduced once (parallel/pipeline.py)."""
        return self.sync_every == 1

    @property
    def cp(self) -> int:
        return self.mesh.shape.get(CP, 1)

    @property
    def ep(self) -> int:
        return self.mesh.shape.get(EP, 1)

    @property
    def data_ranks(self) -> int:
        """Devices with batch rows of their own: fsdp × ep."""
        return self.fsdp * self.ep

    @property
    def manual_axes(self) -> set[str]:
        return {FSDP} | {axis for axis in (PP, CP, EP) if self.mesh.shape.get(axis, 1) > 1}

    @property
    def data_group(self) -> tuple[str, ...]:
        """The axes whose devices compute on different tokens: every gradient is summed over
        them (fsdp's and ep's rows, cp's chunks of each row) where it has copies there."""
        return (FSDP,) + tuple(axis for axis in (EP, CP) if self.mesh.shape.get(axis, 1) > 1)

    @property
    def batch_spec(self) -> P:
        """A [micro-batches, rows, seq] batch as the shard_map splits it: rows over the data
        axes (fsdp, ep), each row's sequence over cp."""
        rows = DATA_AXES if self.ep > 1 else FSDP
        return P(None, rows, CP) if self.cp > 1 else P(None, rows)

    def reduction_group(self, spec: P) -> tuple[str, ...]:
        """The devices one parameter's gradient is summed over: the data axes over which it has
        copies. ZeRO's split (the dimension over fsdp, with cp and pp: spread_over_ranks) is
        of copies, reduce-scattered; a data axis that splits the parameter on its own holds
        other slices of it, not copies, and is left out. So expert parallelism adds an axis
        that is a data axis for every weight but the experts split over it. (Today no data
        axis splits a parameter outside ZeRO's group: every group is `data_group`.)"""
        splits = {name for entry in spec if FSDP not in _names(entry) for name in _names(entry)}
        return tuple(axis for axis in self.data_group if axis not in splits)

    @property
    def reductions_per_step(self) -> int:
        return self.accumulation_steps // self.sync_every

    @property
    def scatters(self) -> bool:
        """Whether gradients are reduce-scattered (sharded over fsdp: ZeRO-2, 3)."""
        return any(_fsdp_axis(spec) is not None for spec in jax.tree.leaves(
            self.grad_specs, is_leaf=lambda x: isinstance(x, P)))


# ---------------------------------------------------------------------------------------------
# Layouts.

def _names(entry: Any) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry splits a dimension over."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _fsdp_axis(spec: P) -> int | None:
    """The dimension split over fsdp (alone, or with pp: sharding.spread_over_ranks)."""
    return next((i for i, axis in enumerate(spec) if FSDP in _names(axis)), None)


def _fsdp_group(spec: P) -> tuple[str, ...]:
    axis = _fsdp_axis(spec)
    return () if axis is None else _names(spec[axis])


_MANUAL = (FSDP, PP, CP, EP)  # the shard_map's manual axes (pp, cp, ep: on meshes with them)


def _is_manual(entry: Any) -> bool:
    return bool(_names(entry)) and all(a in _MANUAL for a in _names(entry))


def _manual_only(spec: P) -> P:
    """The manual (fsdp, pp, cp, ep) part of a spec: shard_map's in/out specs name only manual
    axes."""
    return P(*(axis if _is_manual(axis) else None for axis in spec))


def _without_fsdp(spec: P, skip: int = 0) -> P:
    """The automatic (tp) part of a spec, less its first `skip` axes."""
    return P(*tuple(None if _is_manual(axis) else axis for axis in spec)[skip:])


def _local_shape(shape: tuple[int, ...], spec: P, mesh: Mesh, reduced: bool) -> tuple[int, ...]:
    """The block of `shape` one device holds of a gradient laid out as `spec`: reduced, its
    block along the manual axes; unreduced, the whole of every dimension but a pipeline
    stage's layers and the experts split over ep (held by no other device)."""
    def local(d, entry):
        if _is_manual(entry) and (reduced or entry == EP):
            return d // math.prod(mesh.shape[a] for a in _names(entry))
        return d // mesh.shape[PP] if entry == PP else d

    return tuple(local(d, a) for d, a in
                 zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))))


def _hows(sync: GradientSync, params: Any) -> Any:
    """A `How` per parameter; axes of stacked layers count from one layer's slice."""
    reduce = sync.reduces_per_layer

    def how(p, param_spec, grad_spec, stacked):
        shift = 1 if stacked else 0
        gather, scatter = _fsdp_axis(param_spec), _fsdp_axis(grad_spec)
        return How(None if gather is None else gather - shift,
                    None if scatter is None else scatter - shift,
                    _fsdp_group(param_spec), _fsdp_group(grad_spec),
                    _without_fsdp(param_spec, shift), reduce,
                    _summed_over_pp(sync, grad_spec),
                    sync.compute_dtype, sync.reduce_dtype, _local_dtype(sync, reduce),
                    sync.reduction_group(grad_spec))

    return jax.tree.map(how, params, sync.param_specs, sync.grad_specs, sync.stacked)


def _summed_over_pp(sync: GradientSync, grad_spec: P) -> bool:
    """Held by every pipeline stage, its reduced gradient not split over pp: an all-reduce
    over pp follows the reduction over fsdp (where it is split over fsdp and pp, the
    reduce-scatter over both sums over pp)."""
    return sync.pp > 1 and not any(PP in _names(axis) for axis in grad_spec)


def _local_dtype(sync: GradientSync, reduced: bool):
    """fp32 for reduced gradients; else the compute dtype (summed in fp32 across micro-steps)."""
    return jnp.float32 if reduced else sync.compute_dtype


def _gradient_zeros(sync: GradientSync, params: Any, reduced: bool, dtype) -> Any:
    """Zeros shaped like this device's gradient of each parameter: its reduced shard, or the
    local whole (of this pipeline stage's layers)."""
    return jax.tree.map(
        lambda p, spec: jnp.zeros(_local_shape(p.shape, spec, sync.mesh, reduced), dtype),
        params, sync.grad_specs)


# ---------------------------------------------------------------------------------------------
# The step's gradients.

def _scan_sum(fn: Callable, init: Any, xs: Any) -> Any:
    """init + Σ fn(x) over the leading axis of xs (lax.scan: the body is compiled once)."""

    def body(carry, x):
        return jax.tree.map(jnp.add, carry, fn(x)), None

    total, _ = jax.lax.scan(body, init, xs)
    return total


def _first(tree: Any) -> Any:
    return jax.tree.map(lambda x: x[0], tree)


def _reduce_all(sync: GradientSync, grads: Any) -> Any:
    """One reduction of a whole local gradient (sync_every > 1). On a pipeline mesh the
    parameters every stage holds (embedding, final norm, trailing layers) have a share of their
    gradient on each stage: those shares are summed over pp too."""
    def reduce(grad, spec):
        return per_tp_shard(lambda g: reduce_one(g.astype(sync.reduce_dtype), _fsdp_axis(spec),
                                                 _fsdp_group(spec), _summed_over_pp(sync, spec),
                                                 sync.reduction_group(spec)),
                            _without_fsdp(spec))(grad).astype(jnp.float32)

    with jax.named_scope(SYNC_SCOPE):
        return jax.tree.map(reduce, grads, sync.grad_specs)


def accumulated_gradients(sync: GradientSync, loss_fn: Callable, params: Any, batch: dict,
                          frozen: Any = None):
    """(reduced fp32 gradient sums, loss sum, sums) over the [accum, B, L] batch.

    `params`: the fp32 parameters laid out as stored (LoRA: the adapters, and `frozen` the base
    laid out as `sync.frozen_specs` say); `loss_fn(params, micro_batch) -> (loss_sum, sums)`
    sees this device's rows and a tree of `Fetch` leaves (read through models/params.py, with
    `FsdpHook` installed here), the base's merged in, under no activation constraint naming
    fsdp. `sums` is a dict of scalars that add up over micro-batches and devices; its
    "tokens" entry is what the caller divides by (the train step's token count).
    """
    spec_of = lambda specs: jax.tree.map(_manual_only, specs, is_leaf=lambda x: isinstance(x, P))  # noqa: E731
    # Every stage of a pipeline sees its fsdp shard's rows; under cp, its chunk of each row.
    batch_spec = sync.batch_spec
    frozen_spec = None if frozen is None else spec_of(sync.frozen_specs)
    return jax.shard_map(
        functools.partial(_device_gradients, sync, loss_fn, params),
        mesh=sync.mesh, axis_names=sync.manual_axes, check_vma=False,
        in_specs=(spec_of(sync.param_specs), frozen_spec,
                  jax.tree.map(lambda _: batch_spec, batch)),
        out_specs=(spec_of(sync.grad_specs), P(), P()),
    )(params, frozen, batch)


def _device_gradients(sync: GradientSync, loss_fn: Callable, params: Any, local_params: Any,
                      local_frozen: Any, batch: dict):
    """One device's part of `accumulated_gradients`: its blocks of the parameters, its rows."""
    K, rounds, per_layer = sync.sync_every, sync.reductions_per_step, sync.reduces_per_layer
    local_params = _on_device_but_stacks(local_params, sync.stacked)
    if local_frozen is not None:
        local_frozen = _on_device_but_stacks(local_frozen, sync.frozen_stacked)
    # Jitted so that the step is traced once: `eval_shape` below traces it for the shapes of its
    # sums, and the scan's body reuses that trace (a nested jit is inlined when compiled).
    micro_grads = jax.jit(_micro_gradients(sync, loss_fn, params, local_params, local_frozen))
    sums_zero = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32),
                             jax.eval_shape(micro_grads, _first(batch))[2])

    def one_round(round_batch):  # K micro-batches, then one reduction unless per layer
        if per_layer:
            return micro_grads(_first(round_batch))
        local, loss, sums = _scan_sum(
            micro_grads, (_gradient_zeros(sync, params, False, jnp.float32),
                          jnp.zeros((), jnp.float32), sums_zero), round_batch)
        return _reduce_all(sync, local), loss, sums

    split = jax.tree.map(lambda x: x.reshape(rounds, K, *x.shape[1:]), batch)
    if rounds == 1:
        grads, loss, sums = one_round(_first(split))
    else:
        init = (_gradient_zeros(sync, params, True, jnp.float32),
                jnp.zeros((), jnp.float32), sums_zero)
        grads, loss, sums = _scan_sum(one_round, init, split)
    # Each pipeline stage computes the loss of its share of the micro-batches.
    axes = tuple(sorted(sync.manual_axes))
    return grads, jax.lax.psum(loss, axes), jax.lax.psum(sums, axes)


def _on_device_but_stacks(local: Any, stacked: Any) -> Any:
    """Parameters kept in host memory (`training.offload_params`) brought to the device once a
    step where they are not layer stacks (embedding, norms, head); a stack stays on the host and
    each of its layers is copied over when the layer loop reaches it (`Fetch`)."""
    return jax.tree.map(lambda is_stack, leaves: leaves if is_stack else
                        jax.tree.map(to_device, leaves), stacked, local)


def _micro_gradients(sync: GradientSync, loss_fn: Callable, params: Any, local_params: Any,
                     local_frozen: Any) -> Callable:
    """micro-batch → (fp32 gradients, loss sum, sums) on this device, reduced or local as
    `sync` says: the loss differentiated with respect to stand-ins for the gradients."""
    hows = _hows(sync, params)
    per_layer = sync.reduces_per_layer
    # Stand-ins for the gradients (see `Fetch`), from the global shapes: blocks are local.
    targets = _gradient_zeros(sync, params, per_layer, _local_dtype(sync, per_layer))
    frozen = None if local_frozen is None else _frozen_fetches(sync, local_frozen)

    def micro_grads(micro_batch):
        def loss_of(targets):
            tree = jax.tree.map(Fetch, local_params, targets, hows)
            if frozen is not None:
                tree = merged(tree, frozen)
            with model_params.hooked(FsdpHook()):
                return loss_fn(tree, micro_batch)

        (loss, sums), grads = jax.value_and_grad(loss_of, has_aux=True)(targets)
        return jax.tree.map(lambda g: g.astype(jnp.float32), grads), loss, sums

    return micro_grads


def _frozen_fetches(sync: GradientSync, local_frozen: Any) -> Any:
    """`Fetch` leaves of the frozen base: gathered like parameters, in their stored dtype (a
    quantized base's codes stay codes), never differentiated (their `target` is themselves: the
    loss is not differentiated with respect to it, so their backward half never runs)."""
    def fetch(stacked, specs, leaves):
        def one(leaf, spec):
            shift = 1 if stacked else 0
            gather = _fsdp_axis(spec)
            how = How(None if gather is None else gather - shift, None, _fsdp_group(spec), (),
                      _without_fsdp(spec, shift), False, False, leaf.dtype, sync.reduce_dtype,
                      leaf.dtype, sync.reduction_group(spec))
            return Fetch(leaf, leaf, how)
        return jax.tree.map(one, leaves, specs, is_leaf=lambda x: isinstance(x, P))

    return jax.tree.map(fetch, sync.frozen_stacked, sync.frozen_specs, local_frozen)


def local_gradient_bytes(sync: GradientSync, params: Any, dtype: jnp.dtype) -> int:
    """Per-device bytes of one whole unreduced gradient (this device's tp share of every
    parameter, of its pipeline stage's layers): what `sync_every` > 1 and pipeline stages
    keep, and what one such reduction carries per device."""
    leaves, treedef = jax.tree.flatten(params)
    total = 0
    for p, spec in zip(leaves, treedef.flatten_up_to(sync.grad_specs)):
        local = NamedSharding(sync.mesh, P(*(None if FSDP in _names(axis) else axis
                                             for axis in spec)))
        total += math.prod(local.shard_shape(p.shape)) * jnp.dtype(dtype).itemsize
    return total
