"""The router's side of a mixture of experts: what each routed layer counts of its routing
(`statistics`), added over layers and stacks by the decoder (`total`, `added`), and the
training loss's terms from those sums: Switch's load-balancing loss as transformers computes
it, ST-MoE's z-loss (`losses`), and the logged expert load (`load`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from tunix_train.models import moe

# A routed layer's sums (fp32), added over layers: `assigned_E` top-k assignments per expert,
# `probs_E` router probabilities per expert, `z` squared logsumexps, `tokens` routed tokens.
Statistics = dict[str, jax.Array]


def statistics(routing: moe.Routing, capacity_factor: float | None = None,
               blocks: moe.Blocks | None = None) -> Statistics:
    """Also `dropped`: the assignments past their expert's capacity, and (experts split over
    devices, `blocks`) past their block's rows (0 when dropless)."""
    T, num_experts = routing.probs_TxE.shape
    k = routing.experts_TxK.shape[1]
    assigned_E = jnp.zeros(num_experts, jnp.float32).at[routing.experts_TxK.reshape(-1)].add(1.0)
    kept_E = assigned_E if capacity_factor is None else jnp.minimum(
        assigned_E, moe.capacity(T * k, num_experts, capacity_factor))
    dropped = jnp.sum(assigned_E - kept_E)
    if blocks is not None:
        per_shard = jnp.sum(kept_E.reshape(blocks.shards, blocks.held), axis=1)
        dropped = dropped + jnp.sum(jnp.maximum(per_shard - blocks.rows, 0.0))
    return {"assigned_E": assigned_E, "probs_E": jnp.sum(routing.probs_TxE, axis=0),
            "z": jnp.sum(jnp.square(routing.logsumexp_T)),
            "tokens": jnp.asarray(T, jnp.float32), "dropped": dropped}


def total(stacks: list[Statistics | None]) -> Statistics | None:
    """The sums over every routed layer, from stacks of layers' statistics (layers on axis 0);
    None where no layer routes."""
    parts = [jax.tree.map(lambda a: jnp.sum(a, axis=0), s) for s in stacks if s]
    return jax.tree.map(lambda *a: sum(a), *parts) if parts else None


@dataclass(frozen=True)
class LossWeights:
    """How much of the router's losses the training loss adds (training.moe_aux_loss_weight,
    training.router_z_loss_weight); zero for evaluation."""

    aux: float = 0.0
    z: float = 0.0


def losses(stats: Statistics) -> dict[str, jax.Array]:
    """The load-balancing loss over all routed layers' tokens at once, as transformers'
    `load_balancing_loss_func` computes it over its concatenated router logits: E · Σ_e
    (assignments to e / N) · (router probability of e / N), N = tokens × routed layers; and
    ST-MoE's z-loss, the mean squared logsumexp of the router logits."""
    n = stats["tokens"]
    num_experts = stats["assigned_E"].shape[-1]
    aux = num_experts * jnp.sum((stats["assigned_E"] / n) * (stats["probs_E"] / n))
    return {"moe_aux_loss": aux, "router_z_loss": stats["z"] / n}


def added(*parts: Statistics | None) -> Statistics | None:
    """Statistics of layers apart (each already summed over its layers) added up."""
    parts = [p for p in parts if p is not None]
    return jax.tree.map(lambda *a: sum(a), *parts) if parts else None


def with_losses(loss_sum: jax.Array, tokens: jax.Array, stats: Statistics | None,
                weights: LossWeights) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A micro-batch's token-loss sum with the router's losses added once per counted token
    (as transformers adds them to the mean token loss), and the `METRICS` as sums over those
    tokens; unchanged, and no metrics, for a dense model (`stats` None)."""
    if stats is None:
        return loss_sum, {}
    terms = losses(stats)
    loss_sum = loss_sum + tokens * (weights.aux * terms["moe_aux_loss"]
                                    + weights.z * terms["router_z_loss"])
    return loss_sum, {name: value * tokens for name, value in {**terms, **load(stats)}.items()}


# What a training step logs of a mixture of experts, each a mean over the step's tokens.
METRICS = ("moe_aux_loss", "router_z_loss", "expert_load_max", "expert_load_min",
           "moe_dropped_fraction")


def load(stats: Statistics) -> dict[str, jax.Array]:
    """The busiest and idlest experts' share of the routed tokens (k/E each at balance), and
    the fraction of assignments dropped past an expert's capacity."""
    share_E = stats["assigned_E"] / stats["tokens"]
    return {"expert_load_max": jnp.max(share_E), "expert_load_min": jnp.min(share_E),
            "moe_dropped_fraction": stats["dropped"] / jnp.sum(stats["assigned_E"])}
