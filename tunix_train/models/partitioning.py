"""Activation sharding constraints, named by logical axes only.

Model code calls `constrain(x, ("act_batch", "act_seq", "act_embed"))`; whoever runs the model
decides what the names mean by putting Flax logical-axis rules and a mesh in effect while
tracing (tunix_train/parallel/sharding.py: `activate`). Outside such a block it is a no-op, so
the model runs unchanged on one device, in tests, and under `eval_shape`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from tunix_train import backend


def active_rules() -> dict[str, str | None]:
    """The logical → mesh axis rules in effect while tracing ({} outside `sharding.activate`);
    Flax keeps them in `flax.core.spmd` (tests/test_internals.py pins it)."""
    return dict(flax_spmd.get_logical_axis_rules())


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical names; axes that do not divide evenly stay unsharded, and
    axes already manual (inside a shard_map over them: the dimension is this device's block)
    are left out."""
    rules = active_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    axes = [rules.get(name) if name else None for name in logical_axes]
    axes = [a if a and a not in mesh.manual_axes and dim % mesh.shape[a] == 0 else None
            for a, dim in zip(axes, x.shape)]
    return jax.lax.with_sharding_constraint(x, P(*axes))


def per_device(fn: Callable, args: tuple[jax.Array, ...],
               arg_axes: tuple[tuple[str | None, ...], ...],
               out_axes: tuple[str | None, ...]) -> jax.Array:
    """`fn(*args)` on each device's block, split by logical names over the mesh axes XLA
    partitions (a `shard_map` over them; axes already manual, as fsdp inside the train step's
    own shard_map, are left alone). For a kernel XLA cannot partition, a Pallas call: left to
    XLA it would gather every input whole onto every device. A mesh axis that does not divide
    every dimension its name labels leaves those dimensions whole (computed on each device)."""
    sizes: dict[str, list[int]] = {}  # logical name → the sizes of the dimensions it labels
    for arg, names in zip(args, arg_axes):
        for name, dim in zip(names, arg.shape):
            if name:
                sizes.setdefault(name, []).append(dim)
    mesh = jax.sharding.get_abstract_mesh()
    axis_of = {name: axis for name, axis in _auto_axes(sizes).items()
               if all(dim % mesh.shape[axis] == 0 for dim in sizes[name])}
    manual = set(axis_of.values()) | _single_auto_axes(mesh)
    if not manual:
        return fn(*args)
    spec = lambda names: P(*(axis_of.get(name) if name else None for name in names))  # noqa: E731
    return jax.shard_map(fn, in_specs=tuple(spec(names) for names in arg_axes),
                         out_specs=spec(out_axes), axis_names=manual, check_vma=False)(*args)


def _single_auto_axes(mesh) -> set[str]:
    """On a CPU backend, automatic axes of one device: manual too in `per_device`, which
    changes nothing they compute but keeps XLA's CPU compiler from aborting
    (AllReducePromotion, XLA 0.10) on the 16-bit gradient sums of a train step with cp.
    Other backends keep `per_device` as it was: no shard_map where nothing splits."""
    if not backend.is_cpu():
        return set()
    return {axis for axis in mesh.auto_axes if mesh.shape[axis] == 1}


def ways(name: str) -> int:
    """Into how many blocks `per_device` would split a dimension labelled `name` that divides."""
    axis = axis_of(name)
    return jax.sharding.get_abstract_mesh().shape[axis] if axis else 1


def split_over(name: str) -> tuple[str | None, int]:
    """(mesh axis, its size) a dimension labelled `name` is split over on more than one device,
    whether XLA partitions that axis or a shard_map around this code already made it manual
    (cp in the train step, parallel/fsdp.py); (None, 1) if none."""
    axis = active_rules().get(name)
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh.empty or axis not in mesh.shape or mesh.shape[axis] == 1:
        return None, 1
    return axis, mesh.shape[axis]


def _manual_split(name: str) -> str | None:
    """The mesh axis a dimension labelled `name` is split over by a shard_map around this code
    (cp in the train step), if any; None where XLA partitions it or nothing splits it."""
    axis, ways_ = split_over(name)
    return axis if ways_ > 1 and axis in jax.sharding.get_abstract_mesh().manual_axes else None


def sequence_sum(x_B: jax.Array) -> jax.Array:
    """Sums over each sequence's tokens, from this device's share of them (a sum over its own
    tokens) to the whole sequence's: summed over the devices a manual shard_map splits
    sequences over (cp in the train step); unchanged where XLA partitions the sum itself. A
    loss that is a function of such sums takes `sequence_share()` of it on each device."""
    axis = _manual_split("act_seq")
    return x_B if axis is None else _summed_everywhere(x_B, axis)


def sequence_share() -> float:
    """1 / the number of devices a manual shard_map splits each sequence over (else 1): the
    part of a per-sequence term each of them adds to the sums the train step reduces."""
    axis = _manual_split("act_seq")
    return 1.0 if axis is None else 1.0 / jax.sharding.get_abstract_mesh().shape[axis]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _summed_everywhere(x: jax.Array, axis: str) -> jax.Array:
    return jax.lax.psum(x, axis)


def _summed_forward(x, axis):
    return jax.lax.psum(x, axis), None


def _summed_backward(axis, _, cotangent):
    # Every device's terms depend on every device's part of the sum: the cotangent of a part is
    # the sum of theirs (JAX's own transpose of psum depends on shard_map's check_vma).
    return (jax.lax.psum(cotangent, axis),)


_summed_everywhere.defvjp(_summed_forward, _summed_backward)


def axis_of(name: str) -> str | None:
    """The mesh axis `per_device` would split a dimension labelled `name` over, if any."""
    return _auto_axes([name]).get(name)


def _auto_axes(names) -> dict[str, str]:
    """Logical name → the mesh axis the rules map it to, where XLA partitions that axis (not
    manual) and it has more than one device."""
    rules = active_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return {}
    return {name: rules[name] for name in names
            if rules.get(name) in mesh.auto_axes and mesh.shape[rules[name]] > 1}
