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


def tile_table(query_blocks: np.ndarray, block: int, window: int | None,
               key_blocks: np.ndarray | None = None) -> np.ndarray:
    """[T, 4] int32 rows (query block here, key block here, query block in the sequence, key
    block in the sequence): every tile with a visible pair, for queries held as blocks
    `query_blocks` of the sequence (all of them in order; or context parallelism's pieces,
    models/context.py) and keys held as blocks `key_blocks` (default: the whole sequence in
    order; a ring's chunk, models/context.py)."""
    rows = []
    for here, there in enumerate(query_blocks):
        in_sequence = np.arange(there + 1) if key_blocks is None else np.asarray(key_blocks)
        keys_here = np.arange(len(in_sequence)) if key_blocks is not None else in_sequence
        seen = in_sequence <= there  # causal: key block <= query block
        if window is not None:  # the key block's last key within the first query's window
            seen &= (in_sequence + 1) * block - 1 >= there * block - window + 1
        keys, keys_here = in_sequence[seen], keys_here[seen]
        rows.append(np.stack([np.full_like(keys, here), keys_here, np.full_like(keys, there),
                              keys], 1))
    return np.concatenate(rows).reshape(-1, 4).astype(np.int32)


# A tile no query sees (its queries would sit before the sequence): pads the tile tables of
# devices with fewer tiles to one length, and changes nothing.
NO_TILE = np.array([0, 0, -1, 0], np.int32)


def padded_tables(tables: list[np.ndarray]) -> np.ndarray:
    """Tile tables stacked into one [len(tables), T, 4] array, the shorter ones padded with
    `NO_TILE` (one scan's trip count for every device)."""
    longest = max(len(t) for t in tables)
    return np.stack([np.concatenate([t, np.tile(NO_TILE, (longest - len(t), 1))])
                     for t in tables])


def attention_tiles(q_BxCxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
                    q_segments_BxC: jax.Array, k_segments_BxL: jax.Array, table: jax.Array, *,
                    scale: float, window: int | None, block: int) -> jax.Array:
    """`attention` of queries held as some blocks of a sequence against all its keys and
    values, over the tiles `table` lists (`tile_table`, padded with `NO_TILE`; a traced value:
    each context-parallel device passes its own)."""
    k_BxLxNxH, v_BxLxNxH = to_query_heads(q_BxCxNxH, k_BxLxKxH, v_BxLxKxH)
    return _attention(q_BxCxNxH, k_BxLxNxH, v_BxLxNxH, q_segments_BxC.astype(jnp.int32),
                      k_segments_BxL.astype(jnp.int32), table, Tiles(block, window, float(scale)))


def to_query_heads(q_BxCxNxH, k_BxLxKxH, v_BxLxKxH) -> tuple[jax.Array, jax.Array]:
    """Keys and values repeated to the query heads: O(L) memory, and every tile then has one
    head axis, sharded like the queries' (tensor parallelism splits heads)."""
    groups = q_BxCxNxH.shape[2] // k_BxLxKxH.shape[2]
    return tuple(jnp.repeat(a, groups, axis=2) for a in (k_BxLxKxH, v_BxLxKxH))


@dataclasses.dataclass(frozen=True)  # hashable: custom_vjp takes it as a static argument
class Tiles:
    """The tiling: tokens per block, the window (None: full causal), the score scale."""
    block: int
    window: int | None
    scale: float

    def visible(self, there, key, segments_q_Bxb, segments_k_Bxb) -> jax.Array:
        """[B, 1, b, b]: may query there·b + q of the sequence see key key·b + k."""
        q_pos = there * self.block + jnp.arange(self.block)[:, None]
        k_pos = key * self.block + jnp.arange(self.block)[None, :]
        seen = k_pos <= q_pos
        if self.window is not None:
            seen &= q_pos - k_pos < self.window
        same = segments_q_Bxb[:, :, None] == segments_k_Bxb[:, None, :]
        return (seen[None] & same)[:, None]


