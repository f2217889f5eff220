"""The train state, built as eval_shape → shardings → jit(init, out_shardings=…).

Nothing is materialised before its sharding is known, so a model larger than one device's
memory is created directly in shards. The state is a plain dict so that checkpoints read as
plain trees: ``{"step": int32[], "params": {...}, "opt_state": optax state}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from tunix_train.config import Config
from tunix_train.models import hf_weights
from tunix_train.models.gemma3 import LAYERS, Gemma3
from tunix_train.parallel.sharding import ShardingPlan, optimizer_shardings, replicated, state_shardings

TrainState = dict[str, Any]


@dataclass(frozen=True)
class StateSpec:
    """Everything about the train state except its values."""

    graphdef: nnx.GraphDef
    abstract: TrainState  # ShapeDtypeStruct leaves
    shardings: TrainState  # NamedSharding leaves, same structure
    grad_shardings: Any  # like params; sharded over fsdp from ZeRO stage 2
    stacked: Any  # like params: True for scanned layer stacks (leading logical axis "layers")


def _new_model(cfg: Config) -> Gemma3:
    return Gemma3(cfg.model, rngs=nnx.Rngs(cfg.training.seed), remat=cfg.training.remat)


def spec(cfg: Config, mesh: Mesh, plan: ShardingPlan,
         optimizer: optax.GradientTransformation) -> StateSpec:
    graphdef, abstract_vars = nnx.split(nnx.eval_shape(lambda: _new_model(cfg)))
    params = nnx.to_pure_dict(abstract_vars)
    shard = lambda rules: nnx.to_pure_dict(state_shardings(abstract_vars, mesh, rules))  # noqa: E731
    opt_state = jax.eval_shape(optimizer.init, params)
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
                "opt_state": opt_state}
    shardings = {
        "step": replicated(mesh),
        "params": shard(plan.params),
        "opt_state": optimizer_shardings(optimizer, opt_state, shard(plan.optimizer), mesh),
    }
    stacked = nnx.to_pure_dict(nnx.map_state(
        lambda _, v: v.replace(v.get_metadata()["out_sharding"][0] == LAYERS), abstract_vars))
    return StateSpec(graphdef, abstract, shardings, shard(plan.grads), stacked)


def init(cfg: Config, state_spec: StateSpec, optimizer: optax.GradientTransformation) -> TrainState:
    """Initial state, each array created directly in its sharding: random, or with
    `model.init_from` the checkpoint's weights and a fresh optimizer state."""
    if cfg.model.init_from:
        params = hf_weights.load_init_from(cfg.model, state_spec.abstract["params"],
                                           state_spec.shardings["params"])
        return jax.jit(
            lambda p: {"step": jnp.zeros((), jnp.int32), "params": p, "opt_state": optimizer.init(p)},
            out_shardings=state_spec.shardings, donate_argnums=0,
        )(params)

    def make() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(_new_model(cfg)))
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": optimizer.init(params)}

    return jax.jit(make, out_shardings=state_spec.shardings)()


def with_params(params: Any, state_spec: StateSpec,
                optimizer: optax.GradientTransformation) -> TrainState:
    """A state at step 0 around given (e.g. pretrained) parameters, with a fresh optimizer."""

    def make(params) -> TrainState:
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": optimizer.init(params)}

    # Donated: the parameters move into the state instead of being copied.
    return jax.jit(make, out_shardings=state_spec.shardings, donate_argnums=0)(params)


def param_bytes(params: Any) -> tuple[int, int]:
    """(total bytes, bytes held by the most loaded device) of a sharded parameter tree."""
    total, per_device = 0, {}
    for leaf in jax.tree.leaves(params):
        total += leaf.size * leaf.dtype.itemsize
        for shard in leaf.addressable_shards:
            nbytes = shard.data.size * shard.data.dtype.itemsize
            per_device[shard.device] = per_device.get(shard.device, 0) + nbytes
    return total, max(per_device.values(), default=0)
