"""The Gemma 3 decoder with scanned layers.

Gemma 3 interleaves local (sliding-window, RoPE base 10k) and global (full causal, RoPE base 1M)
layers, one global after every `global_every - 1` local ones. The two kinds are kept in two
stacks so that each kind's attention is static (a fixed window is what lets cuDNN's flash
attention run), and the forward pass is a scan over blocks of [locals..., global] followed by a
scan over the trailing locals. Compile time is therefore independent of depth.
`model.unroll_layers=true` unrolls those scans: on CPU the step runs ~1.4x faster (XLA
schedules across layers), at a compile time that grows with depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import ModelConfig
from tunix_train.models import kv_cache
from tunix_train.models.head import VocabChunks
from tunix_train.models.layers import DecoderLayer, Embedder, RMSNorm, rope_tables
from tunix_train.models.params import materialize, never_saving_materialized
from tunix_train.models.partitioning import constrain

# What the backward pass keeps of a layer's forward (`training.remat`). None of them keeps the
# layer's materialized parameters (models/params.py): FSDP gathers them again instead.
REMAT_POLICIES = {name: never_saving_materialized(policy) for name, policy in {
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}.items()}


LAYERS = "layers"  # logical axis of a scanned stack of layers


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
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
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
        return self.embedder.decode(self.hidden(tokens_BxL, positions_BxL, segment_ids_BxL))

    def token_losses(self, tokens_BxL: jax.Array, targets_BxL: jax.Array,
                     positions_BxL: jax.Array | None = None,
                     segment_ids_BxL: jax.Array | None = None,
                     vocab_chunks: VocabChunks = VocabChunks(),
                     temperature: float = 1.0) -> jax.Array:
        """Next-token cross-entropy [B, L] in fp32, the vocabulary a chunk at a time: minus the
        targets' log-probabilities under softmax(logits / temperature) (the head is linear, so
        dividing its input divides the logits)."""
        hidden_BxLxD = self.hidden(tokens_BxL, positions_BxL, segment_ids_BxL)
        if temperature != 1.0:
            hidden_BxLxD = hidden_BxLxD / jnp.asarray(temperature, hidden_BxLxD.dtype)
        return self.embedder.token_losses(hidden_BxLxD, targets_BxL, vocab_chunks)

    def hidden(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None,
               segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        """The final normalised hidden states [B, L, D], the output head's input."""
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
        x_BxLxD = self.embedder.encode(tokens_BxL)
        x_BxLxD = constrain(x_BxLxD, ("act_batch", "act_seq", "act_embed"))
        local_rope, global_rope = self._rope(positions_BxL)
        local_step = self._scan_step(self.local_layers, local_rope, segment_ids_BxL,
                                     self.cfg.sliding_window)
        global_step = self._scan_step(self.global_layers, global_rope, segment_ids_BxL, None)
        x_BxLxD, _, _ = self._run_layers(x_BxLxD, local_step, global_step,
                                         self._state(self.local_layers),
                                         self._state(self.global_layers))
        return _materialized(self.final_norm)(x_BxLxD)

    def decode(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               cache: kv_cache.Cache) -> tuple[jax.Array, kv_cache.Cache]:
        """Logits [B, T, V] of T new tokens attending to the cache and themselves; the cache
        with the new keys and values written. Positions < 0 mark padding (attends to nothing)."""
        x_BxTxD = self.embedder.encode(tokens_BxT)
        x_BxTxD = constrain(x_BxTxD, ("act_batch", "act_seq", "act_embed"))
        local_rope, global_rope = self._rope(positions_BxT)
        steps, xs = [], []  # per kind: the scan body, and (layer params, layer caches) to scan
        for kind, stack, rope, window in (
                ("local", self.local_layers, local_rope, self.cfg.sliding_window),
                ("global", self.global_layers, global_rope, None)):
            present = stack is not None
            steps.append(self._decode_step(stack, rope, positions_BxT, cache[kind],
                                           cache["next"], window) if present else None)
            xs.append((nnx.state(stack), cache[kind]["layers"]) if present else None)
        x_BxTxD, local_kv, global_kv = self._run_layers(x_BxTxD, *steps, *xs)
        logits_BxTxV = self.embedder.decode(_materialized(self.final_norm)(x_BxTxD))
        return logits_BxTxV, kv_cache.advance(cache, positions_BxT, local_kv, global_kv)

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype) -> kv_cache.Cache:
        """An empty cache for rows of up to `max_len` tokens (prompt and generated together)."""
        cfg, layout = self.cfg, self.layout
        cache = {"next": jnp.zeros((), jnp.int32)}
        for kind, count, size in (("local", layout.num_local, min(cfg.sliding_window, max_len)),
                                  ("global", layout.num_global, max_len)):
            if count:
                cache[kind] = kv_cache.empty(count, batch, size, cfg.num_kv_heads, cfg.head_dim,
                                             dtype)
        return cache

    def _rope(self, positions_BxL: jax.Array):
        cfg = self.cfg
        return (rope_tables(positions_BxL, cfg.head_dim, cfg.local_rope_base, 1.0),
                rope_tables(positions_BxL, cfg.head_dim, cfg.global_rope_base,
                            cfg.global_rope_scale))

    def _run_layers(self, x, local_step, global_step, local_xs, global_xs):
        """Runs every layer in Gemma's order: a scan over [locals..., global] blocks, then a scan
        over the trailing locals. `*_xs` are per-layer inputs stacked like the layers (parameters,
        and caches when decoding); returns x and the per-layer outputs, stacked the same way."""
        layout = self.layout
        n_blocked = layout.num_blocks * layout.locals_per_block
        local_ys = global_ys = None
        if layout.num_blocks:
            blocked = jax.tree.map(
                lambda a: a[:n_blocked].reshape(layout.num_blocks, layout.locals_per_block,
                                                *a.shape[1:]), local_xs)

            def block(x, xs):
                ys = None
                if layout.locals_per_block:
                    x, ys = jax.lax.scan(local_step, x, xs[0], unroll=self.cfg.unroll_layers)
                x, global_ys = global_step(x, xs[1])
                return x, (ys, global_ys)

            x, (local_ys, global_ys) = jax.lax.scan(block, x, (blocked, global_xs),
                                                   unroll=self.cfg.unroll_layers)
            local_ys = jax.tree.map(lambda a: a.reshape(n_blocked, *a.shape[2:]), local_ys)
        if layout.trailing_locals:
            trailing = jax.tree.map(lambda a: a[n_blocked:], local_xs)
            x, trailing_ys = jax.lax.scan(local_step, x, trailing,
                                          unroll=self.cfg.unroll_layers)
            local_ys = trailing_ys if local_ys is None else jax.tree.map(
                lambda a, b: jnp.concatenate([a, b]), local_ys, trailing_ys)
        return x, local_ys, global_ys

    @staticmethod
    def _state(stack: DecoderLayer | None) -> nnx.State | None:
        return None if stack is None else nnx.state(stack)

    def _scan_step(self, stack, cos_sin, segment_ids_BxL, window):
        if stack is None:
            return None
        graphdef = nnx.graphdef(stack)

        def step(x_BxLxD, layer_state):
            layer = nnx.merge(graphdef, materialize(layer_state))
            return layer(x_BxLxD, cos_sin, segment_ids_BxL, window), None

        # prevent_cse=False: the scan already keeps iterations apart.
        return jax.checkpoint(step, policy=REMAT_POLICIES[self.remat], prevent_cse=False)

    @staticmethod
    def _decode_step(stack, cos_sin, positions_BxT, kind_cache, next_column, window):
        graphdef = nnx.graphdef(stack)

        def step(x_BxTxD, xs):
            layer_state, layer_kv = xs
            layer = nnx.merge(graphdef, materialize(layer_state))
            view = kv_cache.LayerView(layer_kv, kind_cache["positions"], next_column)
            return layer.decode(x_BxTxD, cos_sin, positions_BxT, view, window)

        return step


def _materialized(module: nnx.Module) -> nnx.Module:
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, materialize(state))


def count_params(cfg: ModelConfig) -> int:
    """Parameter count from shapes alone (no allocation)."""
    abstract = nnx.eval_shape(lambda: Gemma3(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
