"""A layer's mixture of experts, as pure functions: a router picks each token's top-k experts,
and each expert's gated MLP runs on its own tokens only, through one grouped matmul per
projection (Qwen3-MoE's and Mixtral's sparse blocks; tests/test_moe.py holds them to
transformers' implementations).

    route(x_TxD, router_DxE, top_k, normalize)      → Routing (weights, experts, probs)
    experts_mlp(x_TxD, routing, gate, up, down, gated) → y_TxD
    (router_losses.py: a layer's routing statistics, and the router's losses from them)

Dropless by sorting: the T·k (token, expert) assignments are grouped by expert, so each
expert's rows are contiguous; a grouped matmul multiplies each group of rows by its own
expert's weight, and each token gathers its k rows back, weighted. By default (`blocks`) each
expert's first rows up to its mean share fill a block of its own, multiplied where its weight
lies, and the rows past it go through a loop over the tiles they fill (`in_blocks`); `tiled`
pads every expert's rows to whole tiles, `jax.lax.ragged_dot` is there on request. No token is
dropped (unless a capacity says so); the work is about the k experts' per token, not E's.
Where this device holds only a shard of the experts (an `ep` mesh axis), the rows travel to
their experts' devices and back (`exchanged`). models/moe_rows.py lays the rows out and
multiplies them (`Rows`); models/moe_overflow.py runs the blocks and their overflow loop.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from tunix_train import backend, validation
from tunix_train.config import ConfigError
from tunix_train.models import params as model_params
from tunix_train.models import partitioning
from tunix_train.models.moe_overflow import Blocked, Overflow, blocks_and_overflow
from tunix_train.models.moe_rows import (Rows, assignments_at, capacity, capped, dropped_out,
                                         none_for_padding, planned, ragged, sorted_by_expert,
                                         tiled)
from tunix_train.models.layers import PROJECTION

# models/grouped_matmul.py (Pallas kernels, tokamax) is imported where it is used: importing
# Pallas and its Triton dialect takes 0.2 s of every start, CPU runs included.


@dataclass(frozen=True)
class Routing:
    weights_TxK: jax.Array  # each token's top-k routing weights, in the input's dtype
    experts_TxK: jax.Array  # their experts, int32
    probs_TxE: jax.Array  # the router's softmax over all experts, fp32 (the auxiliary loss's)
    logsumexp_T: jax.Array  # of the router's logits, fp32 (the z-loss's)


def route(x_TxD: jax.Array, router_DxE: jax.Array, top_k: int, normalize: bool,
          force_balance: bool = False) -> Routing:
    """Softmax over the experts in fp32, the top k kept; with `normalize` (Mixtral, Qwen3-MoE's
    `norm_topk_prob`) the kept weights are rescaled to sum to 1. With `force_balance`
    (model.moe_force_load_balance, for benchmarks: Megatron-Core's
    `moe_router_force_load_balancing`, torchtitan's `moe_force_load_balance`) the logits are
    fixed pseudo-random values (`_noise`) in the forward pass, their gradient passed straight
    through to the router's: each expert takes its mean share up to sampling noise, as under a
    router trained to balance, with every operation of real routing still computed."""
    logits_TxE = jnp.dot(x_TxD, router_DxE.astype(x_TxD.dtype)).astype(jnp.float32)
    if force_balance:
        logits_TxE = _noise(logits_TxE.shape) + (logits_TxE - jax.lax.stop_gradient(logits_TxE))
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    weights_TxK, experts_TxK = jax.lax.top_k(probs_TxE, top_k)
    if normalize:
        weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
    return Routing(weights_TxK.astype(x_TxD.dtype), experts_TxK.astype(jnp.int32), probs_TxE,
                   jax.nn.logsumexp(logits_TxE, axis=-1))


def _noise(shape: tuple[int, int]) -> jax.Array:
    """Uniform [0, 1) values, one per (token, expert), from a hash of the position (murmur3's
    finaliser): the same each call, and elementwise, where jax.random's threefry is a loop on
    XLA's CPU compiler that would cost a benchmark what real routing does not."""
    h = jax.lax.iota(jnp.uint32, shape[0] * shape[1]).reshape(shape) + jnp.uint32(0x9E3779B9)
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ (h >> shift)) * jnp.uint32(multiplier)
    h = h ^ (h >> 16)
    return (h >> 8).astype(jnp.float32) * 2.0**-24


