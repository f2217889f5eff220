"""`training.offload_params`: the fp32 parameters in pinned host memory, the update streamed.

The train state keeps the fp32 master weights (and LoRA's frozen base) in pinned host memory
(training/state.py), like DeepSpeed's `offload_param` and MaxText's
`parameter_memory_host_offload`. Inside the step nothing brings them over whole:

    forward, backward   each layer's shard is copied to the device when the layer loop reaches
                        it, cast and gathered there (parallel/collectives.py `_fetch`); what is
                        not a layer stack (embedding, norms, head) is copied once per step
    update              `streamed_update`: a loop over each stack's layers copies that layer's
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

from tunix_train.models import quantization
from tunix_train.parallel.sharding import to_device, to_host
from tunix_train.training import optim

HOST = "pinned_host"


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
        copy of the gradients is never formed."""
        # From the sums, as no divided copy of the gradients is formed: ‖g / d‖ = ‖g‖ / d.
        finite = jnp.isfinite(denominator) & jnp.all(jnp.array(
            [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(sums)]))
        norm = optax.tree.norm(sums) / denominator

        def prepared(g):  # the global decisions, applied to one piece of one gradient's sum
            g = (g / denominator).astype(jnp.float32)
            return optim.clip(jnp.where(finite, g, jnp.nan), norm, self.max_norm)

        p_leaves, p_def = jax.tree.flatten(params)
        g_leaves = p_def.flatten_up_to(sums)
        stacked = p_def.flatten_up_to(self.stacked)
        s_leaves, s_def = jax.tree.flatten(opt_state)
        owner = jax.tree.leaves(optax.tree_utils.tree_map_params(
            self.optimizer, lambda _, i: i, opt_state, p_def.unflatten(range(len(p_leaves))),
            transform_non_params=lambda _: -1))
        p_home = [_on_host(s) for s in p_def.flatten_up_to(homes["params"])]
        s_home = [_on_host(s) for s in jax.tree.leaves(homes["opt_state"])]

        def update(pick, p_take, g_take, s_take):
            """optimizer.update on the chosen pieces; the rest empty, scalars as they are."""
            empty = lambda x: jnp.zeros((0,), x.dtype)  # noqa: E731
            ps = [p_take(i) if pick(i) else empty(p) for i, p in enumerate(p_leaves)]
            gs = [g_take(i) if pick(i) else empty(g) for i, g in enumerate(g_leaves)]
            ss = [s_take(j) if owner[j] < 0 or pick(owner[j]) else empty(s)
                  for j, s in enumerate(s_leaves)]
            updates, new_state = self.optimizer.update(p_def.unflatten(gs), s_def.unflatten(ss),
                                                       p_def.unflatten(ps))
            return (jax.tree.leaves(optax.apply_updates(p_def.unflatten(ps), updates)),
                    jax.tree.leaves(new_state))

        new_p, new_s = list(p_leaves), list(s_leaves)
        scalars = [j for j in range(len(s_leaves)) if owner[j] < 0]
        whole = [i for i, s in enumerate(stacked) if not s]
        if whole:
            ps, ss = update(lambda i: not stacked[i], lambda i: to_device(p_leaves[i]),
                            lambda i: prepared(g_leaves[i]), lambda j: to_device(s_leaves[j]))
            for i in whole:
                new_p[i] = _home(ps[i], p_home[i])
            for j, s in enumerate(ss):  # their moments, and the scalars (counts, skip counters)
                if owner[j] < 0 or not stacked[owner[j]]:
                    new_s[j] = _home(s, s_home[j])
        lengths = sorted({p_leaves[i].shape[0] for i, s in enumerate(stacked) if s})
        for n, length in enumerate(lengths):
            group = [i for i, s in enumerate(stacked) if s and p_leaves[i].shape[0] == length]
            mine = [j for j in range(len(s_leaves)) if owner[j] in group]
            # Every piece's update computes the same new scalars: they are taken from one.
            own_scalars = scalars if not whole and n == 0 else []

            def layer(carry, xs, group=group, mine=mine, own_scalars=own_scalars):
                # The stacks are the loop's carry, each layer written back in place: the new
                # parameters and moments take the old ones' (donated) memory.
                (ps, ss, _), (k, g) = carry, xs
                at = lambda x: jax.lax.dynamic_index_in_dim(x, k, keepdims=False)  # noqa: E731
                new_ps, new_ss = update(lambda i: i in ps, lambda i: to_device(at(ps[i])),
                                        lambda i: prepared(g[i]),
                                        lambda j: to_device(at(ss[j]) if j in ss
                                                            else s_leaves[j]))
                put = lambda x, new, home: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
                    x, _home(new, home), k, 0)
                return ({i: put(ps[i], new_ps[i], p_home[i]) for i in group},
                        {j: put(ss[j], new_ss[j], s_home[j]) for j in mine},
                        {j: new_ss[j] for j in own_scalars}), None

            (ps, ss, last), _ = jax.lax.scan(
                layer, ({i: p_leaves[i] for i in group}, {j: s_leaves[j] for j in mine},
                        {j: s_leaves[j] for j in own_scalars}),
                (jnp.arange(length), {i: g_leaves[i] for i in group}))
            for i in group:
                new_p[i] = ps[i]
            for j in mine:
                new_s[j] = ss[j]
            for j in own_scalars:
                new_s[j] = last[j]
        return p_def.unflatten(new_p), s_def.unflatten(new_s), norm


def gradients(sums: Any, denominator: jax.Array) -> Any:
    """The step's fp32 gradients: its gradient sums over the loss's denominator."""
    return jax.tree.map(lambda g: (g / denominator).astype(jnp.float32), sums)


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
