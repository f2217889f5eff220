"""The train state `{"step", "params", "opt_state"}`, laid out before any array exists.

The state is a plain dict so that checkpoints read as plain trees: `{"step": int32[],
"params": {...}, "opt_state": optax state}`. Its layout extends the parameters' (ParamLayout):
optimizer moments are sharded like their parameter at ZeRO stage 1 and up, scalars replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tunix_train import checkpoint
from tunix_train.parallel.layout import ParamLayout
from tunix_train.parallel.sharding import optimizer_shardings, replicated

TrainState = dict[str, Any]


@dataclass(frozen=True)
class StateLayout:
    """Everything about the train state except its values."""

    params: ParamLayout
    abstract: TrainState  # ShapeDtypeStruct leaves
    shardings: TrainState  # NamedSharding leaves, same structure

    @classmethod
    def create(cls, params: ParamLayout, optimizer: optax.GradientTransformation) -> StateLayout:
        opt_state = jax.eval_shape(optimizer.init, params.abstract)
        abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params.abstract,
                    "opt_state": opt_state}
        shardings = {
            "step": replicated(params.mesh),
            "params": params.shardings,
            "opt_state": optimizer_shardings(optimizer, opt_state, params.moment_shardings,
                                             params.mesh),
        }
        return cls(params, abstract, shardings)

    def with_shardings(self) -> TrainState:
        """The abstract state carrying its shardings (a restore or compile target)."""
        return checkpoint.with_shardings(self.abstract, self.shardings)

    def around(self, params: Any, optimizer: optax.GradientTransformation) -> TrainState:
        """A state at step 0 around `params`, with a fresh optimizer state."""

        def make(params) -> TrainState:
            return {"step": jnp.zeros((), jnp.int32), "params": params,
                    "opt_state": optimizer.init(params)}

        # Donated: the parameters move into the state instead of being copied.
        return jax.jit(make, out_shardings=self.shardings, donate_argnums=0)(params)


def param_bytes(params: Any) -> tuple[int, int]:
    """(total bytes, bytes held by the most loaded device) of a sharded parameter tree."""
    total, per_device = 0, {}
    for leaf in jax.tree.leaves(params):
        total += leaf.size * leaf.dtype.itemsize
        for shard in leaf.addressable_shards:
            nbytes = shard.data.size * shard.data.dtype.itemsize
            per_device[shard.device] = per_device.get(shard.device, 0) + nbytes
    return total, max(per_device.values(), default=0)
