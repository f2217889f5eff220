"""`training.offload_params`: the fp32 parameters in pinned host memory, the update streamed.

The train state keeps the fp32 master weights (and LoRA's frozen base) in pinned host memory
(training/state.py), like DeepSpeed's `offload_param` and MaxText's
`parameter_memory_host_offload`. Inside the step nothing brings them over whole:

    forward, backward   each layer's shard is copied to the device when the layer loop reaches
                        it, cast and gathered there (parallel/collectives.py `_fetch`); what is
                        not a layer stack (embedding, norms, head) is copied once per step
    update              `StreamedUpdate`: a loop over each stack's layers copies that layer's
                        parameters, moments and gradient slice to the device, updates them and
                        copies the new parameters and moments back; the rest is updated at once

so the device holds the gradients (fp32, sharded as the ZeRO stage says), one layer's state at
a time and the activations. The optimizer is optax's, updated on pieces: its decisions over
all the gradients (the clip by their global norm, the skip when any is not finite) are taken
first, from all of them, and applied to each piece (training/optim.py `adamw(...,
clipped_outside=True)`); its state has the same structure and values as an update in one piece.
The CPU backend has pinned host memory too (the same RAM), so the suite runs this program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tunix_train.config import Config, ConfigError
from tunix_train.models import quantization
from tunix_train.parallel.sharding import to_device, to_host
from tunix_train.trainers import TRAINERS
from tunix_train.training import optim
from tunix_train.training.state import HOST


def check_supported(cfg: Config, pp: int) -> None:
    """Parameters in host memory reach the device inside the next-token trainer's layer loop;
    a pipeline stage's whole stack, and the other trainers' own steps (DPO's reference, GRPO's
    rollouts), would need them on the device."""
    if not cfg.training.offload_params:
        return
    if pp > 1:
        raise ConfigError(
            f"training.offload_params=true with pp={pp} in model.mesh_shape: a pipeline stage "
            f"fetches its layers whole, not one at a time from host memory; put those devices "
            f"on fsdp, or set training.offload_params=false.")
    if not TRAINERS[cfg.trainer.name].offload_params:
        raise ConfigError(
            f"training.offload_params=true is for the default trainer (pre-training, SFT, "
            f"LoRA), not trainer={cfg.trainer.name} yet; set training.offload_params=false "
            f"(training.offload_optimizer=true still offloads the optimizer's moments).")


@dataclass(frozen=True)
class StreamedUpdate:
    """The optimizer update a piece at a time: the leaves that are not layer stacks at once,
    then each stack's layers in a loop."""

    optimizer: optax.GradientTransformation  # built with clipped_outside=True
    max_norm: float  # optimizer.grad_clip; 0 = no clipping
    stacked: Any  # bool per parameter: a layer stack [layers, ...]

    def __call__(self, sums: Any, denominator: jax.Array, opt_state: Any, params: Any,
                 homes: dict) -> tuple[Any, Any, jax.Array]:
        """(new params, new optimizer state, the gradients' global norm) from the gradient
        `sums` / `denominator`, each leaf in the memory `homes` (the state's shardings:
        {"params", "opt_state"}) says. The division is done a piece at a time too: a divided
        copy of the gradients is never formed, so the norm comes from the sums: ‖g/d‖ = ‖g‖/d."""
        finite = jnp.isfinite(denominator) & jnp.all(jnp.array(
            [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(sums)]))
        norm = optax.tree.norm(sums) / denominator

        def prepared(g):  # the global decisions, applied to one piece of one gradient's sum
            g = (g / denominator).astype(jnp.float32)
            return optim.clip(jnp.where(finite, g, jnp.nan), norm, self.max_norm)

        pieces = _Pieces.of(self.optimizer, params, sums, opt_state, self.stacked, homes)
        whole = [i for i, s in enumerate(pieces.stacked) if not s]
        if whole:  # their moments too, and the scalars (counts, skip counters)
            pieces.update_whole(whole, prepared)
        lengths = sorted({pieces.p[i].shape[0] for i, s in enumerate(pieces.stacked) if s})
        for n, length in enumerate(lengths):
            # Every piece's update computes the same new scalars: taken from one of them.
            pieces.update_stacks(length, prepared, scalars=not whole and n == 0)
        return pieces.results() + (norm,)


