"""The train state `{"step", "params", "opt_state"}`, laid out before any array exists.

The state is a plain dict so that checkpoints read as plain trees: `{"step": int32[],
"params": {...}, "opt_state": optax state}`. With LoRA, `params` are the adapters and the
state also holds `"frozen"`, the base (parallel/layout.py), which checkpoints leave out: it
comes from its source (`model.init_from`, `checkpoint.init_params_from` or the seed) at every
start. Its layout extends the parameters' (ParamLayout):
optimizer moments are sharded like their parameter at ZeRO stage 1 and up, scalars replicated.
With `training.offload_optimizer` (ZeRO-Offload) the moments live in pinned host memory, each
device's shard in its own host's: the train step brings them to the device for the update and
sends the new ones back (training/train_step.py); the step counters stay on the device.
With `training.offload_params` the fp32 parameters (and LoRA's base) live there too, and the
update streams through the device a layer at a time (training/offload.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tunix_train import checkpoint
from tunix_train.models import quantization
from tunix_train.parallel.layout import ParamLayout
from tunix_train.parallel.sharding import optimizer_shardings, replicated

TrainState = dict[str, Any]
HOST, DEVICE = "pinned_host", "device"  # JAX memory kinds
FROZEN = checkpoint.NOT_SAVED[0]  # the train state's LoRA base


@dataclass(frozen=True)
class StateLayout:
    """Everything about the train state except its values."""

    params: ParamLayout
    abstract: TrainState  # ShapeDtypeStruct leaves
    shardings: TrainState  # NamedSharding leaves, same structure

    @classmethod
    def create(cls, params: ParamLayout, optimizer: optax.GradientTransformation,
               offload_optimizer: bool = False, offload_params: bool = False) -> StateLayout:
        opt_state = jax.eval_shape(optimizer.init, params.abstract)
        abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params.abstract,
                    "opt_state": opt_state}
        moments = params.moment_shardings
        if offload_optimizer:
            moments = jax.tree.map(lambda s: s.with_memory_kind(HOST), moments)
        home = (lambda tree: jax.tree.map(lambda s: s.with_memory_kind(HOST), tree)) \
            if offload_params else (lambda tree: tree)
        shardings = {
            "step": replicated(params.mesh),
            "params": home(params.shardings),
            "opt_state": optimizer_shardings(optimizer, opt_state, moments, params.mesh),
        }
        if params.frozen is not None:
            abstract[FROZEN] = params.frozen.abstract
            shardings[FROZEN] = home(params.frozen.shardings)
        return cls(params, abstract, shardings)

    @property
    def offloaded(self) -> bool:
        return any(s.memory_kind == HOST for s in jax.tree.leaves(self.shardings["opt_state"]))

    @property
    def params_offloaded(self) -> bool:
        return any(s.memory_kind == HOST for s in jax.tree.leaves(self.shardings["params"]))

    def on_device(self, opt_state: Any) -> Any:
        """The optimizer state moved to device memory, each shard where it is (a no-op unless
        offloaded)."""
        if not self.offloaded:
            return opt_state
        return jax.device_put(opt_state, jax.tree.map(lambda s: s.with_memory_kind(DEVICE),
                                                      self.shardings["opt_state"]))

    def to_home(self, opt_state: Any) -> Any:
        """The optimizer state moved to where the layout keeps it (host memory if offloaded)."""
        return jax.device_put(opt_state, self.shardings["opt_state"]) if self.offloaded \
            else opt_state

    def with_shardings(self) -> TrainState:
        """The abstract state carrying its shardings (a compile target)."""
        return checkpoint.with_shardings(self.abstract, self.shardings)

    def saved_target(self) -> TrainState:
        """What a checkpoint of this state holds, abstract with shardings (a restore target)."""
        return checkpoint.saved_part(self.with_shardings())

    def around(self, params: Any, optimizer: optax.GradientTransformation,
               frozen: Any = None) -> TrainState:
        """A state at step 0 around `params` (and LoRA's `frozen` base), with a fresh optimizer
        state."""

        def make(params) -> TrainState:
            return {"step": jnp.zeros((), jnp.int32), "params": params,
                    "opt_state": optimizer.init(params)}

        # Donated: the parameters move into the state instead of being copied (unless the
        # state keeps them in host memory: they are copied there, and freed after).
        state = jax.jit(make, out_shardings=checkpoint.saved_part(self.shardings),
                        donate_argnums=() if self.params_offloaded else 0)(params)
        return state if frozen is None else {**state, FROZEN: frozen}

    def model_params(self, state: TrainState) -> Any:
        """The parameter tree the model reads: the trainable parameters and LoRA's base."""
        return self.params.merge(state["params"], state.get(FROZEN))


def param_bytes(params: Any) -> tuple[int, int]:
    """(total bytes, bytes held by the most loaded device) of a sharded parameter tree."""
    total, per_device = 0, {}
    for leaf in jax.tree.leaves(params):
        total += leaf.size * quantization.itemsize(leaf.dtype)
        for shard in leaf.addressable_shards:
            nbytes = shard.data.size * quantization.itemsize(leaf.dtype)
            per_device[shard.device] = per_device.get(shard.device, 0) + nbytes
    return total, max(per_device.values(), default=0)
