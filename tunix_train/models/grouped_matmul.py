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
against `jax.lax.ragged_dot` and the dense computation, values and gradients). Not yet run on a
GPU (bench/gpu_check.sh runs it there).

Also here: tokamax's grouped matmul (`tokamax_ragged_dot`), the maintained library's kernels.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tunix_train import backend

COLUMNS = 128  # output columns per program (a power of two dividing the width, at most this)


def columns(width: int) -> int:
    """The largest power of two that divides `width`, at most COLUMNS."""
    return min(COLUMNS, width & -width)


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
    dx = _tiles_times_weights(dy, jnp.swapaxes(w, 1, 2), expert_N, tile, interpret)
    dw = _weight_gradient(x, dy, first_tile_E, tiles_E, w.shape[0], tile, interpret)
    return dx, dw.astype(w.dtype), None, None, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _tiles_times_weights(x_PxD, w_ExDxF, expert_N, tile: int, interpret: bool):
    (P, D), (E, _, F) = x_PxD.shape, w_ExDxF.shape
    f = columns(F)

    def kernel(expert_ref, x_ref, w_ref, y_ref):
        y_ref[...] = _dot(x_ref[...], w_ref[expert_ref[0]]).astype(y_ref.dtype)

    return pl.pallas_call(
        kernel, grid=(P // tile, F // f), interpret=interpret, name="grouped_matmul",
        in_specs=[pl.BlockSpec((1,), lambda n, j: (n,)),
                  pl.BlockSpec((tile, D), lambda n, j: (n, 0)),
                  pl.BlockSpec((E, D, f), lambda n, j: (0, 0, j))],
        out_specs=pl.BlockSpec((tile, f), lambda n, j: (n, j)),
        out_shape=jax.ShapeDtypeStruct((P, F), x_PxD.dtype),
    )(expert_N, x_PxD, w_ExDxF)


def _weight_gradient(x_PxD, dy_PxF, first_tile_E, tiles_E, experts: int, tile: int,
                     interpret: bool):
    """[E, D, F] fp32: each expert's Σ over its tiles of x_tileᵀ @ dy_tile."""
    (P, D), F = x_PxD.shape, dy_PxF.shape[1]
    d, f = columns(D), columns(F)

    def kernel(first_ref, count_ref, x_ref, dy_ref, dw_ref):
        def step(t, acc):
            rows = pl.ds((first_ref[0] + t) * tile, tile)
            return acc + _dot(x_ref[rows, :], dy_ref[rows, :], trans_a=True)

        dw_ref[0] = lax.fori_loop(0, count_ref[0], step, jnp.zeros((d, f), jnp.float32))

    return pl.pallas_call(
        kernel, grid=(experts, D // d, F // f), interpret=interpret,
        name="grouped_matmul_weight_gradient",
        in_specs=[pl.BlockSpec((1,), lambda e, i, j: (e,)),
                  pl.BlockSpec((1,), lambda e, i, j: (e,)),
                  pl.BlockSpec((P, d), lambda e, i, j: (0, i)),
                  pl.BlockSpec((P, f), lambda e, i, j: (0, j))],
        out_specs=pl.BlockSpec((1, d, f), lambda e, i, j: (e, i, j)),
        out_shape=jax.ShapeDtypeStruct((experts, D, F), jnp.float32),
    )(first_tile_E, tiles_E, x_PxD, dy_PxF)


def _dot(a, b, trans_a: bool = False):
    """a @ b of two tiles (a transposed if asked), summed in fp32."""
    contract = ((0 if trans_a else 1,), (0,))
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
