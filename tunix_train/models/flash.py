"""Causal flash attention as Pallas kernels for GPUs (Triton): grouped-query heads, document masks
from segment ids, sliding windows, memory linear in the sequence length.

The fused counterpart of models/blockwise.py (the same algorithm, FlashAttention-2, in XLA
operations): here each (query block, batch row, head) is one program that keeps its running
max, sum and output in registers while it walks the key blocks it can see, so neither scores
nor a [B, N, L, L] mask or bias ever reach device memory; cuDNN's fused attention takes packed
documents only as such a bias. A sliding window bounds each program's loop (O(L · window)), and
a key-value head is read by the query heads of its group through the BlockSpec index, never
repeated in memory.

Three kernels: the forward pass saves the output and each query's log-sum-exp; the backward
pass recomputes each tile's probabilities from them, once per query block for dQ and once per
key block for dK and dV (which sum over the group's query heads in the program: no atomics).

On a backend without Triton (CPU) the same kernels run through Pallas's interpreter: exact, slow,
and what the tests check them with.

Shapes: B batch, L sequence (padded to the block), N query heads, K key-value heads, H head dim;
b tokens per block. Scores are kept in base 2 (exp2 of scores · log2 e): one multiply fewer
per score, as in the FlashAttention kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tunix_train import backend

BLOCK = 64  # tokens per query and key block; dot operands need ≥ 16 rows on the tensor cores
# Above head dim 128 the backward kernels take blocks of 32: a dK/dV program keeps two [b, H] fp32
# accumulators (128 KB at b = 64, H = 256, more than 8 warps' registers) and streams [b, H]
# query and output-gradient tiles through shared memory (~190 KB of an H100's 227 KB per block
# at b = 64). Guesses until measured on a GPU: bench/attention.py --pallas-block sweeps them.
BACKWARD_BLOCK_WIDE_HEADS = 32
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a masked row gives 0, not NaN


def supported_head_dim(head_dim: int) -> bool:
    """A tile's head axis is one Triton block: a power of two, at least 16 (a dot's minimum)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
              segment_ids_BxL: jax.Array | None, *, scale: float, window: int | None,
              block: int = BLOCK, interpret: bool | None = None) -> jax.Array:
    """Causal grouped-query attention, keys limited to the last `window` positions if given and
    to the query's own segment if `segment_ids_BxL` is given: the same result as
    `jax.nn.dot_product_attention(..., is_causal=True, local_window_size=(window - 1, 0))` with
    the mask segment_q == segment_k. `block`: tokens per tile, a power of two; `interpret`:
    Pallas's interpreter (None: everywhere but on GPUs)."""
    B, L, N, H = q_BxLxNxH.shape
    if not supported_head_dim(H):
        raise ValueError(f"the Pallas attention needs a power-of-two head dim of at least 16, "
                         f"not {H}")
    if segment_ids_BxL is None:
        segment_ids_BxL = jnp.zeros((B, L), jnp.int32)
    b = min(block, max(16, 1 << (L - 1).bit_length()))  # a short sequence is one block
    padded = -L % b  # padding keys come after every real query: causality hides them
    q, k, v = (jnp.pad(a, ((0, 0), (0, padded), (0, 0), (0, 0)))
               for a in (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH))
    segments = jnp.pad(segment_ids_BxL.astype(jnp.int32), ((0, 0), (0, padded)),
                       constant_values=-1)
    if interpret is None:
        interpret = not backend.is_gpu()
    tiles = _Tiles(b, window, float(scale), N // k.shape[2], bool(interpret), 4 if H <= 64 else 8)
    return _attention(q, k, v, segments, tiles)[:, :L]


@dataclasses.dataclass(frozen=True)  # hashable: custom_vjp takes it as a static argument
class _Tiles:
    """The tiling: tokens per block, the window (None: full causal), the score scale, query
    heads per key-value head, whether Pallas interprets the kernels."""
    block: int
    window: int | None
    scale: float
    groups: int
    interpret: bool
    warps: int  # per program: 4 for small heads, 8 from head dim 128 (more accumulator rows)

    @property
    def scale_log2(self) -> float:
        return self.scale * math.log2(math.e)

    def key_blocks(self, i):
        """[first, end) of the key blocks query block i sees: causal, and within the window."""
        b = self.block
        first = 0 if self.window is None else lax.div(jnp.maximum(i * b - self.window + 1, 0), b)
        return first, i + 1

    def query_blocks(self, j, count: int):
        """[first, end) of the query blocks that see key block j, of `count` blocks."""
        if self.window is None:
            return j, count
        last_query = (j + 1) * self.block - 1 + self.window - 1
        return j, jnp.minimum(lax.div(last_query, self.block) + 1, count)

    def visible(self, i, j, segments_q_b, segments_k_b) -> jax.Array:
        """[b, b]: may query i·b + q see key j·b + k."""
        q_pos = i * self.block + lax.broadcasted_iota(jnp.int32, (self.block, self.block), 0)
        k_pos = j * self.block + lax.broadcasted_iota(jnp.int32, (self.block, self.block), 1)
        seen = (k_pos <= q_pos) & (segments_q_b[:, None] == segments_k_b[None, :])
        if self.window is not None:
            seen &= q_pos - k_pos < self.window
        return seen

    def call(self, kernel, name: str, **kwargs):
        params = plgpu.CompilerParams(num_warps=self.warps, num_stages=2)
        return pl.pallas_call(kernel, name=name, interpret=self.interpret,
                              compiler_params=params, **kwargs)


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """a @ b of two tiles (either transposed), summed in fp32: what `pl.dot` did before JAX 0.11
    deprecated it (0.11.2 no longer has it under `pl`)."""
    contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _probabilities(tiles: _Tiles, i, j, q_bxH, k_bxH, lse_b, segments_ref):
    """[b, b] fp32: softmax probabilities of a tile, recomputed from the saved log-sum-exp."""
    b = tiles.block
    s = _dot(q_bxH, k_bxH, trans_b=True) * tiles.scale_log2
    seen = tiles.visible(i, j, segments_ref[pl.ds(i * b, b)], segments_ref[pl.ds(j * b, b)])
    return jnp.where(seen, jnp.exp2(s - lse_b[:, None]), 0.0)


def _forward_kernel(tiles: _Tiles, q_ref, k_ref, v_ref, segments_ref, out_ref, lse_ref):
    """One query block of one head: walk the visible key blocks with an online softmax."""
    b, i = tiles.block, pl.program_id(0)
    q_bxH = q_ref[...]
    segments_q = segments_ref[pl.ds(i * b, b)]

    def step(j, carry):
        acc_bxH, max_b, sum_b = carry
        k_bxH, v_bxH = k_ref[pl.ds(j * b, b), :], v_ref[pl.ds(j * b, b), :]
        seen = tiles.visible(i, j, segments_q, segments_ref[pl.ds(j * b, b)])
        s = jnp.where(seen, _dot(q_bxH, k_bxH, trans_b=True) * tiles.scale_log2, _MASKED)
        new_max = jnp.maximum(max_b, s.max(axis=1))
        p = jnp.where(seen, jnp.exp2(s - new_max[:, None]), 0.0)
        rescale = jnp.exp2(max_b - new_max)
        acc_bxH = acc_bxH * rescale[:, None] + _dot(p.astype(v_bxH.dtype), v_bxH)
        return acc_bxH, new_max, sum_b * rescale + p.sum(axis=1)

    init = (jnp.zeros(q_bxH.shape, jnp.float32), jnp.full((b,), _MASKED, jnp.float32),
            jnp.zeros((b,), jnp.float32))
    acc_bxH, max_b, sum_b = lax.fori_loop(*tiles.key_blocks(i), step, init)
    out_ref[...] = (acc_bxH / sum_b[:, None]).astype(out_ref.dtype)
    lse_ref[...] = max_b + jnp.log2(sum_b)


def _dq_kernel(tiles: _Tiles, q_ref, k_ref, v_ref, segments_ref, do_ref, lse_ref, delta_ref,
               dq_ref):
    """dQ of one query block of one head, over the key blocks it sees."""
    b, i = tiles.block, pl.program_id(0)
    q_bxH, do_bxH, lse_b, delta_b = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def step(j, dq_bxH):
        k_bxH, v_bxH = k_ref[pl.ds(j * b, b), :], v_ref[pl.ds(j * b, b), :]
        p = _probabilities(tiles, i, j, q_bxH, k_bxH, lse_b, segments_ref)
        ds = p * (_dot(do_bxH, v_bxH, trans_b=True) - delta_b[:, None])
        return dq_bxH + _dot(ds.astype(k_bxH.dtype), k_bxH)

    dq_bxH = lax.fori_loop(*tiles.key_blocks(i), step, jnp.zeros(q_bxH.shape, jnp.float32))
    dq_ref[...] = (dq_bxH * tiles.scale).astype(dq_ref.dtype)


def _dkv_kernel(tiles: _Tiles, q_ref, k_ref, v_ref, segments_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref):
    """dK and dV of one key block of one key-value head: summed over the query heads of its
    group (the refs hold the group's heads) and the query blocks that see it."""
    b, j = tiles.block, pl.program_id(0)
    k_bxH, v_bxH = k_ref[...], v_ref[...]
    first, end = tiles.query_blocks(j, q_ref.shape[0] // b)

    def step(head, i, carry):
        dk_bxH, dv_bxH = carry
        q_bxH, do_bxH = q_ref[pl.ds(i * b, b), head, :], do_ref[pl.ds(i * b, b), head, :]
        p = _probabilities(tiles, i, j, q_bxH, k_bxH, lse_ref[head, pl.ds(i * b, b)],
                           segments_ref)
        dv_bxH = dv_bxH + _dot(p.astype(do_bxH.dtype), do_bxH, trans_a=True)
        ds = p * (_dot(do_bxH, v_bxH, trans_b=True) - delta_ref[head, pl.ds(i * b, b)][:, None])
        return dk_bxH + _dot(ds.astype(q_bxH.dtype), q_bxH, trans_a=True), dv_bxH

    carry = (jnp.zeros(k_bxH.shape, jnp.float32), jnp.zeros(v_bxH.shape, jnp.float32))
    for head in range(tiles.groups):  # static: a few heads per group
        carry = lax.fori_loop(first, end, functools.partial(step, head), carry)
    dk_ref[...] = (carry[0] * tiles.scale).astype(dk_ref.dtype)
    dv_ref[...] = carry[1].astype(dv_ref.dtype)


# BlockSpecs. Grids run (block, batch row, head): a program's block index is program_id(0).
def _query_block(b: int, H: int) -> pl.BlockSpec:  # one head's rows of one query block
    return pl.BlockSpec((None, b, None, H), lambda i, row, h: (row, i, h, 0))


def _row_stats(b: int) -> pl.BlockSpec:  # [B, N, L] per-query statistics of one query block
    return pl.BlockSpec((None, None, b), lambda i, row, h: (row, h, i))


def _whole_kv(L: int, H: int, groups: int) -> pl.BlockSpec:  # the KV head a query head reads
    return pl.BlockSpec((None, L, None, H), lambda i, row, h: (row, 0, h // groups, 0))


def _whole_row(L: int) -> pl.BlockSpec:  # segment ids of a whole row
    return pl.BlockSpec((None, L), lambda i, row, h: (row, 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, tiles):
    return _forward(q, k, v, segments, tiles)[0]


def _forward(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segments_BxL, tiles: _Tiles):
    """Output [B, L, N, H] and base-2 log-sum-exp [B, N, L] (fp32)."""
    B, L, N, H = q_BxLxNxH.shape
    b = tiles.block
    return tiles.call(
        functools.partial(_forward_kernel, tiles), name="flash_forward", grid=(L // b, B, N),
        in_specs=[_query_block(b, H), _whole_kv(L, H, tiles.groups),
                  _whole_kv(L, H, tiles.groups), _whole_row(L)],
        out_specs=[_query_block(b, H), _row_stats(b)],
        out_shape=[jax.ShapeDtypeStruct(q_BxLxNxH.shape, q_BxLxNxH.dtype),
                   jax.ShapeDtypeStruct((B, N, L), jnp.float32)],
    )(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segments_BxL)


def _attention_fwd(q, k, v, segments, tiles):
    out, lse = _forward(q, k, v, segments, tiles)
    return out, (q, k, v, segments, out, lse)


def _attention_bwd(tiles: _Tiles, residuals, d_out_BxLxNxH):
    q, k, v, segments, out, lse_BxNxL = residuals
    if q.shape[-1] > 128:
        tiles = dataclasses.replace(tiles, block=min(tiles.block, BACKWARD_BLOCK_WIDE_HEADS))
    do = d_out_BxLxNxH.astype(q.dtype)
    # D = Σ_h dO · O per query: the softmax gradient's row term (one fused XLA pass)
    delta_BxNxL = jnp.einsum("blnh,blnh->bnl", d_out_BxLxNxH.astype(jnp.float32),
                             out.astype(jnp.float32))
    args = (q, k, v, segments, do, lse_BxNxL, delta_BxNxL)
    return _dq(tiles, *args), *_dkv(tiles, *args), None


def _dq(tiles: _Tiles, q, k, v, segments, do, lse, delta):
    B, L, N, H = q.shape
    b, groups = tiles.block, tiles.groups
    return tiles.call(
        functools.partial(_dq_kernel, tiles), name="flash_dq", grid=(L // b, B, N),
        in_specs=[_query_block(b, H), _whole_kv(L, H, groups), _whole_kv(L, H, groups),
                  _whole_row(L), _query_block(b, H), _row_stats(b), _row_stats(b)],
        out_specs=_query_block(b, H), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    )(q, k, v, segments, do, lse, delta)


def _dkv(tiles: _Tiles, q, k, v, segments, do, lse, delta):
    B, L, K, H = k.shape
    b, groups = tiles.block, tiles.groups
    group_rows = pl.BlockSpec((None, L, groups, H), lambda j, row, g: (row, 0, g, 0))
    group_stats = pl.BlockSpec((None, groups, L), lambda j, row, g: (row, g, 0))
    key_block = pl.BlockSpec((None, b, None, H), lambda j, row, g: (row, j, g, 0))
    return tiles.call(
        functools.partial(_dkv_kernel, tiles), name="flash_dkv", grid=(L // b, B, K),
        in_specs=[group_rows, key_block, key_block, _whole_row(L), group_rows, group_stats,
                  group_stats],
        out_specs=[key_block, key_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    )(q, k, v, segments, do, lse, delta)


_attention.defvjp(_attention_fwd, _attention_bwd)
