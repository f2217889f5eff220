"""Causal attention across a sequence split over devices (context parallelism, the `cp` axis).

Each device holds C = L / cp tokens of every sequence (`act_seq` → cp), in two halves: the
sequence is cut into 2·cp pieces and device c holds piece c and piece 2·cp − 1 − c, so every
device has an early and a late piece and the same causal work (c + 1 plus 2·cp − c piece pairs:
load balance, as in Megatron's and torchtitan's context parallelism). The train and eval steps
put each batch in this order (`balanced_order`) before it is split; every per-token computation
(projections, norms, RoPE at the batch's global positions, the loss) does not care where a
token sits.

Attention needs earlier pieces' keys and values, so this module all-gathers them over cp (in
the compute dtype; the backward pass reduce-scatters dK and dV), puts them back in sequence
order, and runs models/blockwise.py's tiles for each of its two query pieces against them:
FlashAttention-2's online softmax with its own backward pass, visiting only the key blocks
causality and a local window let the piece's queries see (one scan over device c's row of a
table of tiles, the same length on every device: no branch per device, whose residuals JAX
would keep for every branch). Memory is linear in L per device.

Why all-gathered keys and values rather than a ring of `ppermute`s: grouped-query attention has
few KV heads (Gemma 3 1B: one, against four query heads), so a layer's K and V are a small part
of its activations, and one all-gather of them is what a full ring would pass along anyway
(MaxText calls this context parallelism over all-gather). What the ring would add is overlap of
each hop with a chunk's compute; left for when a GPU measures the difference.

Shapes: B batch, C tokens of this device's two pieces, L = C · cp, N query heads, K KV
heads, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tunix_train.models import blockwise

BLOCK: int | None = None  # tokens per tile; None: blockwise.block_size of the whole sequence


def balanced_order(length: int, cp: int) -> np.ndarray:
    """The sequence positions in the order cp devices hold them: device c's C = length / cp
    tokens are piece c and piece 2·cp − 1 − c of 2·cp equal pieces. `x[..., order]` puts a
    [.., length] batch entry in this order; `length` divides by 2·cp (config validation)."""
    piece = length // (2 * cp)
    return np.concatenate([np.arange(p * piece, (p + 1) * piece)
                           for c in range(cp) for p in (c, 2 * cp - 1 - c)])


def attention(q_BxCxNxH: jax.Array, k_BxCxKxH: jax.Array, v_BxCxKxH: jax.Array,
              segment_ids_BxC: jax.Array, *, axis: str, scale: float,
              window: int | None) -> jax.Array:
    """Inside a shard_map manual over `axis`, on sequences in `balanced_order`: this device's
    two pieces of queries against every earlier key, causal, within `window` and the query's
    own segment; the same result as dense attention over the whole sequence, restricted to
    this device's queries."""
    cp, C = lax.axis_size(axis), q_BxCxNxH.shape[1]
    piece = C // 2
    in_sequence = np.argsort(balanced_order(C * cp, cp))
    k_BxLxKxH, v_BxLxKxH, segments_BxL = (
        jnp.take(lax.all_gather(a, axis, axis=1, tiled=True), in_sequence, axis=1)
        for a in (k_BxCxKxH, v_BxCxKxH, segment_ids_BxC))
    block = math.gcd(piece, BLOCK or blockwise.block_size(C * cp))
    table = _tile_tables(cp, piece // block, block, window)[lax.axis_index(axis)]
    return blockwise.attention_tiles(q_BxCxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxC,
                                     segments_BxL, table, scale=scale, window=window,
                                     block=block)


def _tile_tables(cp: int, blocks: int, block: int, window: int | None) -> jax.Array:
    """[cp, T, 3]: each device's tiles (blockwise.tile_table of its two pieces' blocks, `blocks`
    each), padded to one length with tiles that change nothing: balanced pieces give every
    device the same count for causal layers, so the padding is for local windows near the
    sequence's start."""
    tables = [blockwise.tile_table(np.concatenate([np.arange(p * blocks, (p + 1) * blocks)
                                                   for p in (c, 2 * cp - 1 - c)]),
                                   block, window) for c in range(cp)]
    longest = max(len(t) for t in tables)
    return jnp.asarray(np.stack([np.concatenate([t, np.tile(blockwise.NO_TILE,
                                                            (longest - len(t), 1))])
                                 for t in tables]))