def _rows(a: jax.Array, i, b: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(a, i * b, b, axis=axis)


def _add_rows(a: jax.Array, i, b: int, rows: jax.Array, axis: int = 1) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(a, _rows(a, i, b, axis) + rows, i * b, axis=axis)


def _scores(q_BxNxbxH, k_BxNxbxH, tiles: Tiles) -> jax.Array:
    """[B, N, b_q, b_k] fp32 scaled scores of a query tile against a key tile."""
    return _product("bnqh,bnkh->bnqk", q_BxNxbxH, k_BxNxbxH) * tiles.scale


def _product(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum in b's dtype (a cast to it: fp32 probabilities meet bf16 values), fp32 out."""
    return jnp.einsum(spec, a.astype(b.dtype), b, preferred_element_type=jnp.float32)


# Inside, heads lead ([B, N, L, H]): every tile product is then a plain batched matmul over
# (B, N), with no transpose per tile; one transpose in and out per pass.
def heads_first(a_BxLxNxH: jax.Array) -> jax.Array:
    return jnp.swapaxes(a_BxLxNxH, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_segments, k_segments, table, tiles):
    return _forward(q, k, v, q_segments, k_segments, table, tiles)[0]


LOWEST = float(jnp.finfo(jnp.float32).min)


def softmax_start(B: int, N: int, L: int, H: int) -> tuple[jax.Array, ...]:
    """The online softmax's (running max, running sum, unnormalised output) before any tile."""
    return jnp.full((B, N, L), LOWEST), jnp.zeros((B, N, L)), jnp.zeros((B, N, L, H))


def softmax_end(carry, dtype) -> tuple[jax.Array, jax.Array]:
    """(output [B, L, N, H] in `dtype`, log-sum-exp [B, N, L] fp32) from `forward_tiles`."""
    top, total, acc = carry
    return heads_first(acc / total[..., None]).astype(dtype), top + jnp.log(total)


def forward_tiles(q_BxNxLxH, k_BxNxSxH, v_BxNxSxH, q_segments_BxL, k_segments_BxS, table,
                  tiles: Tiles, carry):
    """The online softmax carried over `table`'s tiles of these (heads-first) queries, keys and
    values: one scan, a [b, b] tile of scores at a time."""
    b = tiles.block

    def tile(carry, row):
        max_BxNxL, sum_BxNxL, acc_BxNxLxH = carry
        i, j, there, key = row
        seen = tiles.visible(there, key, _rows(q_segments_BxL, i, b),
                             _rows(k_segments_BxS, j, b))
        s = jnp.where(seen, _scores(_rows(q_BxNxLxH, i, b, 2), _rows(k_BxNxSxH, j, b, 2), tiles),
                      LOWEST)
        old_max = _rows(max_BxNxL, i, b, 2)
        new_max = jnp.maximum(old_max, s.max(-1))
        p = jnp.where(seen, jnp.exp(s - new_max[..., None]), 0.0)
        rescale = jnp.exp(old_max - new_max)
        acc_i = (_rows(acc_BxNxLxH, i, b, 2) * rescale[..., None]
                 + _product("bnqk,bnkh->bnqh", p, _rows(v_BxNxSxH, j, b, 2)))
        sum_i = _rows(sum_BxNxL, i, b, 2) * rescale + p.sum(-1)
        return tuple(lax.dynamic_update_slice_in_dim(whole, part, i * b, axis=2) for whole, part
                     in ((max_BxNxL, new_max), (sum_BxNxL, sum_i), (acc_BxNxLxH, acc_i))), None

    return lax.scan(tile, carry, table)[0]


def _forward(q_BxLxNxH, k_BxSxNxH, v_BxSxNxH, q_segments_BxL, k_segments_BxS, table,
             tiles: Tiles):
    """Output [B, L, N, H] and log-sum-exp [B, N, L] (fp32), tile by tile (online softmax)."""
    q, k, v = (heads_first(a) for a in (q_BxLxNxH, k_BxSxNxH, v_BxSxNxH))
    carry = forward_tiles(q, k, v, q_segments_BxL, k_segments_BxS, table, tiles,
                          softmax_start(*q.shape))
    return softmax_end(carry, q.dtype)


def _attention_fwd(q, k, v, q_segments, k_segments, table, tiles):
    out, lse = _forward(q, k, v, q_segments, k_segments, table, tiles)
    return out, (q, k, v, q_segments, k_segments, table, out, lse)


def softmax_row_terms(d_out_BxLxNxH, out_BxLxNxH) -> jax.Array:
    """D = Σ_h dO · O per query [B, N, L]: the softmax gradient's row term."""
    return jnp.einsum("blnh,blnh->bnl", d_out_BxLxNxH.astype(jnp.float32),
                      out_BxLxNxH.astype(jnp.float32))


def backward_tiles(q_BxNxLxH, k_BxNxSxH, v_BxNxSxH, do_BxNxLxH, q_segments_BxL, k_segments_BxS,
                   table, tiles: Tiles, lse_BxNxL, delta_BxNxL, grads):
    """(dQ, dK, dV) (heads first, fp32) plus `table`'s tiles' share: each tile's probabilities
    recomputed from the saved log-sum-exp, one scan."""
    b = tiles.block

    def tile(grads, row):
        dq, dk, dv = grads
        i, j, there, key = row
        q_i, do_i, k_j, v_j = _rows(q_BxNxLxH, i, b, 2), _rows(do_BxNxLxH, i, b, 2), \
            _rows(k_BxNxSxH, j, b, 2), _rows(v_BxNxSxH, j, b, 2)
        seen = tiles.visible(there, key, _rows(q_segments_BxL, i, b),
                             _rows(k_segments_BxS, j, b))
        p = jnp.where(seen, jnp.exp(_scores(q_i, k_j, tiles)
                                    - _rows(lse_BxNxL, i, b, 2)[..., None]), 0.0)
        dp = _product("bnqh,bnkh->bnqk", do_i, v_j)
        ds = p * (dp - _rows(delta_BxNxL, i, b, 2)[..., None]) * tiles.scale
        return (_add_rows(dq, i, b, _product("bnqk,bnkh->bnqh", ds, k_j), 2),
                _add_rows(dk, j, b, _product("bnqk,bnqh->bnkh", ds, q_i), 2),
                _add_rows(dv, j, b, _product("bnqk,bnqh->bnkh", p, do_i), 2)), None

    return lax.scan(tile, grads, table)[0]


def _attention_bwd(tiles: Tiles, residuals, d_out_BxLxNxH):
    """Tile by tile, each tile's probabilities recomputed from the saved log-sum-exp; dQ, dK and
    dV accumulate a block at a time in whole fp32 arrays."""
    q, k, v, do = (heads_first(a) for a in residuals[:3] + (d_out_BxLxNxH,))
    q_segments, k_segments, table, out, lse_BxNxL = residuals[3:]
    zeros = (jnp.zeros(q.shape, jnp.float32),) + (jnp.zeros(k.shape, jnp.float32),) * 2
    dq, dk, dv = backward_tiles(q, k, v, do, q_segments, k_segments, table, tiles, lse_BxNxL,
                                softmax_row_terms(d_out_BxLxNxH, out), zeros)
    return (*(heads_first(g).astype(a.dtype) for g, a in zip((dq, dk, dv), residuals)),
            None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