def experts_mlp(x_TxD: jax.Array, routing: Routing, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
                down_ExFxD: jax.Array, gated: Callable[[jax.Array, jax.Array], jax.Array],
                matmul: str = "tiles", capacity_factor: float | None = None,
                buffer_factor: float | None = None) -> jax.Array:
    """Σ over each token's k experts of weight · down(gated(gate(x), up(x))), each expert's
    projections applied to its own tokens only. The tokens are gathered once into their
    experts' rows (`Rows`: `matmul` says how they are laid out and multiplied, `MATMULS`), the
    whole MLP runs there, and each token gathers its k results back: two gathers (and two in
    the backward pass, `take`), never a scatter. With a `capacity_factor`, each expert takes at
    most `capacity(...)` rows, the first in token order (then top-k order); the others are
    dropped (they add nothing to their token's output). The three projections' outputs are
    named as a dense layer's are (`PROJECTION`), so `training.remat=save_dots` keeps them for
    the backward pass rather than multiplying again. Given fewer experts than the router
    scores (this device's shard of them, expert parallelism), the rows travel (`exchanged`,
    in `blocks` bounded by `buffer_factor`) and are laid out as `matmul` says. Dropless,
    `matmul=blocks` is `in_blocks`, on the received rows too (with a capacity: `capped`, or the
    tiles for the rows that travel)."""
    T, k = routing.experts_TxK.shape
    num_experts, held = routing.probs_TxE.shape[1], gate_ExDxF.shape[0]
    expert_of_A = routing.experts_TxK.reshape(T * k)  # A = T·k assignments, token-major
    mlp = functools.partial(_mlp, gate_ExDxF=gate_ExDxF, up_ExDxF=up_ExDxF,
                            down_ExFxD=down_ExFxD, gated=gated)
    per_expert = None if capacity_factor is None else capacity(T * k, num_experts,
                                                               capacity_factor)
    blocks = blocks_for(T, k, num_experts, held, capacity_factor, buffer_factor)
    weights = (gate_ExDxF, up_ExDxF, down_ExFxD)
    if blocks is not None:
        if per_expert is None and matmul == "blocks":
            # About T·k rows arrive on average, whatever the blocks' worst case holds.
            experts_on = functools.partial(_received_in_blocks, share=capacity(T * k, held, 1.0),
                                           weights=weights, gated=gated)
        else:
            experts_on = functools.partial(_received_as, arrange=MATMULS[matmul], held=held,
                                           mlp=mlp)
        y_TxKxD = exchanged(x_TxD, expert_of_A, k, blocks, experts_on, per_expert)
    elif per_expert is None and matmul == "blocks":
        return in_blocks(x_TxD, routing.experts_TxK, routing.weights_TxK, num_experts,
                         capacity(T * k, num_experts, 1.0), weights, gated)
    else:
        if per_expert is None:
            rows = MATMULS[matmul](expert_of_A, k, num_experts)
        else:
            rows = capped(expert_of_A, k, num_experts, per_expert)
        y_TxKxD = rows.to_tokens(mlp(rows.from_tokens(x_TxD), rows), T)
    return jnp.einsum("tkd,tk->td", y_TxKxD, routing.weights_TxK)


def _mlp(x_PxD: jax.Array, rows: Rows, gate_ExDxF: jax.Array, up_ExDxF: jax.Array,
         down_ExFxD: jax.Array, gated: Callable) -> jax.Array:
    """The experts' gated MLP on their rows (`rows` says whose they are)."""
    def project(lhs_PxI: jax.Array, weight_ExIxO: jax.Array) -> jax.Array:
        return checkpoint_name(rows.matmul(lhs_PxI, weight_ExIxO.astype(x_PxD.dtype)),
                               PROJECTION)

    h_PxF = gated(project(x_PxD, gate_ExDxF), project(x_PxD, up_ExDxF))
    return project(h_PxF, down_ExFxD)


