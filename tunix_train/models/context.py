"""Causal attention across a sequence split over devices (context parallelism, the `cp` axis).

Each device holds one contiguous chunk of every sequence (`act_seq` → cp): queries, keys and
values of its C = L / cp tokens. Attention needs every earlier chunk's keys and values, so this
module all-gathers them over cp (in the compute dtype; the backward pass reduce-scatters dK and
dV) and computes its own queries against them a key chunk at a time with flash attention's
online softmax (a running max and sum per query), skipping chunks no query can see: later
chunks (causality) and, for a local layer, chunks beyond the window. Each chunk's scores exist
one [C, C] tile at a time and are recomputed in the backward pass (`jax.checkpoint`), so memory
is linear in L per device.

Why all-gathered keys and values rather than a ring of `ppermute`s: grouped-query attention has
few KV heads (Gemma 3 1B: one, against four query heads), so a layer's K and V are a small part
of its activations, and one all-gather of them is what a full ring would pass along anyway
(MaxText calls this context parallelism over all-gather). What the ring would add is overlap of
each hop with a chunk's compute; left for when a GPU measures the difference.

Not yet balanced: device c computes c + 1 chunks (causal), so the last device of the cp axis
has the most work. Everything else of a layer (projections, norms, RoPE with the batch's
global positions, the loss) is per token and partitioned by XLA along the same chunks.

Shapes: B batch, C tokens of this device's chunk, L = C · cp, N query heads, K KV heads,
H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

QUERY_BLOCK = 512  # queries per tile against a key chunk (or the largest divisor of C below)
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a masked row gives 0, not NaN


def attention(q_BxCxNxH: jax.Array, k_BxCxKxH: jax.Array, v_BxCxKxH: jax.Array,
              segment_ids_BxC: jax.Array, *, axis: str, scale: float,
              window: int | None) -> jax.Array:
    """Inside a shard_map manual over `axis`: this device's chunk of queries against every
    chunk's keys, causal, within `window` and the query's own segment; the same result as
    dense attention over the whole sequence, restricted to this chunk's queries."""
    cp, c = lax.axis_size(axis), lax.axis_index(axis)
    B, C, N, H = q_BxCxNxH.shape
    K = k_BxCxKxH.shape[2]
    q_BxCxKxGxH = q_BxCxNxH.reshape(B, C, K, N // K, H)
    k_BxLxKxH, v_BxLxKxH, segments_BxL = (
        lax.all_gather(a, axis, axis=1, tiled=True)
        for a in (k_BxCxKxH, v_BxCxKxH, segment_ids_BxC))

    # Queries go against a key chunk a block at a time: scores exist as [b, C] tiles, never
    # [C, C] (4.3 GB per head group at C = 16,384), and each block is recomputed backwards.
    b = math.gcd(C, QUERY_BLOCK)
    segments_BxNbxb = segment_ids_BxC.reshape(B, C // b, b)

    def chunk(j: int, q_BxCxKxGxH):
        """(max, sum, unnormalised output) of the queries against key chunk j."""
        keys = slice(j * C, (j + 1) * C)
        k_BxCxKxH, v_BxCxKxH = k_BxLxKxH[:, keys], v_BxLxKxH[:, keys]
        k_positions = j * C + jnp.arange(C)
        k_segments_BxC = segments_BxL[:, keys]

        @jax.checkpoint
        def block(xs):
            i, q_BxbxKxGxH, q_segments_Bxb = xs
            q_positions = c * C + i * b + jnp.arange(b)
            scores = jnp.einsum("bqkgh,bskh->bkgqs", q_BxbxKxGxH, k_BxCxKxH,
                                preferred_element_type=jnp.float32) * scale
            seen_bxC = q_positions[:, None] >= k_positions[None, :]
            if window:
                seen_bxC &= q_positions[:, None] - k_positions[None, :] < window
            seen = (seen_bxC & (q_segments_Bxb[:, :, None] == k_segments_BxC[:, None, :])
                    )[:, None, None]
            scores = jnp.where(seen, scores, _MASKED)
            max_BxKxGxb = jnp.max(scores, axis=-1)
            p = jnp.where(seen, jnp.exp(scores - max_BxKxGxb[..., None]), 0.0)
            out_BxbxKxGxH = jnp.einsum("bkgqs,bskh->bqkgh", p.astype(v_BxCxKxH.dtype),
                                       v_BxCxKxH, preferred_element_type=jnp.float32)
            return max_BxKxGxb, jnp.sum(p, axis=-1), out_BxbxKxGxH

        q_NbxBxbxKxGxH = jnp.moveaxis(q_BxCxKxGxH.reshape(B, C // b, b, *q_BxCxKxGxH.shape[2:]),
                                      1, 0)
        blocks = (jnp.arange(C // b), q_NbxBxbxKxGxH, jnp.moveaxis(segments_BxNbxb, 1, 0))
        max_s, sum_s, out_s = lax.map(block, blocks)  # [C/b, ...] per query block
        as_stats = lambda s: jnp.moveaxis(s, 0, -2).reshape(*s.shape[1:-1], C)  # noqa: E731
        return as_stats(max_s), as_stats(sum_s), jnp.moveaxis(out_s, 0, 1).reshape(
            B, C, *out_s.shape[3:])

    def nothing(q_BxCxKxGxH):
        return (jnp.full((B, K, N // K, C), _MASKED, jnp.float32),
                jnp.zeros((B, K, N // K, C), jnp.float32),
                jnp.zeros((B, C, K, N // K, H), jnp.float32))

    running = nothing(q_BxCxKxGxH)
    for j in range(cp):
        # Any visible pair: chunk j is not after this one, and (local layers) its last key is
        # within the window of this chunk's first query.
        visible = j <= c
        if window:
            visible &= (c - j - 1) * C + 1 < window
        found = lax.cond(visible, lambda q, j=j: chunk(j, q), nothing, q_BxCxKxGxH)
        running = _merged(running, found)
    _, total_BxKxGxC, out_BxCxKxGxH = running
    out_BxCxKxGxH = out_BxCxKxGxH / jnp.moveaxis(total_BxKxGxC, -1, 1)[..., None]
    return out_BxCxKxGxH.reshape(B, C, N, H).astype(q_BxCxNxH.dtype)


def _merged(a, b):
    """Two partial softmaxes over disjoint keys as one (flash attention's rescaling)."""
    (max_a, sum_a, out_a), (max_b, sum_b, out_b) = a, b
    top = jnp.maximum(max_a, max_b)
    scale_a, scale_b = jnp.exp(max_a - top), jnp.exp(max_b - top)
    per_query = lambda s: jnp.moveaxis(s, -1, 1)[..., None]  # noqa: E731 [B,K,G,C] → [B,C,K,G,1]
    return (top, sum_a * scale_a + sum_b * scale_b,
            out_a * per_query(scale_a) + out_b * per_query(scale_b))
