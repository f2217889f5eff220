"""A layer's mixture of experts, as pure functions: a router picks each token's top-k experts,
and each expert's gated MLP runs on its own tokens only, through one grouped matmul per
projection (Qwen3-MoE's and Mixtral's sparse blocks; tests/test_moe.py holds them to
transformers' implementations).

    route(x_TxD, router_DxE, top_k, normalize)      → Routing (weights, experts, probs)
    experts_mlp(x_TxD, routing, gate, up, down, gated) → y_TxD
    load_balancing_loss(probs_TxE, experts_TxK)      → Switch Transformer's auxiliary loss
    statistics(routing) → Statistics: a layer's sums, added over layers (and stacks) by the
                          decoder, turned into the losses and metrics by `losses`/`metrics`

Dropless by sorting: the T·k (token, expert) assignments are sorted by expert, so each
expert's rows are contiguous; a grouped matmul multiplies each group of rows by its own
expert's weight (`tiled` by default, `jax.lax.ragged_dot` on request), and the rows go back to
their tokens, weighted, by a scatter-add. No token is dropped; the work is about the k experts'
per token, not E's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Routing:
    weights_TxK: jax.Array  # each token's top-k routing weights, in the input's dtype
    experts_TxK: jax.Array  # their experts, int32
    probs_TxE: jax.Array  # the router's softmax over all experts, fp32 (the auxiliary loss's)
    logsumexp_T: jax.Array  # of the router's logits, fp32 (the z-loss's)


def route(x_TxD: jax.Array, router_DxE: jax.Array, top_k: int, normalize: bool) -> Routing:
    """Softmax over the experts in fp32, the top k kept; with `normalize` (Mixtral, Qwen3-MoE's
    `norm_topk_prob`) the kept weights are rescaled to sum to 1."""
    logits_TxE = jnp.dot(x_TxD, router_DxE.astype(x_TxD.dtype)).astype(jnp.float32)
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    weights_TxK, experts_TxK = jax.lax.top_k(probs_TxE, top_k)
    if normalize:
        weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
    return Routing(weights_TxK.astype(x_TxD.dtype), experts_TxK.astype(jnp.int32), probs_TxE,
                   jax.nn.logsumexp(logits_TxE, axis=-1))


def experts_mlp(x_TxD: jax.Array, routing: Routing, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                down_ExFxD: jax.Array, gated: Callable[[jax.Array, jax.Array], jax.Array],
                matmul: str = "tiles") -> jax.Array:
    """Σ over each token's k experts of weight · down(gated(gate(x), up(x))), each expert's
    projections applied to its own tokens only (`matmul`: how, `MATMULS`). Rows move between
    token order and expert order by gathers both ways (`take`), never by a scatter."""
    T, k = routing.experts_TxK.shape
    num_experts = gate_ExDxF.shape[0]
    expert_of_A = routing.experts_TxK.reshape(T * k)  # A = T·k assignments, token-major
    order_A = jnp.argsort(expert_of_A, stable=True).astype(jnp.int32)  # grouped by expert
    sorted_at_A = jnp.argsort(order_A).astype(jnp.int32)  # where each assignment went
    sizes_E = jnp.bincount(expert_of_A, length=num_experts).astype(jnp.int32)
    rows_AxD = take(x_TxD, order_A // k, sorted_at_A.reshape(T, k))
    dtype = x_TxD.dtype
    multiply = MATMULS[matmul](T * k, num_experts, sizes_E)

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return multiply(lhs, rhs.astype(dtype))

    h_AxF = gated(grouped(rows_AxD, gate_ExDxF), grouped(rows_AxD, up_ExDxF))
    out_AxD = grouped(h_AxF, down_ExFxD)
    out_TxKxD = take(out_AxD, sorted_at_A, order_A[:, None]).reshape(T, k, -1)
    return jnp.einsum("tkd,tk->td", out_TxKxD, routing.weights_TxK)


@jax.custom_vjp
def take(x_NxD: jax.Array, index_M: jax.Array, uses_NxR: jax.Array) -> jax.Array:
    """Rows x[index] (index -1: a zero row), where `uses` lists for each row of x the positions
    of `index` that take it (-1: none; every position of index appears there once): the
    backward pass sums each row's uses by a gather, not by the scatter-add JAX's own gradient
    of a gather is (serial on XLA's CPU compiler)."""
    return _rows(x_NxD, index_M)


def _rows(x: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.where((index >= 0)[:, None], x[jnp.maximum(index, 0)], jnp.zeros((), x.dtype))


def _take_fwd(x_NxD, index_M, uses_NxR):
    return _rows(x_NxD, index_M), (index_M, uses_NxR)


def _take_bwd(residuals, dy_MxD):
    _, uses_NxR = residuals
    n, r = uses_NxR.shape
    dx = _rows(dy_MxD, uses_NxR.reshape(n * r)).reshape(n, r, -1).sum(axis=1)
    return dx, None, None


take.defvjp(_take_fwd, _take_bwd)


def tile_rows(rows: int, experts: int) -> int:
    """Rows per tile of `tiled`: the power of two nearest below half an expert's mean share
    (8 to 256), so padding adds at most about half the rows again, for weights gathered about
    three times an expert layer's (a quarter of the share measured no faster on CPU, for more
    gathered weights)."""
    half_mean = max(rows / experts / 2, 1)
    return min(256, max(8, 1 << int(math.log2(half_mean))))


def tiled(rows: int, experts: int, sizes_E: jax.Array) -> Callable:
    """A grouped matmul for rows sorted by expert (`sizes_E` of each): each expert's rows are
    padded to whole tiles of `tile_rows` rows, every tile multiplied by its own expert's weight
    in one batched matmul, and the rows taken back out. The shapes are static: A rows fill at
    most (A + E·(tile - 1)) / tile tiles. Work and memory follow the rows, about 1.5x those of
    the k experts a token goes to, where `jax.lax.ragged_dot` on XLA's CPU (and GPU) compiler
    multiplies every row by every expert (E times the work)."""
    tile = tile_rows(rows, experts)
    n_tiles = -(-(rows + experts * (tile - 1)) // tile)
    tiles_E = (sizes_E + tile - 1) // tile
    first_tile_E = jnp.cumsum(tiles_E) - tiles_E
    start_E = jnp.cumsum(sizes_E) - sizes_E
    expert_A = jnp.repeat(jnp.arange(experts), sizes_E, total_repeat_length=rows)
    slot_A = (first_tile_E[expert_A] * tile + jnp.arange(rows) - start_E[expert_A]).astype(
        jnp.int32)
    row_P = jnp.full(n_tiles * tile, -1, jnp.int32).at[slot_A].set(
        jnp.arange(rows, dtype=jnp.int32), unique_indices=True)  # -1: padding
    # Tile n's expert: how many experts' tiles end at or before it (unused tiles: the last).
    expert_N = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles_E), jnp.arange(n_tiles),
                                            side="right"), experts - 1)

    def multiply(lhs_AxD: jax.Array, rhs_ExDxF: jax.Array) -> jax.Array:
        padded = take(lhs_AxD, row_P, slot_A[:, None])
        y_NxtxF = jnp.einsum("ntd,ndf->ntf", padded.reshape(n_tiles, tile, -1),
                             rhs_ExDxF[expert_N])
        return take(y_NxtxF.reshape(n_tiles * tile, -1), slot_A, row_P[:, None])

    return multiply


