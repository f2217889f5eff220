"""A grouped matmul as Pallas kernels for GPUs (Triton), over models/moe.py's tiled layout: the
rows come in tiles of `tile` rows, each tile of one expert, an expert's tiles contiguous. Each
tile is multiplied by its expert's weight read in place, where XLA's batched matmul of `tiled`
first gathers a copy of the weight per tile, and XLA's `ragged_dot` on GPUs multiplies every row
by every expert (marin#7012).

    y[tile n]   = x[tile n] @ w[e(n)]                 one program per (tile, column block)
    dx[tile n]  = dy[tile n] @ w[e(n)]ᵀ               the same kernel on w transposed
    dw[e]       = Σ over e's tiles x[tile]ᵀ @ dy[tile] one program per (expert, row block,
                                                      column block), walking e's tiles

No atomics: each dw block is one program's. On a backend without Triton (CPU) the kernels run
through Pallas's interpreter: exact, slow, and what the tests check them with (tests/test_moe.py
against `jax.lax.ragged_dot` and the dense computation, values and gradients; and that they
lower to Triton). On an H100 (2026-11-27, docs/performance.md) a train step gave the same losses
and gradient norms as `tiles` and `ragged_dot`; forward, Qwen3-30B-A3B's experts on 16,384
tokens ran at 0.38x the speed of a dense matmul of the same FLOPs, `tiles` at 0.25x.

Also here: tokamax's grouped matmul (`tokamax_ragged_dot`), the maintained library's kernels.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tunix_train import backend

# Triton blocks (powers of two): output columns per program, at most COLUMNS (fewer for tall
# tiles, so a program's fp32 accumulator stays within ACCUMULATOR elements), and the contraction
# walked in chunks of at most CHUNK, so that a weight's rows or an expert's tiles are read a
# block at a time whatever the width (Triton loads only power-of-two shapes).
COLUMNS, CHUNK, ACCUMULATOR = 128, 64, 16384
STAGES = 3  # Triton's software pipelining of the contraction's loop
# Rows per tile at most (models/moe_rows.py `tiled`): on an H100, Qwen3-30B-A3B's experts (16,384
# tokens) ran forward at 0.38x a dense matmul's speed in tiles of 64 rows, 0.36x of 128 and
# 0.18x of 256 (docs/performance.md).
TILE_ROWS = 64


def columns(width: int, rows: int = 1, most: int = COLUMNS) -> int:
    """The largest power of two that divides `width`, at most `most` and at most
    ACCUMULATOR / rows."""
    return max(1, min(most, ACCUMULATOR // rows, width & -width))


def grouped_matmul(x_PxD: jax.Array, w_ExDxF: jax.Array, expert_N: jax.Array,
                   first_tile_E: jax.Array, tiles_E: jax.Array, tile: int,
                   interpret: bool | None = None) -> jax.Array:
    """[P, F]: each tile of `tile` rows of x times its expert's weight (`expert_N`: each tile's
    expert; expert e's tiles are `tiles_E[e]` from `first_tile_E[e]`, which the backward pass
    walks). `interpret`: Pallas's interpreter (None: everywhere but on GPUs)."""
    if interpret is None:
        interpret = not backend.is_gpu()
    return _grouped(x_PxD, w_ExDxF.astype(x_PxD.dtype), expert_N, first_tile_E, tiles_E, tile,
                    bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _grouped(x, w, expert_N, first_tile_E, tiles_E, tile: int, interpret: bool):
    return _tiles_times_weights(x, w, expert_N, tile, interpret)


def _grouped_fwd(x, w, expert_N, first_tile_E, tiles_E, tile, interpret):
    y = _tiles_times_weights(x, w, expert_N, tile, interpret)
    return y, (x, w, expert_N, first_tile_E, tiles_E)


def _grouped_bwd(tile, interpret, residuals, dy):
    x, w, expert_N, first_tile_E, tiles_E = residuals
    dx = _tiles_times_weights(dy, w, expert_N, tile, interpret, transposed=True)
    dw = _weight_gradient(x, dy, first_tile_E, tiles_E, w.shape[0], tile, interpret)
    return dx, dw.astype(w.dtype), None, None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _tiles_times_weights(x_PxK, w_ExDxF, expert_N, tile: int, interpret: bool,
                         transposed: bool = False):
    """[P, N]: tile n of x times w[e(n)] ([K, N] = [D, F]), or times w[e(n)]ᵀ (`transposed`:
    [K, N] = [F, D], the weight read as it lies)."""
    (P, K), (E, D, F) = x_PxK.shape, w_ExDxF.shape
    N = D if transposed else F
    n, k = columns(N, tile), columns(K, most=CHUNK)

    def kernel(expert_ref, x_ref, w_ref, y_ref):
        def step(i, acc):
            chunk = pl.ds(i * k, k)
            if transposed:  # w's block [E, n, K]: rows of wᵀ's columns
                return acc + _dot(x_ref[:, chunk], w_ref[expert_ref[0], :, chunk], trans_b=True)
            return acc + _dot(x_ref[:, chunk], w_ref[expert_ref[0], chunk, :])

        acc = lax.fori_loop(0, K // k, step, jnp.zeros((tile, n), jnp.float32))
        y_ref[...] = acc.astype(y_ref.dtype)

    weight = (pl.BlockSpec((E, n, F), lambda t, j: (0, j, 0)) if transposed
              else pl.BlockSpec((E, D, n), lambda t, j: (0, 0, j)))
    return _call(kernel, "grouped_matmul", (P // tile, N // n), tile * n, interpret,
                 in_specs=[pl.BlockSpec((1,), lambda t, j: (t,)),
                           pl.BlockSpec((tile, K), lambda t, j: (t, 0)), weight],
                 out_specs=pl.BlockSpec((tile, n), lambda t, j: (t, j)),
                 out_shape=jax.ShapeDtypeStruct((P, N), x_PxK.dtype),
                 )(expert_N, x_PxK, w_ExDxF)


def _weight_gradient(x_PxD, dy_PxF, first_tile_E, tiles_E, experts: int, tile: int,
                     interpret: bool):
    """[E, D, F] fp32: each expert's Σ over its tiles of x_tileᵀ @ dy_tile, walked in chunks of
    rows."""
    (P, D), F = x_PxD.shape, dy_PxF.shape[1]
    d, f, r = columns(D), columns(F), min(tile, CHUNK)

    def kernel(first_ref, count_ref, x_ref, dy_ref, dw_ref):
        def step(t, acc):
            rows = pl.ds(first_ref[0] * tile + t * r, r)
            return acc + _dot(x_ref[rows, :], dy_ref[rows, :], trans_a=True)

        chunks = count_ref[0] * (tile // r)
        dw_ref[0] = lax.fori_loop(0, chunks, step, jnp.zeros((d, f), jnp.float32))

    return _call(kernel, "grouped_matmul_weight_gradient", (experts, D // d, F // f), d * f,
                 interpret,
                 in_specs=[pl.BlockSpec((1,), lambda e, i, j: (e,)),
                           pl.BlockSpec((1,), lambda e, i, j: (e,)),
                           pl.BlockSpec((P, d), lambda e, i, j: (0, i)),
                           pl.BlockSpec((P, f), lambda e, i, j: (0, j))],
                 out_specs=pl.BlockSpec((1, d, f), lambda e, i, j: (e, i, j)),
                 out_shape=jax.ShapeDtypeStruct((experts, D, F), jnp.float32),
                 )(first_tile_E, tiles_E, x_PxD, dy_PxF)


def _call(kernel, name: str, grid, accumulator: int, interpret: bool, **specs):
    """pallas_call for Triton: 8 warps for the largest accumulators, else 4; the contraction's
    loop pipelined over STAGES stages."""
    params = plgpu.CompilerParams(num_warps=8 if accumulator >= 16384 else 4, num_stages=STAGES)
    return pl.pallas_call(kernel, grid=grid, interpret=interpret, name=name,
                          compiler_params=params, **specs)


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """a @ b of two tiles (either transposed), summed in fp32."""
    contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def tokamax_ragged_dot(lhs: jax.Array, rhs: jax.Array, sizes_E: jax.Array) -> jax.Array:
    """tokamax's `ragged_dot` (an optional dependency, the `cuda` extras'): its Pallas kernels,
    forward and backward, where they run (Triton and Mosaic GPU on NVIDIA GPUs), else XLA's
    `ragged_dot`, which it falls back to on a CPU. tokamax reads its settings as absl flags,
    parsing the command line the first time (ours is Hydra's, which absl refuses): they are
    parsed from no arguments first, so take their defaults."""
    import tokamax
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1])
    return tokamax.ragged_dot(lhs, rhs, sizes_E)
