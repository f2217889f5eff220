"""The tied output head fused with its cross-entropy, a chunk of the vocabulary at a time.

With Gemma's 262,144-entry vocabulary the logits are a step's largest activation ([tokens, V]
in fp32 is 1 GB per 1,024 tokens) and the head's gradient a whole [V, D] table. Here the
vocabulary is cut into `num_chunks` chunks, and a scan over them keeps, per token, a running
max, a running sum of exponentials and the target's logit. The table is read as `shards`
contiguous blocks (its tp shards) and chunk c takes the c-th slice of every block: each chunk
spreads over the tp shards alike, and cutting and reassembling the table moves no data. The
running max is a stop-gradient shift, so the gradient is exactly softmax − one-hot with no path through it.

Each chunk's slice of the table is materialized inside the scan (models/params.py: under FSDP
it is gathered there and its gradient reduced there), and the backward pass recomputes a
chunk's logits instead of keeping them: memory is O(tokens × V/k + V/k × D), never the whole
logits or a whole-table gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from tunix_train.models.params import materialize, never_saving_materialized
from tunix_train.models.partitioning import constrain


@dataclass(frozen=True)
class VocabChunks:
    """How the head cuts the vocabulary: `count` chunks of each of `shards` contiguous blocks."""

    count: int = 1
    shards: int = 1  # the vocabulary's tp shards (1 where it is not sharded)


def chunked(table: Any, num_chunks: int, shards: int) -> Any:
    """[V, ...] leaves → [num_chunks, shards, V / (shards · num_chunks), ...]."""
    def split(a):
        block = a.shape[0] // (shards * num_chunks)
        return jnp.swapaxes(a.reshape(shards, num_chunks, block, *a.shape[1:]), 0, 1)

    return jax.tree.map(split, table)


def token_losses(x_TxD: jax.Array, table: Any, targets_T: jax.Array,
                 chunks: VocabChunks) -> jax.Array:
    """Cross-entropy [T] (fp32) of logits x · tableᵀ against `targets_T`, one chunk at a time.

    `table` is the raw [V, D] embedding (an array, or what a parameter hook materializes); V
    must divide by chunks.shards × chunks.count.
    """
    num_chunks, shards = chunks.count, chunks.shards
    vocab = jax.tree.leaves(table)[0].shape[0]
    block = vocab // (shards * num_chunks)  # rows of one shard in one chunk
    shard_T, row_T = targets_T // (vocab // shards), targets_T % (vocab // shards)
    chunk_of_T, row_of_T = row_T // block, shard_T * block + row_T % block

    def body(carry, xs):
        max_T, sum_T, target_T = carry
        c, chunk = xs
        table_VxD = materialize(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), chunk))
        logits_TxV = jnp.einsum("td,vd->tv", x_TxD, table_VxD.astype(x_TxD.dtype),
                                preferred_element_type=jnp.float32)
        logits_TxV = constrain(logits_TxV, ("act_tokens", "act_vocab"))
        new_max_T = jax.lax.stop_gradient(jnp.maximum(max_T, jnp.max(logits_TxV, axis=1)))
        sum_T = sum_T * jnp.exp(max_T - new_max_T) + jnp.sum(
            jnp.exp(logits_TxV - new_max_T[:, None]), axis=1)
        is_target_TxV = (jnp.arange(logits_TxV.shape[1]) == row_of_T[:, None]) & \
            (chunk_of_T == c)[:, None]
        target_T = target_T + jnp.sum(jnp.where(is_target_TxV, logits_TxV, 0.0), axis=1)
        return (new_max_T, sum_T, target_T), None

    # Several chunks: keep only the carries (3 floats per token and chunk) and recompute each
    # chunk's logits. One chunk (a vocabulary within loss_vocab_chunk): nothing to gain.
    keep = jax.checkpoint_policies.nothing_saveable if num_chunks > 1 else \
        jax.checkpoint_policies.everything_saveable
    body = jax.checkpoint(body, policy=never_saving_materialized(keep), prevent_cse=False)
    tokens = x_TxD.shape[0]
    init = (jnp.full((tokens,), -jnp.inf, jnp.float32), jnp.zeros((tokens,), jnp.float32),
            jnp.zeros((tokens,), jnp.float32))
    (max_T, sum_T, target_T), _ = jax.lax.scan(
        body, init, (jnp.arange(num_chunks), chunked(table, num_chunks, shards)))
    return max_T + jnp.log(sum_T) - target_T
