"""Causal attention a block of queries at a time, against only the key blocks it can see.

FlashAttention-2's algorithm (Dao, 2023) written in XLA operations, so that it runs on every
backend: the forward pass keeps a running maximum and sum per query (online softmax) and saves
only the output and each query's log-sum-exp; the backward pass recomputes each block's
probabilities from them. What it buys over `jax.nn.dot_product_attention(implementation="xla")`:
- memory linear in the sequence length: scores exist one [block, block] tile at a time, never
  as [B, N, L, L] (nor a [B, N, L, L] mask or bias for packed documents: those come from the
  segment ids of the tile's queries and keys);
- a sliding window costs O(L · window), not O(L²): a query block visits only the key blocks its
  window reaches (a causal one only those up to its own).

Both passes are one `lax.scan` over the static list of visible (query block, key block) tiles,
so every loop has a known trip count (the planner's FLOP count is the work done). The running
max, sum and output (forward) and dQ, dK, dV (backward) are whole [.., L, ..] fp32 arrays
updated a block at a time: linear memory, and no tile order to keep.

Shapes: B batch, L sequence, N heads (keys and values already repeated to the query heads),
H head dim; b tokens per block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

def block_size(length: int) -> int:
    """Tokens per query and key block: a quarter of the sequence, a power of two in [64, 512].
    Measured on CPU (docs/performance.md): smaller blocks pay per-iteration overhead, larger
    ones compute more of the masked-out corner of each diagonal tile."""
    quarter = max(length // 4, 1)
    return min(512, max(64, 1 << (quarter.bit_length() - 1)))


def attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
              segment_ids_BxL: jax.Array | None, *, scale: float, window: int | None,
              block: int | None = None) -> jax.Array:
    """Causal (grouped-query) attention, keys limited to the last `window` positions if given
    and to the query's own segment if `segment_ids_BxL` is given; the same result as
    `jax.nn.dot_product_attention(..., is_causal=True, local_window_size=(window - 1, 0))` with
    the mask segment_q == segment_k."""
    B, L = q_BxLxNxH.shape[:2]
    if segment_ids_BxL is None:
        segment_ids_BxL = jnp.zeros((B, L), jnp.int32)
    b = min(block or block_size(L), L)
    padded = -L % b  # padding keys come after every real query: causality hides them
    if padded:
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = (
            jnp.pad(a, ((0, 0), (0, padded), (0, 0), (0, 0)))
            for a in (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH))
        segment_ids_BxL = jnp.pad(segment_ids_BxL, ((0, 0), (0, padded)), constant_values=-1)
    table = jnp.asarray(tile_table(np.arange((L + padded) // b), b, window))
    return attention_tiles(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, segment_ids_BxL,
                           table, scale=scale, window=window, block=b)[:, :L]


def tile_table(query_blocks: np.ndarray, block: int, window: int | None) -> np.ndarray:
    """[T, 3] int32 rows (query block here, key block, query block in the sequence): every
    tile with a visible pair, for queries held as blocks `query_blocks` of the sequence (all of
    them in order; or context parallelism's pieces, models/context.py)."""
    rows = []
    for here, there in enumerate(query_blocks):
        keys = np.arange(there + 1)  # causal: key block <= query block
        if window is not None:  # the key block's last key within the first query's window
            keys = keys[(keys + 1) * block - 1 >= there * block - window + 1]
        rows.append(np.stack([np.full_like(keys, here), keys, np.full_like(keys, there)], 1))
    return np.concatenate(rows).astype(np.int32)


# A tile no query sees (its queries would sit before the sequence): pads the tile tables of
# devices with fewer tiles to one length, and changes nothing.
NO_TILE = np.array([0, 0, -1], np.int32)


def attention_tiles(q_BxCxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
                    q_segments_BxC: jax.Array, k_segments_BxL: jax.Array, table: jax.Array, *,
                    scale: float, window: int | None, block: int) -> jax.Array:
    """`attention` of queries held as some blocks of a sequence against all its keys and
    values, over the tiles `table` lists (`tile_table`, padded with `NO_TILE`; a traced value:
    each context-parallel device passes its own)."""
    groups = q_BxCxNxH.shape[2] // k_BxLxKxH.shape[2]
    # Keys and values repeated to the query heads: O(L) memory, and every tile then has one
    # head axis, sharded like the queries' (tensor parallelism splits heads).
    k_BxLxNxH, v_BxLxNxH = (jnp.repeat(a, groups, axis=2) for a in (k_BxLxKxH, v_BxLxKxH))
    return _attention(q_BxCxNxH, k_BxLxNxH, v_BxLxNxH, q_segments_BxC.astype(jnp.int32),
                      k_segments_BxL.astype(jnp.int32), table, _Tiles(block, window, float(scale)))


@dataclasses.dataclass(frozen=True)  # hashable: custom_vjp takes it as a static argument
class _Tiles:
    """The tiling: tokens per block, the window (None: full causal), the score scale."""
    block: int
    window: int | None
    scale: float

    def visible(self, there, j, segments_q_Bxb, segments_k_Bxb) -> jax.Array:
        """[B, 1, b, b]: may query there·b + q of the sequence see key j·b + k."""
        q_pos = there * self.block + jnp.arange(self.block)[:, None]
        k_pos = j * self.block + jnp.arange(self.block)[None, :]
        seen = k_pos <= q_pos
        if self.window is not None:
            seen &= q_pos - k_pos < self.window
        same = segments_q_Bxb[:, :, None] == segments_k_Bxb[:, None, :]
        return (seen[None] & same)[:, None]


def _rows(a: jax.Array, i, b: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(a, i * b, b, axis=axis)


def _add_rows(a: jax.Array, i, b: int, rows: jax.Array, axis: int = 1) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(a, _rows(a, i, b, axis) + rows, i * b, axis=axis)


def _scores(q_BxNxbxH, k_BxNxbxH, tiles: _Tiles) -> jax.Array:
    """[B, N, b_q, b_k] fp32 scaled scores of a query tile against a key tile."""
    return _product("bnqh,bnkh->bnqk", q_BxNxbxH, k_BxNxbxH) * tiles.scale


def _product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum in b's dtype (a cast to it: fp32 probabilities meet bf16 values), fp32 out."""
    return jnp.einsum(spec, a.astype(b.dtype), b, preferred_element_type=jnp.float32)


# Inside, heads lead ([B, N, L, H]): every tile product is then a plain batched matmul over
# (B, N), with no transpose per tile; one transpose in and out per pass.
def _heads_first(a_BxLxNxH: jax.Array) -> jax.Array:
    return jnp.swapaxes(a_BxLxNxH, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_segments, k_segments, table, tiles):
    return _forward(q, k, v, q_segments, k_segments, table, tiles)[0]


def _forward(q_BxLxNxH, k_BxSxNxH, v_BxSxNxH, q_segments_BxL, k_segments_BxS, table,
             tiles: _Tiles):
    """Output [B, L, N, H] and log-sum-exp [B, N, L] (fp32), tile by tile (online softmax)."""
    b = tiles.block
    q, k, v = (_heads_first(a) for a in (q_BxLxNxH, k_BxSxNxH, v_BxSxNxH))
    lowest = jnp.finfo(jnp.float32).min

    def tile(carry, row):
        max_BxNxL, sum_BxNxL, acc_BxNxLxH = carry
        i, j, there = row
        seen = tiles.visible(there, j, _rows(q_segments_BxL, i, b), _rows(k_segments_BxS, j, b))
        s = jnp.where(seen, _scores(_rows(q, i, b, 2), _rows(k, j, b, 2), tiles), lowest)
        old_max = _rows(max_BxNxL, i, b, 2)
        new_max = jnp.maximum(old_max, s.max(-1))
        p = jnp.where(seen, jnp.exp(s - new_max[..., None]), 0.0)
        rescale = jnp.exp(old_max - new_max)
        acc_i = (_rows(acc_BxNxLxH, i, b, 2) * rescale[..., None]
                 + _product("bnqk,bnkh->bnqh", p, _rows(v, j, b, 2)))
        sum_i = _rows(sum_BxNxL, i, b, 2) * rescale + p.sum(-1)
        return tuple(lax.dynamic_update_slice_in_dim(whole, part, i * b, axis=2) for whole, part
                     in ((max_BxNxL, new_max), (sum_BxNxL, sum_i), (acc_BxNxLxH, acc_i))), None

    B, N, L, H = q.shape
    init = (jnp.full((B, N, L), lowest), jnp.zeros((B, N, L)), jnp.zeros((B, N, L, H)))
    (top, total, acc), _ = lax.scan(tile, init, table)
    out_BxNxLxH = acc / total[..., None]
    return _heads_first(out_BxNxLxH).astype(q.dtype), top + jnp.log(total)


def _attention_fwd(q, k, v, q_segments, k_segments, table, tiles):
    out, lse = _forward(q, k, v, q_segments, k_segments, table, tiles)
    return out, (q, k, v, q_segments, k_segments, table, out, lse)


def _attention_bwd(tiles: _Tiles, residuals, d_out_BxLxNxH):
    """Tile by tile, each tile's probabilities recomputed from the saved log-sum-exp; dQ, dK and
    dV accumulate a block at a time in whole fp32 arrays."""
    q, k, v, do = (_heads_first(a) for a in residuals[:3] + (d_out_BxLxNxH,))
    q_segments, k_segments, table, out, lse_BxNxL = residuals[3:]
    b = tiles.block
    # D = Σ_h dO · O per query: the softmax gradient's row term
    delta_BxNxL = jnp.einsum("blnh,blnh->bnl", d_out_BxLxNxH.astype(jnp.float32),
                             out.astype(jnp.float32))

    def tile(grads, row):
        dq, dk, dv = grads
        i, j, there = row
        q_i, do_i, k_j, v_j = _rows(q, i, b, 2), _rows(do, i, b, 2), _rows(k, j, b, 2), \
            _rows(v, j, b, 2)
        seen = tiles.visible(there, j, _rows(q_segments, i, b), _rows(k_segments, j, b))
        p = jnp.where(seen, jnp.exp(_scores(q_i, k_j, tiles)
                                    - _rows(lse_BxNxL, i, b, 2)[..., None]), 0.0)
        dp = _product("bnqh,bnkh->bnqk", do_i, v_j)
        ds = p * (dp - _rows(delta_BxNxL, i, b, 2)[..., None]) * tiles.scale
        return (_add_rows(dq, i, b, _product("bnqk,bnkh->bnqh", ds, k_j), 2),
                _add_rows(dk, j, b, _product("bnqk,bnqh->bnkh", ds, q_i), 2),
                _add_rows(dv, j, b, _product("bnqk,bnqh->bnkh", p, do_i), 2)), None

    zeros = (jnp.zeros(q.shape, jnp.float32),) + (jnp.zeros(k.shape, jnp.float32),) * 2
    (dq, dk, dv), _ = lax.scan(tile, zeros, table)
    return (*(_heads_first(g).astype(a.dtype) for g, a in zip((dq, dk, dv), residuals)),
            None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