def ragged(rows: int, experts: int, sizes_E: jax.Array) -> Callable:
    """`jax.lax.ragged_dot`: one grouped matmul, as fast as the compiler's lowering of it."""
    return lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, sizes_E)


# model.moe_matmul → (rows, experts, sizes) → (lhs [A, D], rhs [E, D, F]) → [A, F].
MATMULS = {"tiles": tiled, "ragged_dot": ragged}


def load_balancing_loss(probs_TxE: jax.Array, experts_TxK: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary loss as transformers computes it
    (`load_balancing_loss_func`): E · Σ_e (top-k assignments to e per token) · (mean router
    probability of e); k at perfect balance, larger as the router favours some experts."""
    T, num_experts = probs_TxE.shape
    assigned_E = jnp.zeros(num_experts, jnp.float32).at[experts_TxK.reshape(-1)].add(1.0) / T
    return num_experts * jnp.sum(assigned_E * jnp.mean(probs_TxE, axis=0))


# A routed layer's sums (fp32), added over layers: `assigned_E` top-k assignments per expert,
# `probs_E` router probabilities per expert, `z` squared logsumexps, `tokens` routed tokens.
Statistics = dict[str, jax.Array]


def statistics(routing: Routing) -> Statistics:
    T, num_experts = routing.probs_TxE.shape
    assigned_E = jnp.zeros(num_experts, jnp.float32).at[routing.experts_TxK.reshape(-1)].add(1.0)
    return {"assigned_E": assigned_E, "probs_E": jnp.sum(routing.probs_TxE, axis=0),
            "z": jnp.sum(jnp.square(routing.logsumexp_T)),
            "tokens": jnp.asarray(T, jnp.float32)}


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


# What a training step logs of a mixture of experts, each a mean over the step's tokens.
METRICS = ("moe_aux_loss", "router_z_loss", "expert_load_max", "expert_load_min")


def load(stats: Statistics) -> dict[str, jax.Array]:
    """The busiest and idlest experts' share of the routed tokens (k/E each at balance)."""
    share_E = stats["assigned_E"] / stats["tokens"]
    return {"expert_load_max": jnp.max(share_E), "expert_load_min": jnp.min(share_E)}
