"""The Gemma 3 decoder with scanned layers.

Gemma 3 interleaves local (sliding-window, RoPE base 10k) and global (full causal, RoPE base 1M)
layers, one global after every `global_every - 1` local ones. The two kinds are kept in two
stacks so that each kind's attention is static (a fixed window is what lets cuDNN's flash
attention run), and the forward pass is a scan over blocks of [locals..., global] followed by a
scan over the trailing locals. Compile time is therefore independent of depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import ModelConfig
from tunix_train.models.layers import DecoderLayer, Embedder, RMSNorm, rope_tables
from tunix_train.sharding import constrain

REMAT_POLICIES = {
    "full": None,  # recompute everything in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclass(frozen=True)
class LayerLayout:
    """How `num_layers` splits into [locals..., global] blocks plus trailing locals."""

    num_blocks: int
    locals_per_block: int
    trailing_locals: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> "LayerLayout":
        blocks, trailing = divmod(cfg.num_layers, cfg.global_every)
        return cls(blocks, cfg.global_every - 1, trailing)

    @property
    def num_local(self) -> int:
        return self.num_blocks * self.locals_per_block + self.trailing_locals

    @property
    def num_global(self) -> int:
        return self.num_blocks

    def placement(self) -> list[tuple[str, int]]:
        """For each layer in order: ("local" | "global", index inside that kind's stack)."""
        counts, out = {"local": 0, "global": 0}, []
        period = self.locals_per_block + 1
        for layer in range(self.num_blocks * period + self.trailing_locals):
            kind = "global" if layer % period == period - 1 and layer < self.num_blocks * period \
                else "local"
            out.append((kind, counts[kind]))
            counts[kind] += 1
        return out


def _stacked_layers(cfg: ModelConfig, count: int, rngs: nnx.Rngs) -> DecoderLayer | None:
    if count == 0:
        return None

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(layer_rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, layer_rngs)

    return make(rngs)


class Gemma3(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: str = "none"):
        self.cfg = cfg
        self.layout = LayerLayout.of(cfg)
        self.remat = remat
        self.embedder = Embedder(cfg, rngs)
        self.local_layers = _stacked_layers(cfg, self.layout.num_local, rngs)
        self.global_layers = _stacked_layers(cfg, self.layout.num_global, rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.rms_norm_eps)

    def __call__(
        self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None,
        segment_ids_BxL: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, L, V] in the parameters' dtype."""
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
        x_BxLxD = self.embedder.encode(tokens_BxL)
        x_BxLxD = constrain(x_BxLxD, ("act_batch", "act_seq", "act_embed"))
        x_BxLxD = self._layers(x_BxLxD, positions_BxL, segment_ids_BxL)
        return self.embedder.decode(self.final_norm(x_BxLxD))

    def _layers(self, x_BxLxD, positions_BxL, segment_ids_BxL) -> jax.Array:
        cfg, layout = self.cfg, self.layout
        H = cfg.head_dim
        local_rope = rope_tables(positions_BxL, H, cfg.local_rope_base, 1.0)
        global_rope = rope_tables(positions_BxL, H, cfg.global_rope_base, cfg.global_rope_scale)
        local_step = self._scan_step(self.local_layers, local_rope, segment_ids_BxL,
                                     cfg.sliding_window)
        global_step = self._scan_step(self.global_layers, global_rope, segment_ids_BxL, None)
        n_blocked = layout.num_blocks * layout.locals_per_block
        if layout.num_blocks:
            blocked = jax.tree.map(
                lambda a: a[:n_blocked].reshape(layout.num_blocks, layout.locals_per_block,
                                                *a.shape[1:]),
                self._state(self.local_layers),
            )

            def block(x, params):
                if layout.locals_per_block:
                    x, _ = jax.lax.scan(local_step, x, params[0])
                return global_step(x, params[1])

            x_BxLxD, _ = jax.lax.scan(block, x_BxLxD, (blocked, self._state(self.global_layers)))
        if layout.trailing_locals:
            trailing = jax.tree.map(lambda a: a[n_blocked:], self._state(self.local_layers))
            x_BxLxD, _ = jax.lax.scan(local_step, x_BxLxD, trailing)
        return x_BxLxD

    @staticmethod
    def _state(stack: DecoderLayer | None) -> nnx.State | None:
        return None if stack is None else nnx.state(stack)

    def _scan_step(self, stack, cos_sin, segment_ids_BxL, window):
        if stack is None:
            return None
        graphdef = nnx.graphdef(stack)

        def step(x_BxLxD, layer_state):
            layer = nnx.merge(graphdef, layer_state)
            return layer(x_BxLxD, cos_sin, segment_ids_BxL, window), None

        if self.remat != "none":
            step = jax.checkpoint(step, policy=REMAT_POLICIES[self.remat])
        return step


def count_params(cfg: ModelConfig) -> int:
    """Parameter count from shapes alone (no allocation)."""
    abstract = nnx.eval_shape(lambda: Gemma3(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
