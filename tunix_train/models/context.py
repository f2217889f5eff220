"""Causal attention across a sequence split over devices (context parallelism, the `cp` axis).

Each device holds one contiguous chunk of every sequence (`act_seq` → cp): queries, keys and
values of its C = L / cp tokens. Attention needs every earlier chunk's keys and values, so this
module all-gathers them over cp (in the compute dtype; the backward pass reduce-scatters dK and
dV) and runs models/blockwise.py's tiles for its own queries against them: FlashAttention-2's
online softmax with its own backward pass, visiting only the key blocks causality and a local
window let the chunk's queries see (device c's tiles are a static list picked by `lax.switch`
on c). Memory is linear in L per device.

Why all-gathered keys and values rather than a ring of `ppermute`s: grouped-query attention has
few KV heads (Gemma 3 1B: one, against four query heads), so a layer's K and V are a small part
of its activations, and one all-gather of them is what a full ring would pass along anyway
(MaxText calls this context parallelism over all-gather). What the ring would add is overlap of
each hop with a chunk's compute; left for when a GPU measures the difference.

Not yet balanced: device c computes its queries against c + 1 chunks (causal), so the last
device of the cp axis has the most work. Everything else of a layer (projections, norms, RoPE
with the batch's global positions, the loss) is per token and computed on the device's chunk.

Shapes: B batch, C tokens of this device's chunk, L = C · cp, N query heads, K KV heads,
H head dim.
"""

from __future__ import annotations

import math

import jax
from jax import lax

from tunix_train.models import blockwise

BLOCK: int | None = None  # tokens per tile; None: blockwise.block_size of the whole sequence


def attention(q_BxCxNxH: jax.Array, k_BxCxKxH: jax.Array, v_BxCxKxH: jax.Array,
              segment_ids_BxC: jax.Array, *, axis: str, scale: float,
              window: int | None) -> jax.Array:
    """Inside a shard_map manual over `axis`: this device's chunk of queries against every
    chunk's keys, causal, within `window` and the query's own segment; the same result as
    dense attention over the whole sequence, restricted to this chunk's queries."""
    cp, C = lax.axis_size(axis), q_BxCxNxH.shape[1]
    k_BxLxKxH, v_BxLxKxH, segments_BxL = (
        lax.all_gather(a, axis, axis=1, tiled=True)
        for a in (k_BxCxKxH, v_BxCxKxH, segment_ids_BxC))
    block = math.gcd(C, BLOCK or blockwise.block_size(C * cp))

    def chunk(c: int):
        def at(q, k, v, q_segments, k_segments):
            return blockwise.chunk_attention(q, k, v, q_segments, k_segments, offset=c * C,
                                             scale=scale, window=window, block=block)
        return at

    return lax.switch(lax.axis_index(axis), [chunk(c) for c in range(cp)],
                      q_BxCxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxC, segments_BxL)
