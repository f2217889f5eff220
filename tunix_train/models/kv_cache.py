"""The key/value cache for decoding: per layer stack, fixed-size slot arrays written in place.

Rows are left-padded so every row writes its next token into the same column; a token at column
c goes to slot `c % size`. Full-attention layers get a slot per column (size = prompt + new
tokens); sliding-window layers a ring of `window` slots, since nothing older is attended to again.
Each slot remembers the position of its token (-1 = empty or padding), and attention masks are
built from positions alone, so padding, ring wrap-around and the window are handled alike.

    cache = {"<stack>": {"layers": {"k", "v": [layers, B, S, K, H]}, "positions": [B, S]},
             ... one per stack (models/family.py: Gemma 3's local_layers, global_layers,
             trailing_layers; Llama's and Qwen's layers) ...,
             "next": int32[]  (column of the next token written)}
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from tunix_train.models.partitioning import constrain

Cache = dict


def empty(num_layers: int, batch: int, size: int, kv_heads: int, head_dim: int,
          dtype: jnp.dtype) -> dict:
    shape = (num_layers, batch, size, kv_heads, head_dim)
    return {"layers": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)},
            "positions": jnp.full((batch, size), -1, jnp.int32)}


@dataclass(frozen=True)
class LayerView:
    """What one layer's attention sees of the cache while decoding."""

    kv: dict  # {"k", "v": [B, S, K, H]} of this layer
    positions: jax.Array  # [B, S] position of the token in each slot, -1 = none
    next_column: jax.Array  # int32[]: column of the first new token

    def keys_values(self, k_BxTxKxH, v_BxTxKxH, positions_BxT):
        """Cached and new keys, values and their positions, side by side (the new ones are not
        written yet: a prompt longer than a ring must attend to all of itself)."""
        keys = jnp.concatenate([self.kv["k"], k_BxTxKxH], axis=1)
        values = jnp.concatenate([self.kv["v"], v_BxTxKxH], axis=1)
        return keys, values, jnp.concatenate([self.positions, positions_BxT], axis=1)

    def write(self, k_BxTxKxH, v_BxTxKxH) -> dict:
        slots, n = _slots(self.next_column, k_BxTxKxH.shape[1], self.kv["k"].shape[1])
        axes = ("act_batch", None, "act_kv_heads", None)
        return {name: constrain(self.kv[name].at[:, slots].set(new[:, -n:]), axes)
                for name, new in (("k", k_BxTxKxH), ("v", v_BxTxKxH))}


def mask(q_positions_BxT, k_positions_BxS, window: int | None) -> jax.Array:
    """[B, 1, T, S]: causal by position, inside the window, never to empty slots or padding."""
    q, k = q_positions_BxT[:, :, None], k_positions_BxS[:, None, :]
    allowed = (k >= 0) & (k <= q)
    if window is not None:
        allowed &= k > q - window
    return allowed[:, None]


def _slots(next_column: jax.Array, new: int, size: int) -> tuple[jax.Array, int]:
    """Slots of the last min(new, size) new tokens: older ones would be overwritten anyway."""
    n = min(new, size)
    return (next_column + new - n + jnp.arange(n)) % size, n


def advance(cache: Cache, positions_BxT: jax.Array, kvs: dict) -> Cache:
    """The cache after T new tokens: their keys/values (written per layer, per stack in `kvs`)
    and positions."""
    new = dict(cache, next=cache["next"] + positions_BxT.shape[1])
    for stack, kv in kvs.items():
        if stack in cache:
            slots, n = _slots(cache["next"], positions_BxT.shape[1],
                              cache[stack]["positions"].shape[1])
            positions = cache[stack]["positions"].at[:, slots].set(positions_BxT[:, -n:])
            new[stack] = {"layers": kv, "positions": positions}
    return new
