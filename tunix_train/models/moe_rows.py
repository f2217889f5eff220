"""Where a mixture's (token, expert) assignments sit as the experts' rows, and how those rows
are multiplied by their experts' weights (`Rows`): each expert's rows padded to tiles
(`tiled`), capped at a capacity in blocks of their own (`capped`), or sorted for one ragged
matmul (`ragged`); and `take`, the gather that moves tokens to rows and back. Each names its
plan (`planned`, `Rows.at`), which `training.remat=save_dots` keeps for the backward pass.
models/moe.py picks among them (`MATMULS`) and runs the experts' MLP on the rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tunix_train.models.layers import ROUTING_PLAN

# models/grouped_matmul.py (Pallas kernels) is imported where it is used: importing Pallas and
# its Triton dialect takes 0.2 s of every start, CPU runs included.


@dataclass(frozen=True)
class Rows:
    """Where a layer's assignments sit as the experts' rows (P of them, padding included):
    row p holds token `token_P[p]` (-1: padding, zero), assignment a (token-major) sits at row
    `row_A[a]` (-1: dropped), and `matmul` multiplies rows by their experts' weights."""

    token_P: jax.Array
    row_A: jax.Array
    matmul: Callable[[jax.Array, jax.Array], jax.Array]  # [P, D] x [E, D, F] → [P, F]

    @classmethod
    def at(cls, row_A: jax.Array, k: int, count: int,
           matmul: Callable[[jax.Array, jax.Array], jax.Array]) -> Rows:
        """`count` rows, assignment a at row `row_A[a]`: where each row's token is, and both
        `planned` (the backward pass keeps them rather than sorting again)."""
        row_A = planned(row_A)
        return cls(planned(rows_from(row_A, k, count)), row_A, matmul)

    def from_tokens(self, x_TxD: jax.Array) -> jax.Array:
        """The rows [P, D] of the tokens [T, D] (padding and dropped: none)."""
        T = x_TxD.shape[0]
        return take(x_TxD, self.token_P, self.row_A.reshape(T, -1))

    def to_tokens(self, y_PxD: jax.Array, tokens: int) -> jax.Array:
        """Each token's k rows [T, k, D] (a dropped one: zeros)."""
        used_P = assignments_at(self.row_A, y_PxD.shape[0])
        return take(y_PxD, self.row_A, used_P[:, None]).reshape(tokens, -1, y_PxD.shape[-1])


def planned(plan):
    """A routing plan's arrays (integers: where each row goes, its sort's and scatters' result)
    named `ROUTING_PLAN`, so that `training.remat=save_dots` keeps them for the backward pass
    rather than sorting again there; a few integers a row."""
    return jax.tree.map(lambda a: checkpoint_name(a, ROUTING_PLAN), plan)


def sorted_by_expert(expert_of_A: jax.Array, experts: int):
    """The assignments grouped by expert (stable: token order within each): per expert its
    count and where its group starts, and each assignment's rank in its group. An assignment
    to no expert (-1: a padding row, `exchanged`) counts in no group and sorts last."""
    expert_of_A = jnp.where(expert_of_A >= 0, expert_of_A, experts)
    sizes_E = jnp.bincount(expert_of_A, length=experts).astype(jnp.int32)
    start_E = jnp.cumsum(sizes_E) - sizes_E
    order = jnp.argsort(expert_of_A, stable=True)
    rank_A = jnp.zeros_like(expert_of_A).at[order].set(
        jnp.arange(expert_of_A.shape[0], dtype=expert_of_A.dtype)) - start_E[expert_of_A]
    return sizes_E, start_E, rank_A


def none_for_padding(row_A: jax.Array, expert_of_A: jax.Array) -> jax.Array:
    """row_A with -1 (no row) for the padding rows' assignments (expert -1)."""
    return jnp.where(expert_of_A >= 0, row_A, -1).astype(jnp.int32)


def rows_from(row_A: jax.Array, k: int, count: int) -> jax.Array:
    """token_P from row_A: which token each of `count` rows holds (-1: none)."""
    return tokens_of(assignments_at(row_A, count), k)


def assignments_at(row_A: jax.Array, count: int) -> jax.Array:
    """Which assignment each of `count` rows holds (-1: none), from where each sits (row_A)."""
    return jnp.full(count, -1, jnp.int32).at[dropped_out(row_A, count)].set(
        jnp.arange(row_A.shape[0], dtype=jnp.int32), mode="drop")


