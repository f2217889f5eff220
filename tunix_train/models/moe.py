"""A layer's mixture of experts, as pure functions: a router picks each token's top-k experts,
and each expert's gated MLP runs on its own tokens only, through one grouped matmul per
projection (Qwen3-MoE's and Mixtral's sparse blocks; tests/test_moe.py holds them to
transformers' implementations).

    route(x_TxD, router_DxE, top_k, normalize)      → Routing (weights, experts, probs)
    experts_mlp(x_TxD, routing, gate, up, down, gated) → y_TxD
    load_balancing_loss(probs_TxE, experts_TxK)      → Switch Transformer's auxiliary loss

Dropless by sorting: the T·k (token, expert) assignments are sorted by expert, so each
expert's rows are contiguous; `jax.lax.ragged_dot` multiplies each group of rows by its own
expert's weight, and the rows go back to their tokens, weighted, by a scatter-add. Nothing is
padded to a capacity and no token is dropped; the work is the k experts' per token, not E's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Routing:
    weights_TxK: jax.Array  # each token's top-k routing weights, in the input's dtype
    experts_TxK: jax.Array  # their experts, int32
    probs_TxE: jax.Array  # the router's softmax over all experts, fp32 (the auxiliary loss's)


def route(x_TxD: jax.Array, router_DxE: jax.Array, top_k: int, normalize: bool) -> Routing:
    """Softmax over the experts in fp32, the top k kept; with `normalize` (Mixtral, Qwen3-MoE's
    `norm_topk_prob`) the kept weights are rescaled to sum to 1."""
    logits_TxE = jnp.dot(x_TxD, router_DxE.astype(x_TxD.dtype)).astype(jnp.float32)
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    weights_TxK, experts_TxK = jax.lax.top_k(probs_TxE, top_k)
    if normalize:
        weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
    return Routing(weights_TxK.astype(x_TxD.dtype), experts_TxK.astype(jnp.int32), probs_TxE)


def experts_mlp(x_TxD: jax.Array, routing: Routing, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                down_ExFxD: jax.Array, gated: Callable[[jax.Array, jax.Array], jax.Array]
                ) -> jax.Array:
    """Σ over each token's k experts of weight · down(gated(gate(x), up(x))), each expert's
    projections applied to its own tokens only."""
    T, k = routing.experts_TxK.shape
    num_experts = gate_ExDxF.shape[0]
    expert_of_A = routing.experts_TxK.reshape(T * k)  # A = T·k assignments, token-major
    order_A = jnp.argsort(expert_of_A, stable=True)  # grouped by expert
    token_A = order_A // k
    sizes_E = jnp.bincount(expert_of_A, length=num_experts).astype(jnp.int32)
    rows_AxD = x_TxD[token_A]
    dtype = x_TxD.dtype

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(lhs, rhs.astype(dtype), sizes_E)

    h_AxF = gated(grouped(rows_AxD, gate_ExDxF), grouped(rows_AxD, up_ExDxF))
    out_AxD = grouped(h_AxF, down_ExFxD) * routing.weights_TxK.reshape(T * k)[order_A][:, None]
    return jnp.zeros_like(x_TxD).at[token_A].add(out_AxD)


def load_balancing_loss(probs_TxE: jax.Array, experts_TxK: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary loss as transformers computes it
    (`load_balancing_loss_func`): E · Σ_e (top-k assignments to e per token) · (mean router
    probability of e); k at perfect balance, larger as the router favours some experts."""
    T, num_experts = probs_TxE.shape
    assigned_E = jnp.zeros(num_experts, jnp.float32).at[experts_TxK.reshape(-1)].add(1.0) / T
    return num_experts * jnp.sum(assigned_E * jnp.mean(probs_TxE, axis=0))
