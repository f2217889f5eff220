"""Causal attention across a sequence split over devices (context parallelism, the `cp` axis).

Each device holds C = L / cp tokens of every sequence (`act_seq` → cp), in two halves: the
sequence is cut into 2·cp pieces and device c holds piece c and piece 2·cp − 1 − c, so every
device has an early and a late piece and the same causal work (c + 1 plus 2·cp − c piece pairs:
load balance, as in Megatron's and torchtitan's context parallelism). The train and eval steps
put each batch in this order (`balanced_order`) before it is split; every per-token computation
(projections, norms, RoPE at the batch's global positions, the loss) does not care where a
token sits.

Attention needs earlier pieces' keys and values; `model.cp_exchange` picks how they come:

- `gathered_attention` (`all_gather`, the default) all-gathers them over cp (in the compute
  dtype; the backward pass reduce-scatters dK and dV) and puts them back in sequence order;
- `ring_attention` (`ring`) passes each device's chunk around the cp devices in cp − 1 hops,
  the next hop in flight while a step computes, and passes it around again in the backward
  pass with its dK and dV (fp32, per KV head), which end on their own device.

Either way the queries run models/blockwise.py's tiles: FlashAttention-2's online softmax with
its own backward pass, visiting only the key blocks causality and a local window let them see
(a scan over this device's row of a table of tiles, the same length on every device: no branch
per device, whose residuals JAX would keep for every branch). Memory is linear in L per device.

Which, by measurement (docs/performance.md, docs/distributed_training.md): both move the same
bytes (the ring (cp − 1)/cp of the gathered keys and values, and dK and dV once more). The ring
holds two chunks of keys and values where the all-gather holds the whole sequence's, repeated
to the query heads, and its fp32 gradients: llama3_1_8b at 131,072 tokens on cp 16 plans 33.87
GB per device by ring against 39.40 GB gathered; gemma3_1b (one KV head) at 32,768 tokens on cp
8, 4.33 against 4.41 GB. On the CPU benchmark (8 simulated devices, cp 4, 4,096 tokens) the
ring's step is 1.09x the all-gather's: a CPU cannot overlap a hop with compute, so the ring pays
3·cp − 2 synchronisations a layer where the all-gather pays two. Hence `all_gather` by default
(grouped-query attention's keys and values are a small part of the activations; MaxText's
default as well), `ring` where the planner says memory binds at long context. Whether a GPU's
overlap makes the ring as fast is not measured yet.

Shapes: B batch, C tokens of this device's two pieces, L = C · cp, N query heads, K KV
heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
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


def gathered_attention(q_BxCxNxH: jax.Array, k_BxCxKxH: jax.Array, v_BxCxKxH: jax.Array,
                       segment_ids_BxC: jax.Array, *, axis: str, scale: float,
                       window: int | None) -> jax.Array:
    """Inside a shard_map manual over `axis`, on sequences in `balanced_order`: this device's
    two pieces of queries against every earlier key, causal, within `window` and the query's
    own segment; the same result as dense attention over the whole sequence, restricted to
    this device's queries. Every device's keys and values are all-gathered over `axis` (the
    backward pass reduce-scatters their gradients) and put back in sequence order."""
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


def ring_attention(q_BxCxNxH: jax.Array, k_BxCxKxH: jax.Array, v_BxCxKxH: jax.Array,
                   segment_ids_BxC: jax.Array, *, axis: str, scale: float,
                   window: int | None) -> jax.Array:
    """`gathered_attention`'s result by a ring: keys and values pass from device to device
    around `axis` in cp steps, each step's tiles folded into the online softmax; the backward
    pass passes them around again with their gradients (per KV head, fp32), which end on their
    own device. No device ever holds more than two chunks of keys and values."""
    cp, C = lax.axis_size(axis), q_BxCxNxH.shape[1]
    piece = C // 2
    block = math.gcd(piece, BLOCK or blockwise.block_size(C * cp))
    first, rest = _ring_tables(cp, piece // block, block, window)
    me = lax.axis_index(axis)
    # A step without tiles (a local window's far chunks) has no table, so computes nothing in
    # either pass, where an empty one left an unused input to jax 0.11.2's Shardy, which
    # crashed compiling the backward pass (ManualComputationUnusedInputsPattern).
    return _ring(q_BxCxNxH, k_BxCxKxH, v_BxCxKxH, segment_ids_BxC.astype(jnp.int32),
                 first[me], tuple(t[me] if t.shape[1] else None for t in rest),
                 _Ring(axis, cp, blockwise.Tiles(block, window, float(scale))))


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis: str
    cp: int
    tiles: blockwise.Tiles

    def passed_on(self, tree):
        """Each device's `tree` to the next device around the ring (c → c + 1)."""
        return lax.ppermute(tree, self.axis, [(c, (c + 1) % self.cp) for c in range(self.cp)])


def _ring_steps(ring: _Ring, step, carry, chunk, first, rest):
    """`step(carry, chunk, table)` on this device's own chunk with `first`, then on each
    earlier device's with `rest`'s tables in turn; the next chunk is already on its way while
    a step computes (the last step asks for none). The steps are unrolled, not a loop: XLA's
    CPU runtime does not order collectives nested in a loop against those outside it, and
    devices that meet them in different orders wait on each other forever."""
    coming = ring.passed_on(chunk) if ring.cp > 1 else None
    carry = step(carry, chunk, first)
    for s in range(1, ring.cp):
        chunk = coming
        if s < ring.cp - 1:
            coming = ring.passed_on(chunk)
        carry = step(carry, chunk, rest[s - 1])
    return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ring(q, k, v, segments, first, rest, ring: _Ring):
    return _ring_forward(q, k, v, segments, first, rest, ring)[0]