def tokens_of(assignment_P: jax.Array, k: int) -> jax.Array:
    """Each row's token, from its assignment (token-major, k a token; -1: none)."""
    return jnp.where(assignment_P >= 0, assignment_P // k, -1)


def dropped_out(row_A: jax.Array, count: int) -> jax.Array:
    """row_A with its -1s (dropped) past the end, where a scatter with mode="drop" ignores them
    (at -1 it would write the last row)."""
    return jnp.where(row_A >= 0, row_A, count)


@jax.custom_vjp
def take(x_NxD: jax.Array, index_M: jax.Array, uses_NxR: jax.Array) -> jax.Array:
    """Rows x[index] (index -1: a zero row), where `uses` lists for each row of x the positions
    of `index` that take it (-1: none; every position of index appears there once): the
    backward pass sums each row's uses by a gather, not by the scatter-add JAX's own gradient
    of a gather is (serial on XLA's CPU compiler)."""
    return rows_at(x_NxD, index_M)


def rows_at(x_NxD: jax.Array, index_M: jax.Array) -> jax.Array:
    """x[index] (index -1: a zero row), by a gather: its gradient is a scatter-add (`take`'s
    is not)."""
    return jnp.where((index_M >= 0)[:, None], x_NxD[jnp.maximum(index_M, 0)],
                     jnp.zeros((), x_NxD.dtype))


def _take_fwd(x_NxD, index_M, uses_NxR):
    return rows_at(x_NxD, index_M), (index_M, uses_NxR)


def _take_bwd(residuals, dy_MxD):
    _, uses_NxR = residuals
    n, r = uses_NxR.shape
    dx = rows_at(dy_MxD, uses_NxR.reshape(n * r)).reshape(n, r, -1).sum(axis=1)
    return dx, None, None


take.defvjp(_take_fwd, _take_bwd)


def tile_rows(rows: int, experts: int) -> int:
    """Rows per tile of `tiled`: the power of two nearest below half an expert's mean share
    (8 to 256), so padding adds at most about half the rows again, for weights gathered about
    three times an expert layer's (a quarter of the share measured no faster on CPU, for more
    gathered weights)."""
    half_mean = max(rows / experts / 2, 1)
    return min(256, max(8, 1 << int(math.log2(half_mean))))


def tiled(expert_of_A: jax.Array, k: int, experts: int, kernel: bool = False) -> Rows:
    """Each expert's rows padded to whole tiles of `tile_rows` rows, every tile multiplied by
    its own expert's weight in one batched matmul (with `kernel`, by models/grouped_matmul.py's
    Pallas kernels, which read each expert's weight in place; tiles of 16 to its TILE_ROWS
    rows). The shapes are static: A rows fill at most (A + E·(tile - 1)) / tile
    tiles. Work and memory follow the rows, about 1.5x those of the k experts a token goes to,
    where `jax.lax.ragged_dot` on XLA's CPU (and GPU) compiler multiplies every row by every
    expert (E times the work)."""
    A = expert_of_A.shape[0]
    tile = tile_rows(A, experts)
    if kernel:
        from tunix_train.models import grouped_matmul  # only where used: see the imports

        tile = min(max(tile, 16), grouped_matmul.TILE_ROWS)
    n_tiles = -(-(A + experts * (tile - 1)) // tile)
    sizes_E, _, rank_A = sorted_by_expert(expert_of_A, experts)
    tiles_E = (sizes_E + tile - 1) // tile
    first_tile_E = jnp.cumsum(tiles_E) - tiles_E
    row_A = none_for_padding(first_tile_E[expert_of_A] * tile + rank_A, expert_of_A)
    # Tile n's expert: how many experts' tiles end at or before it (unused tiles: the last).
    expert_N = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles_E), jnp.arange(n_tiles),
                                            side="right"), experts - 1)
    expert_N, first_tile_E, tiles_E = planned((expert_N, first_tile_E, tiles_E))

    def matmul(lhs_PxD: jax.Array, rhs_ExDxF: jax.Array) -> jax.Array:
        if kernel:
            return grouped_matmul.grouped_matmul(lhs_PxD, rhs_ExDxF, expert_N, first_tile_E,
                                                 tiles_E, tile)
        y_NxtxF = jnp.einsum("ntd,ndf->ntf", lhs_PxD.reshape(n_tiles, tile, -1),
                             rhs_ExDxF[expert_N])
        return y_NxtxF.reshape(n_tiles * tile, -1)

    return Rows.at(row_A, k, n_tiles * tile, matmul)


def capacity(rows: int, experts: int, factor: float) -> int:
    """Rows an expert takes with a capacity factor: factor × its mean share, rounded up."""
    return max(1, math.ceil(factor * rows / experts))


def capped(expert_of_A: jax.Array, k: int, experts: int, per_expert: int) -> Rows:
    """Each expert's first `per_expert` rows in a block of its own, [E, C, D] × [E, D, F] in
    one batched matmul; the rows past an expert's capacity are dropped."""
    _, _, rank_A = sorted_by_expert(expert_of_A, experts)
    row_A = none_for_padding(
        jnp.where(rank_A < per_expert, expert_of_A * per_expert + rank_A, -1), expert_of_A)

    def matmul(lhs_PxD: jax.Array, rhs_ExDxF: jax.Array) -> jax.Array:
        y_ExCxF = jnp.einsum("ecd,edf->ecf", lhs_PxD.reshape(experts, per_expert, -1),
                             rhs_ExDxF)
        return y_ExCxF.reshape(experts * per_expert, -1)

    return Rows.at(row_A, k, experts * per_expert, matmul)


def ragged(expert_of_A: jax.Array, k: int, experts: int,
           dot: Callable[..., jax.Array] = jax.lax.ragged_dot) -> Rows:
    """The assignments sorted by expert, `jax.lax.ragged_dot` (or another function of its
    signature, `dot`) multiplying them: one grouped matmul, as fast as its lowering."""
    sizes_E, start_E, rank_A = sorted_by_expert(expert_of_A, experts)
    row_A = none_for_padding(start_E[expert_of_A] + rank_A, expert_of_A)
    sizes_E = planned(sizes_E)
    matmul = lambda lhs, rhs: dot(lhs, rhs, sizes_E)  # noqa: E731
    return Rows.at(row_A, k, expert_of_A.shape[0], matmul)
