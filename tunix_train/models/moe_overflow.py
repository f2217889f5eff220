"""The rows past each expert's block (`moe.in_blocks`): a loop over only the tiles they fill,
each tile's whole gated MLP at once through its expert's weights as they lie, with a custom VJP
that runs the same loop backwards (JAX cannot reverse a loop whose trip count is a value).

    overflow(x_TxD, weight_A, plan, gate, up, down, gated) → y_TxD
    (`plan`, an `Overflow`: which assignments fill which tiles, from moe.overflow_plan)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_R", "expert_N", "used"], meta_fields=["k", "tile"])
@dataclass(frozen=True)
class Overflow:
    """The rows past each expert's block, grouped by expert into tiles of `tile` rows: slot r
    holds assignment `slot_R[r]` (-1: none; token = assignment // k), tile n is expert
    `expert_N[n]`'s, and the first `used` tiles hold them all (static: R slots for the worst
    case, one expert taking every row; only the used tiles are computed)."""

    slot_R: jax.Array
    expert_N: jax.Array
    used: jax.Array  # int32 scalar
    k: int
    tile: int


def overflow(x_TxD: jax.Array, weight_A: jax.Array, plan: Overflow, gate_ExDxF: jax.Array,
             up_ExDxF: jax.Array, down_ExFxD: jax.Array, gated: Callable) -> jax.Array:
    """The overflow's part of each token's output [T, D] (each of its rows' results times its
    routing weight, summed): a `lax.fori_loop` over the used tiles, each tile's whole MLP on its
    rows gathered from the tokens, through the weights of its expert as they lie
    (`_overflow_rows`). Run on a device's share of the experts' width (tp), the result is that
    share's partial sum, for the caller to add up once after the loop (`moe.in_blocks`): no
    collective inside the loop."""
    dtype = x_TxD.dtype
    return _overflow_rows(gated, plan, x_TxD, weight_A.astype(dtype), gate_ExDxF.astype(dtype),
                          up_ExDxF.astype(dtype), down_ExFxD.astype(dtype))


def _tile_mlp(gated: Callable, x_txD, weight_t, gate_DxF, up_DxF, down_FxD) -> jax.Array:
    h_txF = gated(jnp.dot(x_txD, gate_DxF), jnp.dot(x_txD, up_DxF))
    return weight_t[:, None] * jnp.dot(h_txF, down_FxD)


def _tile_rows(tiles: Overflow, x_TxD: jax.Array, weight_A: jax.Array, n: jax.Array):
    """Tile n's assignments, which of them are rows, their tokens, x and routing weights."""
    a_t = jax.lax.dynamic_slice_in_dim(tiles.slot_R, n * tiles.tile, tiles.tile)
    used_t = a_t >= 0
    token_t = jnp.where(used_t, a_t // tiles.k, x_TxD.shape[0])  # past the end: dropped
    x_txD = jnp.where(used_t[:, None], x_TxD[jnp.minimum(token_t, x_TxD.shape[0] - 1)], 0)
    return a_t, token_t, x_txD, jnp.where(used_t, weight_A[jnp.maximum(a_t, 0)], 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _overflow_rows(gated: Callable, tiles: Overflow, x_TxD, weight_A, gate_ExDxF, up_ExDxF,
                   down_ExFxD):
    """[T, D]: each used tile's rows through its expert's MLP, times their routing weights,
    added to their tokens. The backward pass is the same loop (a custom VJP: JAX cannot reverse
    a loop whose trip count is a value), each tile's MLP differentiated where it runs, its
    weights' gradients added into its expert's. Nothing of the forward pass is kept for it, so
    rematerialisation never runs the loop again."""
    return _overflow_fwd(gated, tiles, x_TxD, weight_A, gate_ExDxF, up_ExDxF, down_ExFxD)[0]


def _overflow_fwd(gated, tiles, x_TxD, weight_A, gate_ExDxF, up_ExDxF, down_ExFxD):
    def tile(n, y_TxD):
        _, token_t, x_txD, weight_t = _tile_rows(tiles, x_TxD, weight_A, n)
        e = tiles.expert_N[n]
        y_txD = _tile_mlp(gated, x_txD, weight_t, gate_ExDxF[e], up_ExDxF[e], down_ExFxD[e])
        return y_TxD.at[token_t].add(y_txD, mode="drop")

    y_TxD = jax.lax.fori_loop(0, tiles.used, tile, jnp.zeros_like(x_TxD))
    return y_TxD, (tiles, x_TxD, weight_A, gate_ExDxF, up_ExDxF, down_ExFxD)


def _overflow_bwd(gated, residuals, dy_TxD):
    tiles, x_TxD, weight_A, *weights = residuals
    T = x_TxD.shape[0]

    def tile(n, grads):
        dx_TxD, dweight_A, *dweights = grads
        a_t, token_t, x_txD, weight_t = _tile_rows(tiles, x_TxD, weight_A, n)
        e = tiles.expert_N[n]
        dy_txD = jnp.where((token_t < T)[:, None], dy_TxD[jnp.minimum(token_t, T - 1)], 0)
        gate_DxF, up_DxF, down_FxD = (w[e] for w in weights)
        h_txF, gated_vjp = jax.vjp(gated, jnp.dot(x_txD, gate_DxF), jnp.dot(x_txD, up_DxF))
        # The routing weight's gradient from dh rather than from the down projection's output:
        # <dy, h · down> = <h, dy · downᵀ>, so the forward's last matmul is not run again.
        dh_txF = jnp.dot(dy_txD, down_FxD.T)
        dweight_t = jnp.sum(h_txF * dh_txF, axis=-1)
        dgate_txF, dup_txF = gated_vjp(weight_t[:, None] * dh_txF)
        dx_txD = jnp.dot(dgate_txF, gate_DxF.T) + jnp.dot(dup_txF, up_DxF.T)
        dw = (jnp.dot(x_txD.T, dgate_txF), jnp.dot(x_txD.T, dup_txF),
              jnp.dot(h_txF.T, weight_t[:, None] * dy_txD))
        dx_TxD = dx_TxD.at[token_t].add(dx_txD, mode="drop")
        dweight_A = dweight_A.at[jnp.where(a_t >= 0, a_t, weight_A.shape[0])].set(
            dweight_t, mode="drop")
        return (dx_TxD, dweight_A, *(g.at[e].add(d) for g, d in zip(dweights, dw)))

    zeros = (jnp.zeros_like(x_TxD), jnp.zeros_like(weight_A), *map(jnp.zeros_like, weights))
    grads = jax.lax.fori_loop(0, tiles.used, tile, zeros)
    return (None, *grads)


_overflow_rows.defvjp(_overflow_fwd, _overflow_bwd)
