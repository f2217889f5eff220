"""A layer's experts on their rows dropless (`moe.in_blocks`): each expert's first rows in a
block of its own, and the rows past it (the overflow) through a loop over only the tiles they
fill, each tile's whole gated MLP at once through its expert's weights as they lie. One custom
VJP holds both: its backward pass runs the blocks' and then the same loop backwards (JAX
cannot reverse a loop whose trip count is a value), the loop adding into the blocks' gradients.

    blocks_and_overflow(x_TxD, weight_A, blocks, plan, gate, up, down, gated) → y_TxD
    (`blocks`, a `Blocked`: which assignment each block row holds and where each assignment sits;
    `plan`, an `Overflow`: which assignments fill which tiles; both from models/moe.py)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tunix_train.models.layers import PROJECTION
from tunix_train.models.moe_rows import rows_at, tokens_of


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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["assignment_P", "row_A"],
                   meta_fields=[])
@dataclass(frozen=True)
class Blocked:
    """Where the assignments within their expert's block sit: block row p (of E · C, expert
    p // C's) holds assignment `assignment_P[p]` (-1: none), assignment a sits at block row
    `row_A[a]` (-1: in the overflow)."""

    assignment_P: jax.Array
    row_A: jax.Array


def blocks_and_overflow(x_TxD: jax.Array, weight_A: jax.Array, blocks: Blocked, plan: Overflow,
                        gate_ExDxF: jax.Array, up_ExDxF: jax.Array, down_ExFxD: jax.Array,
                        gated: Callable) -> jax.Array:
    """Each token's output [T, D]: Σ over its k assignments of routing weight × its expert's
    gated MLP, the blocks as one batched matmul per projection ([E, C, D] × [E, D, F], the
    weights where they lie), then a `lax.fori_loop` over the overflow's used tiles, each adding
    its rows' results to their tokens. The blocks' three projections are named as a dense
    layer's are (`PROJECTION`), so `training.remat=save_dots` keeps them for the backward pass.
    Run on a device's share of the experts' width (tp), the result is that share's partial
    sum, for the caller to add up once (`moe.in_blocks`): no collective inside the loop."""
    dtype = x_TxD.dtype
    return _experts(gated, blocks, plan, x_TxD, weight_A.astype(dtype), gate_ExDxF.astype(dtype),
                    up_ExDxF.astype(dtype), down_ExFxD.astype(dtype))


def _block_rows(blocks: Blocked, k: int, experts: int, x_TxD: jax.Array) -> jax.Array:
    """The block rows' inputs [E, C, D] (empty rows: zeros)."""
    return rows_at(x_TxD, tokens_of(blocks.assignment_P, k)).reshape(experts, -1,
                                                                     x_TxD.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(gated: Callable, blocks: Blocked, tiles: Overflow, x_TxD, weight_A, gate_ExDxF,
             up_ExDxF, down_ExFxD):
    """[T, D]: the blocks' and the overflow's results, weighted, added to their tokens. The
    backward pass differentiates the blocks (from their saved or recomputed projections) and
    then runs the loop again, each tile's MLP differentiated where it runs, starting from the
    blocks' gradients: its weights' gradients added in place into its expert's, no zeroed
    [E, D, F] buffers to add afterwards (measured 0.03-0.08 of a dense step, bench/moe.py on
    fsdp 4 × tp 2). Of the loop nothing is kept for the backward pass, so rematerialisation
    never runs it again."""
    return _experts_fwd(gated, blocks, tiles, x_TxD, weight_A, gate_ExDxF, up_ExDxF,
                        down_ExFxD)[0]


def _experts_fwd(gated, blocks, tiles, x_TxD, weight_A, gate_ExDxF, up_ExDxF, down_ExFxD):
    (T, D), k = x_TxD.shape, tiles.k
    x_ExCxD = _block_rows(blocks, k, gate_ExDxF.shape[0], x_TxD)
    gate_ExCxF = checkpoint_name(jnp.einsum("ecd,edf->ecf", x_ExCxD, gate_ExDxF), PROJECTION)
    up_ExCxF = checkpoint_name(jnp.einsum("ecd,edf->ecf", x_ExCxD, up_ExDxF), PROJECTION)
    y_ExCxD = checkpoint_name(jnp.einsum("ecf,efd->ecd", gated(gate_ExCxF, up_ExCxF),
                                         down_ExFxD), PROJECTION)
    y_TxKxD = rows_at(y_ExCxD.reshape(-1, D), blocks.row_A).reshape(T, k, D)
    y_TxD = jnp.einsum("tkd,tk->td", y_TxKxD, weight_A.reshape(T, k))

    def tile(n, y_TxD):
        _, token_t, x_txD, weight_t = _tile_rows(tiles, x_TxD, weight_A, n)
        e = tiles.expert_N[n]
        y_txD = _tile_mlp(gated, x_txD, weight_t, gate_ExDxF[e], up_ExDxF[e], down_ExFxD[e])
        return y_TxD.at[token_t].add(y_txD, mode="drop")

    y_TxD = jax.lax.fori_loop(0, tiles.used, tile, y_TxD)
    return y_TxD, (blocks, tiles, x_TxD, weight_A, gate_ExDxF, up_ExDxF, down_ExFxD,
                   gate_ExCxF, up_ExCxF, y_ExCxD)


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


def _experts_bwd(gated, residuals, dy_TxD):
    blocks, tiles, x_TxD, weight_A, *weights, gate_ExCxF, up_ExCxF, y_ExCxD = residuals
    grads = _blocks_bwd(gated, blocks, tiles.k, x_TxD, weight_A, weights,
                        (gate_ExCxF, up_ExCxF, y_ExCxD), dy_TxD)
    tile = functools.partial(_tile_bwd, gated, tiles, x_TxD, weight_A, weights, dy_TxD)
    return (None, None, *jax.lax.fori_loop(0, tiles.used, tile, grads))


def _blocks_bwd(gated, blocks: Blocked, k: int, x_TxD, weight_A, weights, projections,
                dy_TxD):
    """The blocks' gradients (dx_TxD, dweight_A, dgate, dup, ddown), from their projections'
    outputs (saved or recomputed): each row's output gradient is its token's, times its
    routing weight; the overflow's assignments get none here (`_tile_bwd` sets theirs)."""
    gate_ExDxF, up_ExDxF, down_ExFxD = weights
    gate_ExCxF, up_ExCxF, y_ExCxD = projections
    (T, D), experts = x_TxD.shape, gate_ExDxF.shape[0]
    assignment_P = blocks.assignment_P
    dy_PxD = rows_at(dy_TxD, tokens_of(assignment_P, k))
    weight_P = jnp.where(assignment_P >= 0, weight_A[jnp.maximum(assignment_P, 0)], 0)
    dweight_P = jnp.sum(dy_PxD * y_ExCxD.reshape(-1, D), axis=-1)
    dweight_A = jnp.where(blocks.row_A >= 0, dweight_P[jnp.maximum(blocks.row_A, 0)], 0)
    dy_ExCxD = (weight_P[:, None] * dy_PxD).reshape(experts, -1, D)
    h_ExCxF, gated_vjp = jax.vjp(gated, gate_ExCxF, up_ExCxF)
    ddown = jnp.einsum("ecf,ecd->efd", h_ExCxF, dy_ExCxD)
    dgate_ExCxF, dup_ExCxF = gated_vjp(jnp.einsum("ecd,efd->ecf", dy_ExCxD, down_ExFxD))
    x_ExCxD = _block_rows(blocks, k, experts, x_TxD)
    dgate = jnp.einsum("ecd,ecf->edf", x_ExCxD, dgate_ExCxF)
    dup = jnp.einsum("ecd,ecf->edf", x_ExCxD, dup_ExCxF)
    dx_PxD = (jnp.einsum("ecf,edf->ecd", dgate_ExCxF, gate_ExDxF)
              + jnp.einsum("ecf,edf->ecd", dup_ExCxF, up_ExDxF)).reshape(-1, D)
    # Each token's k rows summed by a gather, not by the scatter-add a gather's own gradient is.
    dx_TxD = rows_at(dx_PxD, blocks.row_A).reshape(T, k, D).sum(axis=1)
    return dx_TxD, dweight_A, dgate, dup, ddown


def _tile_bwd(gated, tiles: Overflow, x_TxD, weight_A, weights, dy_TxD, n, grads):
    """Overflow tile n's MLP differentiated, its gradients added into `grads` (in place: the
    weights' into its expert's)."""
    dx_TxD, dweight_A, *dweights = grads
    T = x_TxD.shape[0]
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
    past_end = weight_A.shape[0]  # an unused slot's: dropped
    dweight_A = dweight_A.at[jnp.where(a_t >= 0, a_t, past_end)].set(dweight_t, mode="drop")
    return (dx_TxD, dweight_A, *(g.at[e].add(d) for g, d in zip(dweights, dw)))


_experts.defvjp(_experts_fwd, _experts_bwd)