def in_blocks(x_TxD: jax.Array, experts_TxK: jax.Array, weights_TxK: jax.Array, experts: int,
              share: int, weights: tuple[jax.Array, jax.Array, jax.Array],
              gated: Callable) -> jax.Array:
    """Σ over each token's k experts (-1: none), weighted, dropless [T, D]: each expert's first
    C = `share` rows (its mean share, ⌈T·k / E⌉) in a block of its own, the whole MLP on them
    as one batched matmul per projection over the weights where they lie ([E, C, D] × [E, D,
    F], `capped`: no copy of a weight, no padding past the blocks), and the rows past an
    expert's C (the overflow) through a loop over only the tiles they fill, both in
    models/moe_overflow.py's `blocks_and_overflow` (one custom VJP). Where
    `tiled` computes the worst case's padding on every step (E · (tile - 1) rows, half the rows
    again at 128 rows an expert), this computes the blocks' rows plus what routing left over.
    The plan of where rows go (integers: its sort, scatters and tile map) is named
    `ROUTING_PLAN`, so `training.remat=save_dots` keeps it rather than sorting again in the
    backward pass.

    Where XLA splits the experts' width over a mesh axis (tp), each device runs all of it on
    its share of every expert's width and the tokens' partial sums [T, D] are added once at the
    end (`partitioning.per_device`), as a dense MLP's are: left to XLA, the blocks' rows [T·k,
    D] were summed before they reached their tokens, the overflow's apart, and every tile's
    inside the loop (a collective an iteration)."""
    width, axis = weights[0].shape[-1], partitioning.axis_of("expert_mlp")

    def here(x_TxD, experts_TxK, weights_TxK, *weights):
        y_TxD = _in_blocks_here(x_TxD, experts_TxK, weights_TxK, experts, share, weights, gated)
        return y_TxD if weights[0].shape[-1] == width else jax.lax.psum(y_TxD, axis)

    if axis is None:
        return here(x_TxD, experts_TxK, weights_TxK, *weights)
    # The tokens' side whole on every device before the shard_map takes it so: inside ep's
    # shard_map, left to reshard the received rows itself, XLA's partitioner aborts (0.10).
    tokens = tuple(partitioning.constrain(a, (None,) * a.ndim)
                   for a in (x_TxD, experts_TxK, weights_TxK))
    args = (*tokens, *weights)
    split = (None, None, "expert_mlp")
    return partitioning.per_device(here, args, ((None, None),) * 3 + (
        split, split, (None, "expert_mlp", None)), (None, None))


def _in_blocks_here(x_TxD, experts_TxK, weights_TxK, experts, share, weights, gated):
    """`in_blocks` on one device's weights as they are (whole, or its share of the width)."""
    T, k = experts_TxK.shape
    expert_of_A = experts_TxK.reshape(T * k)
    row_A = capped(expert_of_A, k, experts, share).row_A
    blocks = Blocked(assignments_at(row_A, experts * share), row_A)
    plan = overflow_plan(expert_of_A, k, experts, share)
    blocks, plan = planned((blocks, plan))
    return blocks_and_overflow(x_TxD, weights_TxK.reshape(T * k), blocks, plan, *weights, gated)


def _received_in_blocks(x_QxD: jax.Array, expert_Q: jax.Array, share: int, weights: tuple,
                        gated: Callable) -> jax.Array:
    """An ep device's received rows through `in_blocks` (each row its own token, weight 1),
    the blocks sized by the rows that arrive on average, not by the exchange's worst case."""
    ones_Qx1 = jnp.ones((x_QxD.shape[0], 1), x_QxD.dtype)
    return in_blocks(x_QxD, expert_Q[:, None], ones_Qx1, weights[0].shape[0], share, weights,
                     gated)


def _received_as(x_QxD: jax.Array, expert_Q: jax.Array, arrange: Callable[..., Rows],
                 held: int, mlp: Callable) -> jax.Array:
    """An ep device's received rows laid out by `arrange` (one of `MATMULS`)."""
    rows = arrange(expert_Q, 1, held)
    return rows.to_tokens(mlp(rows.from_tokens(x_QxD), rows), x_QxD.shape[0]).reshape(
        x_QxD.shape)


