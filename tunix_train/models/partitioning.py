"""Activation sharding constraints, named by logical axes only.

Model code calls `constrain(x, ("act_batch", "act_seq", "act_embed"))`; whoever runs the model
decides what the names mean by putting Flax logical-axis rules and a mesh in effect while
tracing (tunix_train/parallel/sharding.py: `activate`). Outside such a block it is a no-op, so
the model runs unchanged on one device, in tests, and under `eval_shape`.
"""

from __future__ import annotations

import jax
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint by logical names; axes that do not divide evenly stay unsharded."""
    rules = dict(flax_spmd.get_logical_axis_rules())
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    axes = [rules.get(name) if name else None for name in logical_axes]
    axes = [a if a and dim % mesh.shape[a] == 0 else None for a, dim in zip(axes, x.shape)]
    return jax.lax.with_sharding_constraint(x, P(*axes))