def _ring_forward(q_BxCxNxH, k_BxCxKxH, v_BxCxKxH, segments_BxC, first, rest, ring: _Ring):
    q = blockwise.heads_first(q_BxCxNxH)

    def step(carry, chunk, table):
        if table is None:  # no tile of this chunk is seen
            return carry
        k, v, k_segments = chunk
        k, v = (blockwise.heads_first(a)
                for a in blockwise.to_query_heads(q_BxCxNxH, k, v))
        return blockwise.forward_tiles(q, k, v, segments_BxC, k_segments, table, ring.tiles,
                                       carry)

    carry = _ring_steps(ring, step, blockwise.softmax_start(*q.shape),
                        (k_BxCxKxH, v_BxCxKxH, segments_BxC), first, rest)
    return blockwise.softmax_end(carry, q_BxCxNxH.dtype)


def _ring_fwd(q, k, v, segments, first, rest, ring):
    out, lse = _ring_forward(q, k, v, segments, first, rest, ring)
    return out, (q, k, v, segments, first, rest, out, lse)


def _ring_bwd(ring: _Ring, residuals, d_out_BxCxNxH):
    q_BxCxNxH, k_BxCxKxH, v_BxCxKxH, segments_BxC, first, rest, out, lse_BxNxC = residuals
    q, do = (blockwise.heads_first(a) for a in (q_BxCxNxH, d_out_BxCxNxH))
    delta_BxNxC = blockwise.softmax_row_terms(d_out_BxCxNxH, out)
    B, N, C, H = q.shape
    K = k_BxCxKxH.shape[2]

    def step(carry, chunk, table):
        """dQ, and this chunk's dK and dV (per KV head) added to those that came with it."""
        dq, kv_grads = carry
        # The gradients so far of the chunk this device holds come from the previous device.
        arrived = ring.passed_on(kv_grads) if kv_grads is not None else None
        if table is None:  # no tile of this chunk is seen: it adds nothing (never the first)
            return dq, arrived
        k, v, k_segments = chunk
        k, v = (blockwise.heads_first(a) for a in blockwise.to_query_heads(q_BxCxNxH, k, v))
        zeros = jnp.zeros((B, N, C, H), jnp.float32)
        dq, dk, dv = blockwise.backward_tiles(q, k, v, do, segments_BxC, k_segments, table,
                                              ring.tiles, lse_BxNxC, delta_BxNxC,
                                              (dq, zeros, zeros))
        per_kv_head = tuple(g.reshape(B, K, N // K, C, H).sum(2) for g in (dk, dv))
        kv_grads = per_kv_head if arrived is None else tuple(
            a + g for a, g in zip(arrived, per_kv_head))
        return dq, kv_grads

    dq, kv_grads = _ring_steps(ring, step, (jnp.zeros(q.shape, jnp.float32), None),
                               (k_BxCxKxH, v_BxCxKxH, segments_BxC), first, rest)
    dk, dv = ring.passed_on(kv_grads) if ring.cp > 1 else kv_grads  # home: chunk c + 1 → c + 1
    dq = blockwise.heads_first(dq).astype(q_BxCxNxH.dtype)
    return (dq, *(blockwise.heads_first(g).astype(a.dtype) for g, a in
                  zip((dk, dv), (k_BxCxKxH, v_BxCxKxH))), None, None, tuple(None for _ in rest))


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ring_tables(cp: int, blocks: int, block: int,
                 window: int | None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """([cp, T, 4] each device's tiles of its own chunk, and for each ring step s = 1 … cp − 1
    a [cp, T_s, 4] of device c's queries against device c − s's keys): blockwise.tile_table's
    rows, query blocks local to the device, key blocks local to the chunk held; each step's
    padded to one length on every device with tiles that change nothing (balanced pieces make
    every step of a causal layer the same length on every device: 2·blocks² tiles after the
    first). A local layer's window reaches the neighbours' chunks only (steps 1 and cp − 1):
    its other steps have no tiles and compute nothing."""
    def table(c, s):
        return blockwise.tile_table(_piece_blocks(c, cp, blocks), block, window,
                                    _piece_blocks((c - s) % cp, cp, blocks))

    first, *rest = (jnp.asarray(blockwise.padded_tables([table(c, s) for c in range(cp)]))
                    for s in range(cp))
    return first, tuple(rest)


def _tile_tables(cp: int, blocks: int, block: int, window: int | None) -> jax.Array:
    """[cp, T, 4]: each device's tiles (blockwise.tile_table of its two pieces' blocks, `blocks`
    each), padded to one length with tiles that change nothing: balanced pieces give every
    device the same count for causal layers, so the padding is for local windows near the
    sequence's start."""
    return jnp.asarray(blockwise.padded_tables([
        blockwise.tile_table(_piece_blocks(c, cp, blocks), block, window) for c in range(cp)]))


def _piece_blocks(device: int, cp: int, blocks: int) -> np.ndarray:
    """The sequence's blocks that `device` holds: those of pieces c and 2·cp − 1 − c."""
    return np.concatenate([np.arange(p * blocks, (p + 1) * blocks)
                           for p in (device, 2 * cp - 1 - device)])