def overflow_plan(expert_of_A: jax.Array, k: int, experts: int, share: int) -> Overflow:
    """Where the assignments past each expert's first `share` rows go: tiles of a quarter of
    the share (8 at least; an eighth, a half or the whole share measured no faster on CPU), each
    expert's rows in tiles of their own."""
    A = expert_of_A.shape[0]
    tile = max(8, share // 4)
    sizes_E, _, rank_A = sorted_by_expert(expert_of_A, experts)
    tiles_E = (jnp.maximum(sizes_E - share, 0) + tile - 1) // tile
    first_tile_E = jnp.cumsum(tiles_E) - tiles_E
    n_tiles = -(-max(A - share, 0) // tile) + experts  # one expert's rows past its share, or
    # several experts' ending in part-filled tiles: Σ ⌈o_e / tile⌉ ≤ (A - share) / tile + E
    slot_A = jnp.where((rank_A >= share) & (expert_of_A >= 0),
                       first_tile_E[expert_of_A] * tile + rank_A - share, n_tiles * tile)
    slot_R = jnp.full(n_tiles * tile, -1, jnp.int32).at[slot_A].set(
        jnp.arange(A, dtype=jnp.int32), mode="drop")
    # By comparing all [n_tiles, E] pairs: searchsorted's default is a loop on XLA's CPU compiler.
    expert_N = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles_E), jnp.arange(n_tiles),
                                            side="right", method="compare_all"),
                           experts - 1).astype(jnp.int32)
    return Overflow(slot_R, expert_N, jnp.sum(tiles_E).astype(jnp.int32), k, tile)


@dataclass(frozen=True)
class Blocks:
    """How a device's rows travel to experts split over devices (expert parallelism): `shards`
    shards of `held` experts, one per device, each sent a block of `rows` rows."""

    held: int
    shards: int
    rows: int


