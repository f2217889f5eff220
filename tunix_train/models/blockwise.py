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

Shapes: B batch, L sequence, N heads (keys and values already repeated to the query heads),
H head dim; b tokens per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
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
    B, L, N, _ = q_BxLxNxH.shape
    groups = N // k_BxLxKxH.shape[2]
    # Keys and values repeated to the query heads: O(L) memory, and every tile then has one
    # head axis, sharded like the queries' (tensor parallelism splits heads).
    k_BxLxNxH = jnp.repeat(k_BxLxKxH, groups, axis=2)
    v_BxLxNxH = jnp.repeat(v_BxLxKxH, groups, axis=2)
    if segment_ids_BxL is None:
        segment_ids_BxL = jnp.zeros((B, L), jnp.int32)
    b = min(block or block_size(L), L)
    padded = -L % b  # padding keys come after every real query: causality hides them
    if padded:
        q_BxLxNxH, k_BxLxNxH, v_BxLxNxH = (
            jnp.pad(a, ((0, 0), (0, padded), (0, 0), (0, 0)))
            for a in (q_BxLxNxH, k_BxLxNxH, v_BxLxNxH))
        segment_ids_BxL = jnp.pad(segment_ids_BxL, ((0, 0), (0, padded)), constant_values=-1)
    out = _attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH, segment_ids_BxL.astype(jnp.int32),
                     _Tiles(b, window, float(scale)))
    return out[:, :L]


class _Tiles:
    """Static description of the tiling: block size, window, scale (hashable for custom_vjp)."""

    def __init__(self, block: int, window: int | None, scale: float):
        self.block, self.window, self.scale = block, window, scale

    def _key(self):
        return self.block, self.window, self.scale

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, _Tiles) and self._key() == other._key()

    def key_blocks(self, i):
        """[first, last + 1) of the key blocks that query block i can see."""
        if self.window is None:
            return 0, i + 1
        return jnp.maximum(i * self.block - self.window + 1, 0) // self.block, i + 1

    def query_blocks(self, j, count: int):
        """[first, last + 1) of the query blocks that can see key block j."""
        if self.window is None:
            return j, count
        last = (j * self.block + self.block - 1 + self.window - 1) // self.block
        return j, jnp.minimum(last, count - 1) + 1

    def visible(self, i, j, segments_q_Bxb, segments_k_Bxb) -> jax.Array:
        """[B, 1, b, b]: may query i·b + q see key j·b + k."""
        q_pos = i * self.block + jnp.arange(self.block)[:, None]
        k_pos = j * self.block + jnp.arange(self.block)[None, :]
        seen = k_pos <= q_pos
        if self.window is not None:
            seen &= q_pos - k_pos < self.window
        same = segments_q_Bxb[:, :, None] == segments_k_Bxb[:, None, :]
        return (seen[None] & same)[:, None]


def _rows(a: jax.Array, i, b: int, axis: int = 1) -> jax.Array:
    return lax.dynamic_slice_in_dim(a, i * b, b, axis=axis)


def _scores(q_Bxbx, k_Bxbx, tiles: _Tiles) -> jax.Array:
    """[B, N, b_q, b_k] fp32 scaled scores of a query tile against a key tile."""
    return jnp.einsum("bqnh,bknh->bnqk", q_Bxbx, k_Bxbx,
                      preferred_element_type=jnp.float32) * tiles.scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, tiles):
    return _forward(q, k, v, segments, tiles)[0]