@dataclass
class _Pieces:
    """The update's trees as flat lists of leaves: parameters `p`, gradient sums `g`,
    optimizer state `s` (`owner[j]`: the parameter whose moment `s[j]` is, -1 for a scalar),
    where each leaf lives, and the new leaves as they are computed."""

    optimizer: optax.GradientTransformation
    p: list
    g: list
    s: list
    p_def: Any
    s_def: Any
    stacked: list
    owner: list
    p_home: list  # on host memory?
    s_home: list
    new_p: list
    new_s: list

    @classmethod
    def of(cls, optimizer, params, sums, opt_state, stacked, homes) -> _Pieces:
        p, p_def = jax.tree.flatten(params)
        s, s_def = jax.tree.flatten(opt_state)
        owner = jax.tree.leaves(optax.tree_utils.tree_map_params(
            optimizer, lambda _, i: i, opt_state, p_def.unflatten(range(len(p))),
            transform_non_params=lambda _: -1))
        return cls(optimizer, p, p_def.flatten_up_to(sums), s, p_def, s_def,
                   p_def.flatten_up_to(stacked), owner,
                   [_on_host(x) for x in p_def.flatten_up_to(homes["params"])],
                   [_on_host(x) for x in jax.tree.leaves(homes["opt_state"])], list(p), list(s))

    def update(self, pick, p_take, g_take, s_take) -> tuple[list, list]:
        """optimizer.update on the picked parameters' pieces (`*_take(i)`), the others empty,
        the scalars as `s_take` gives them: (new parameter leaves, new state leaves)."""
        empty = lambda x: jnp.zeros((0,), x.dtype)  # noqa: E731
        ps = [p_take(i) if pick(i) else empty(x) for i, x in enumerate(self.p)]
        gs = [g_take(i) if pick(i) else empty(x) for i, x in enumerate(self.g)]
        ss = [s_take(j) if self.owner[j] < 0 or pick(self.owner[j]) else empty(x)
              for j, x in enumerate(self.s)]
        params = self.p_def.unflatten(ps)
        updates, state = self.optimizer.update(self.p_def.unflatten(gs),
                                               self.s_def.unflatten(ss), params)
        return jax.tree.leaves(optax.apply_updates(params, updates)), jax.tree.leaves(state)

    def update_whole(self, whole: list[int], prepared) -> None:
        """The parameters that are not stacks, their moments and the scalars, at once."""
        ps, ss = self.update(lambda i: i in whole, lambda i: to_device(self.p[i]),
                             lambda i: prepared(self.g[i]), lambda j: to_device(self.s[j]))
        for i in whole:
            self.new_p[i] = _home(ps[i], self.p_home[i])
        for j, x in enumerate(ss):
            if self.owner[j] < 0 or self.owner[j] in whole:
                self.new_s[j] = _home(x, self.s_home[j])

    def update_stacks(self, length: int, prepared, scalars: bool) -> None:
        """The stacks of `length` layers and their moments, a layer at a time: the stacks are
        the loop's carry and each layer is written back in place, so the new parameters and
        moments take the old ones' (donated) memory. `scalars`: keep the scalars computed."""
        group = [i for i, s in enumerate(self.stacked) if s and self.p[i].shape[0] == length]
        mine = [j for j in range(len(self.s)) if self.owner[j] in group]
        kept = [j for j in range(len(self.s)) if self.owner[j] < 0] if scalars else []

        def layer(carry, xs):
            (ps, ss, _), (k, g) = carry, xs
            at = lambda x: jax.lax.dynamic_index_in_dim(x, k, keepdims=False)  # noqa: E731
            new_ps, new_ss = self.update(
                lambda i: i in ps, lambda i: to_device(at(ps[i])), lambda i: prepared(g[i]),
                lambda j: to_device(at(ss[j]) if j in ss else self.s[j]))
            put = lambda x, new, home: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
                x, _home(new, home), k, 0)
            return ({i: put(ps[i], new_ps[i], self.p_home[i]) for i in group},
                    {j: put(ss[j], new_ss[j], self.s_home[j]) for j in mine},
                    {j: new_ss[j] for j in kept}), None

        (ps, ss, last), _ = jax.lax.scan(
            layer, ({i: self.p[i] for i in group}, {j: self.s[j] for j in mine},
                    {j: self.s[j] for j in kept}),
            (jnp.arange(length), {i: self.g[i] for i in group}))
        for i in group:
            self.new_p[i] = ps[i]
        for j, x in {**ss, **last}.items():
            self.new_s[j] = x

    def results(self) -> tuple[Any, Any]:
        return self.p_def.unflatten(self.new_p), self.s_def.unflatten(self.new_s)


def _on_host(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) == HOST


def _home(x: jax.Array, on_host: bool) -> jax.Array:
    return to_host(x) if on_host else x


class OnDevice:
    """models/params.py's hook for a step without FSDP's (the evaluation's): each parameter
    offloaded to host memory is copied to the device and cast when the model reads it, a layer
    at a time inside the layer loop."""

    def __init__(self, compute_dtype: Any):
        self.compute_dtype = compute_dtype

    def materialize(self, state: Any) -> Any:
        return quantization.cast(jax.tree.map(to_device, state), self.compute_dtype)

    materialize_stack = materialize

    def stage_rows(self, state: Any, stages: int, rows: int) -> tuple[Any, Any]:
        raise NotImplementedError("pipeline stages run inside the train step's shard_map only")

    def take(self, table: jax.Array, ids: jax.Array) -> jax.Array:
        return jnp.take(self.materialize(table), ids, axis=0)