def blocks_for(tokens: int, k: int, experts: int, held: int,
               capacity_factor: float | None = None,
               buffer_factor: float | None = None) -> Blocks | None:
    """How `tokens` tokens' rows travel where this device holds `held` of the `experts` (None:
    it holds all, nothing travels): `experts_mlp` sends them so, `router_losses.statistics`
    counts what that drops."""
    if held == experts:
        return None
    per_expert = None if capacity_factor is None else capacity(tokens * k, experts,
                                                               capacity_factor)
    return plan_blocks(tokens, k, held, experts // held, per_expert, buffer_factor)


def plan_blocks(tokens: int, k: int, held: int, shards: int, per_expert: int | None = None,
                buffer_factor: float | None = None) -> Blocks:
    """The rows of a block: the worst case, T · min(k, held) (a token's k experts are distinct),
    so that no row is ever dropped; with a capacity, at most `held` capacities; with a
    `buffer_factor` (model.moe_ep_buffer_factor), at most that factor × a shard's mean share
    T·k / shards, the rows past it dropped (counted as `router_losses.statistics` counts them)."""
    rows = tokens * min(k, held)
    if per_expert is not None:
        rows = min(rows, held * per_expert)
    if buffer_factor is not None:
        rows = min(rows, max(1, math.ceil(buffer_factor * tokens * k / shards)))
    return Blocks(held, shards, rows)


def exchanged(x_TxD: jax.Array, expert_of_A: jax.Array, k: int, blocks: Blocks,
              experts_on: Callable[[jax.Array, jax.Array], jax.Array],
              per_expert: int | None = None) -> jax.Array:
    """Each token's k results [T, k, D] where the experts are split over devices, this device
    holding one shard of them (expert parallelism): the assignments are grouped by shard into
    a block of C rows per shard (`plan_blocks`), the blocks exchanged (models/params.py's
    `exchange`: an all-to-all), each device runs its experts' MLP on the rows it received
    (`experts_on(x_QxD, expert_Q)`: each row its own token, of one of this device's experts, -1
    for padding), and the results travel back the same way. A block's unused rows are padding,
    which no expert takes. With a capacity (`per_expert` rows of these T tokens per expert, as
    `capped` keeps them), the rows past it are dropped before they travel; so are the rows past
    a block's C (only where `plan_blocks` bounds it)."""
    T, D = x_TxD.shape
    held, shards, C = blocks.held, blocks.shards, blocks.rows
    shard_of_A = expert_of_A // held
    if per_expert is not None:
        _, _, rank_A = sorted_by_expert(expert_of_A, held * shards)
        shard_of_A = jnp.where(rank_A < per_expert, shard_of_A, -1)
    _, _, rank_A = sorted_by_expert(shard_of_A, shards)
    sent = Rows.at(none_for_padding(shard_of_A * C + rank_A,
                                    jnp.where(rank_A < C, shard_of_A, -1)), k, shards * C,
                   _no_matmul)
    # Each slot's expert among its shard's (-1: padding).
    expert_Q = jnp.full(shards * C, -1, jnp.int32).at[dropped_out(sent.row_A, shards * C)].set(
        expert_of_A % held, mode="drop")
    x_QxD = model_params.exchange(sent.from_tokens(x_TxD).reshape(shards, C, D)).reshape(-1, D)
    expert_Q = model_params.exchange(expert_Q.reshape(shards, C)).reshape(-1)
    y_QxD = experts_on(x_QxD, expert_Q)
    return sent.to_tokens(model_params.exchange(y_QxD.reshape(shards, C, D)).reshape(-1, D), T)


def _no_matmul(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    raise TypeError("these rows only travel: no matmul lays them out")


def chosen_matmul(model, tp: int) -> str:
    """model.moe_matmul, `auto` decided: our Pallas kernels on a GPU, where they are measured
    faster than `tiles` (docs/performance.md), if XLA can keep them whole (tp = 1) and Triton's
    dots fit the widths (multiples of 16); `blocks` elsewhere (measured faster than `tiles` on
    CPU). A choice that cannot run here is refused by name (training and inference both lay
    their parameters out through this)."""
    if model.num_experts and model.moe_matmul == "tokamax":
        _check_tokamax_runs()
    if model.moe_matmul != "auto":
        return model.moe_matmul
    widths = (model.embed_dim, model.expert_hidden_dim)
    fits = tp == 1 and all(width % 16 == 0 for width in widths)
    return "pallas" if backend.is_gpu() and fits else "blocks"


# tokamax releases whose GPU kernels call what JAX 0.11 removed (bench/gpu_check.sh's
# `moe-tokamax` and bench/grouped_matmul.py on an H100 and an H200, docs/performance.md):
# the Mosaic GPU kernel Hopper gets passes plgpu.kernel an `out_shape` Mesh no longer takes,
# and the Triton one calls pl.dot.
_TOKAMAX_BROKEN_ON_JAX_0_11 = ("0.0.12",)


def _check_tokamax_runs() -> None:
    """On a CPU tokamax runs XLA's ragged_dot; on a GPU its kernels, which some releases
    cannot run on this jax."""
    if not backend.is_gpu():
        return
    try:
        version = importlib.metadata.version("tokamax")
    except importlib.metadata.PackageNotFoundError:
        return  # validation.py says so, by name
    if version in _TOKAMAX_BROKEN_ON_JAX_0_11 and validation.release(jax.__version__) >= (0, 11):
        raise ConfigError(
            f"model.moe_matmul=tokamax on a GPU: tokamax {version}'s GPU kernels do not run on "
            f"jax {jax.__version__} (they call what jax 0.11 removed); set "
            f"model.moe_matmul=pallas (our kernels) or auto, or use a newer tokamax.")


def _tokamax(expert_of_A: jax.Array, k: int, experts: int) -> Rows:
    from tunix_train.models import grouped_matmul  # only where used: see the imports

    return ragged(expert_of_A, k, experts, dot=grouped_matmul.tokamax_ragged_dot)


# model.moe_matmul → (expert of each assignment, k, experts) → Rows. `blocks` is `in_blocks`
# where no capacity caps the experts; with one, rows that travel to their experts' devices (ep)
# go through the tiles there.
MATMULS = {"blocks": tiled, "tiles": tiled, "ragged_dot": ragged, "tokamax": _tokamax,
           "pallas": functools.partial(tiled, kernel=True)}