def _forward(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH, segments_BxL, tiles: _Tiles):
    """Output [B, L, N, H] and log-sum-exp [B, N, L] (fp32) a query block at a time."""
    b = tiles.block
    B, L, N, H = q_BxLxNxH.shape
    lowest = jnp.finfo(jnp.float32).min

    def query_block(_, i):
        q_i, seg_i = _rows(q_BxLxNxH, i, b), _rows(segments_BxL, i, b)

        def key_block(j, carry):
            max_BxNxb, sum_BxNxb, acc_BxNxbxH = carry
            seen = tiles.visible(i, j, seg_i, _rows(segments_BxL, j, b))
            s = jnp.where(seen, _scores(q_i, _rows(k_BxLxNxH, j, b), tiles), lowest)
            new_max = jnp.maximum(max_BxNxb, s.max(-1))
            p = jnp.where(seen, jnp.exp(s - new_max[..., None]), 0.0)
            rescale = jnp.exp(max_BxNxb - new_max)
            pv = jnp.einsum("bnqk,bknh->bnqh", p.astype(v_BxLxNxH.dtype),
                            _rows(v_BxLxNxH, j, b), preferred_element_type=jnp.float32)
            return (new_max, sum_BxNxb * rescale + p.sum(-1),
                    acc_BxNxbxH * rescale[..., None] + pv)

        init = (jnp.full((B, N, b), lowest), jnp.zeros((B, N, b)), jnp.zeros((B, N, b, H)))
        first, stop = tiles.key_blocks(i)
        top, total, acc = lax.fori_loop(first, stop, key_block, init)
        out_bxNxH = jnp.swapaxes(acc / total[..., None], 1, 2).astype(q_BxLxNxH.dtype)
        return None, (out_bxNxH, top + jnp.log(total))

    _, (out, lse) = lax.scan(query_block, None, jnp.arange(L // b))
    # [blocks, B, b, N, H] → [B, L, N, H];  [blocks, B, N, b] → [B, N, L]
    out_BxLxNxH = jnp.moveaxis(out, 0, 1).reshape(B, L, N, H)
    lse_BxNxL = jnp.moveaxis(lse, 0, 2).reshape(B, N, L)
    return out_BxLxNxH, lse_BxNxL


def _attention_fwd(q, k, v, segments, tiles):
    out, lse = _forward(q, k, v, segments, tiles)
    return out, (q, k, v, segments, out, lse)


def _attention_bwd(tiles: _Tiles, residuals, d_out_BxLxNxH):
    """Key block by key block: its dK and dV over the query blocks that see it, while dQ
    accumulates in place; probabilities recomputed from the saved log-sum-exp."""
    q, k, v, segments, out, lse_BxNxL = residuals
    b = tiles.block
    B, L, N, H = q.shape
    count = L // b
    # D_i = Σ_h dO · O: the softmax gradient's per-query term
    delta_BxNxL = jnp.einsum("blnh,blnh->bnl", d_out_BxLxNxH.astype(jnp.float32),
                             out.astype(jnp.float32))

    def key_block(dq_BxLxNxH, j):
        k_j, v_j, seg_j = _rows(k, j, b), _rows(v, j, b), _rows(segments, j, b)

        def query_block(i, carry):
            dq, dk_BxbxNxH, dv_BxbxNxH = carry
            q_i, do_i = _rows(q, i, b), _rows(d_out_BxLxNxH, i, b)
            seen = tiles.visible(i, j, _rows(segments, i, b), seg_j)
            p = jnp.where(seen, jnp.exp(_scores(q_i, k_j, tiles)
                                        - _rows(lse_BxNxL, i, b, axis=2)[..., None]), 0.0)
            dv_BxbxNxH += jnp.einsum("bnqk,bqnh->bknh", p.astype(do_i.dtype), do_i,
                                     preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqnh,bknh->bnqk", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - _rows(delta_BxNxL, i, b, axis=2)[..., None]) * tiles.scale
            dk_BxbxNxH += jnp.einsum("bnqk,bqnh->bknh", ds.astype(q_i.dtype), q_i,
                                     preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bnqk,bknh->bqnh", ds.astype(k_j.dtype), k_j,
                              preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(dq, _rows(dq, i, b) + dq_i, i * b, axis=1)
            return dq, dk_BxbxNxH, dv_BxbxNxH

        first, stop = tiles.query_blocks(j, count)
        zeros = jnp.zeros((B, b, N, H), jnp.float32)
        dq_BxLxNxH, dk, dv = lax.fori_loop(first, stop, query_block,
                                           (dq_BxLxNxH, zeros, zeros))
        return dq_BxLxNxH, (dk, dv)

    dq, (dk, dv) = lax.scan(key_block, jnp.zeros((B, L, N, H), jnp.float32), jnp.arange(count))
    # [blocks, B, b, N, H] → [B, L, N, H]
    dk, dv = (jnp.moveaxis(a, 0, 1).reshape(B, L, N, H) for a in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)
