"""The Gemma 3 decoder with scanned layers.

Gemma 3 interleaves local (sliding-window, RoPE base 10k) and global (full causal, RoPE base 1M)
layers, one global after every `global_every - 1` local ones. The layers are kept in three
stacks, so that each kind's attention is static (a fixed window is what lets cuDNN's flash
attention run): the locals and the globals of the repeating [locals..., global] blocks, and the
locals that trail the last block (gemma3_1b: 4 blocks of 6 layers, then 2). The forward pass is
a scan over the blocks followed by a scan over the trailing locals, so compile time is
independent of depth; the blocks are also what pipeline stages are cut from (parallel/
pipeline.py), which is why the trailing locals have a stack of their own.
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
from tunix_train.models.layers import PROJECTION, DecoderLayer, Embedder, RMSNorm, rope_tables
from tunix_train.models.params import materialize, never_saving_materialized
from tunix_train.models.partitioning import constrain

# What the backward pass keeps of a layer's forward (`training.remat`). None of them keeps the
# layer's materialized parameters (models/params.py): FSDP gathers them again instead.
REMAT_POLICIES = {name: never_saving_materialized(policy) for name, policy in {
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Matmuls without batch dimensions: the projections (layers.project, named because on CPU
    # a custom VJP hides their dot from the policy) and the output head; attention recomputed.
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(PROJECTION)),
}.items()}


LAYERS = "layers"  # logical axis of a scanned stack of block layers (pipeline stages cut it)
TRAILING = "trailing_layers"  # logical axis of the stack of locals after the last block
KINDS = ("local", "global", "trailing")  # the stacks, as named in caches and placements


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

    def count(self, kind: str) -> int:
        """Layers in one stack: "local" (of the blocks), "global" or "trailing"."""
        return {"local": self.num_blocks * self.locals_per_block, "global": self.num_blocks,
                "trailing": self.trailing_locals}[kind]

    def placement(self) -> list[tuple[str, int]]:
        """For each layer in order: (its stack in KINDS, its index inside that stack)."""
        counts, out = dict.fromkeys(KINDS, 0), []
        period = self.locals_per_block + 1
        for layer in range(self.num_blocks * period + self.trailing_locals):
            kind = ("trailing" if layer >= self.num_blocks * period else
                    "global" if layer % period == period - 1 else "local")
            out.append((kind, counts[kind]))
            counts[kind] += 1
        return out


def _stacked_layers(cfg: ModelConfig, count: int, rngs: nnx.Rngs,
                    axis: str = LAYERS) -> DecoderLayer | None:
    if count == 0:
        return None

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(layer_rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, layer_rngs)

    return make(rngs)


class Gemma3(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat: str = "none"):
        self.cfg = cfg
        self.layout = LayerLayout.of(cfg)
        self.remat = remat
        self.embedder = Embedder(cfg, rngs)
        self.local_layers = _stacked_layers(cfg, self.layout.count("local"), rngs)
        self.global_layers = _stacked_layers(cfg, self.layout.count("global"), rngs)
        self.trailing_layers = _stacked_layers(cfg, self.layout.count("trailing"), rngs, TRAILING)
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
        ropes = self.rope(positions_BxL)
        x_BxLxD = self.blocks(self.embed(tokens_BxL), ropes, segment_ids_BxL)
        return self.tail(x_BxLxD, ropes, segment_ids_BxL)

    def embed(self, tokens_BxL: jax.Array) -> jax.Array:
        x_BxLxD = self.embedder.encode(tokens_BxL)
        return constrain(x_BxLxD, ("act_batch", "act_seq", "act_embed"))

    def blocks(self, x_BxLxD: jax.Array, ropes: dict[str, tuple],
               segment_ids_BxL: jax.Array | None) -> jax.Array:
        """The [locals..., global] blocks whose layers this module holds: all of them, or one
        pipeline stage's chunk when the stacks are one (parallel/pipeline.py). `ropes`:
        `rope(positions)`, which a pipeline computes once for all its micro-batches."""
        steps = self._scan_steps(ropes, segment_ids_BxL, ("local", "global"))
        x_BxLxD, _ = self._run_blocks(x_BxLxD, steps, self._states(("local", "global")))
        return x_BxLxD

    def tail(self, x_BxLxD: jax.Array, ropes: dict[str, tuple],
             segment_ids_BxL: jax.Array | None) -> jax.Array:
        """The trailing locals and the final norm."""
        if self.trailing_layers is not None:
            step = self._scan_steps(ropes, segment_ids_BxL, ("trailing",))["trailing"]
            x_BxLxD, _ = jax.lax.scan(step, x_BxLxD, nnx.state(self.trailing_layers),
                                      unroll=self.cfg.unroll_layers)
        return _materialized(self.final_norm)(x_BxLxD)

    def decode(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               cache: kv_cache.Cache) -> tuple[jax.Array, kv_cache.Cache]:
        """Logits [B, T, V] of T new tokens attending to the cache and themselves; the cache
        with the new keys and values written. Positions < 0 mark padding (attends to nothing)."""
        x_BxTxD = self.embed(tokens_BxT)
        ropes = self.rope(positions_BxT)
        steps, xs = {}, {}  # per stack: the scan body, and (layer params, layer caches) to scan
        for kind in KINDS:
            stack = self._stack(kind)
            if stack is not None:
                window = None if kind == "global" else self.cfg.sliding_window
                steps[kind] = self._decode_step(stack, ropes[kind], positions_BxT, cache[kind],
                                                cache["next"], window)
                xs[kind] = (nnx.state(stack), cache[kind]["layers"])
        x_BxTxD, kvs = self._run_blocks(x_BxTxD, steps, xs)
        if "trailing" in steps:
            x_BxTxD, kvs["trailing"] = jax.lax.scan(steps["trailing"], x_BxTxD, xs["trailing"])
        logits_BxTxV = self.embedder.decode(_materialized(self.final_norm)(x_BxTxD))
        return logits_BxTxV, kv_cache.advance(cache, positions_BxT, kvs)

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype) -> kv_cache.Cache:
        """An empty cache for rows of up to `max_len` tokens (prompt and generated together)."""
        cfg, layout = self.cfg, self.layout
        cache = {"next": jnp.zeros((), jnp.int32)}
        for kind in KINDS:
            size = max_len if kind == "global" else min(cfg.sliding_window, max_len)
            if layout.count(kind):
                cache[kind] = kv_cache.empty(layout.count(kind), batch, size, cfg.num_kv_heads,
                                             cfg.head_dim, dtype)
        return cache

    def _stack(self, kind: str) -> DecoderLayer | None:
        return getattr(self, f"{kind}_layers")

    def _states(self, kinds) -> dict[str, nnx.State]:
        return {kind: nnx.state(self._stack(kind)) for kind in kinds
                if self._stack(kind) is not None}

    def rope(self, positions_BxL: jax.Array) -> dict[str, tuple]:
        """Per stack kind, the RoPE cos/sin tables [B, L, 1, H] of these positions.

        Both kinds' tables come out of one loop (over their base and scale) rather than two
        expressions: XLA's CPU backend fuses a cos/sin expression into each consumer, which
        recomputes it per layer, per head and per pipeline iteration (180 sine fusions in one
        pipelined step of bench/pipeline_bubble.py, 40 in an 8-layer unrolled step); a loop's
        outputs are computed once and read by all."""
        cfg = self.cfg
        bases = jnp.array([cfg.local_rope_base, cfg.global_rope_base], jnp.float32)
        scales = jnp.array([1.0, cfg.global_rope_scale], jnp.float32)
        _, (cos, sin) = jax.lax.scan(
            lambda _, base_scale: (None, rope_tables(positions_BxL, cfg.head_dim, *base_scale)),
            None, (bases, scales))
        local = (cos[0], sin[0])
        return {"local": local, "trailing": local, "global": (cos[1], sin[1])}

    def _run_blocks(self, x, steps: dict, xs: dict):
        """Runs the [locals..., global] blocks: a scan over blocks, each a scan over its locals
        then its global. `xs`: per stack, per-layer inputs stacked like the layers (parameters,
        and caches when decoding); returns x and per stack the per-layer outputs, stacked the
        same way. How many blocks there are is read off the global stack (a pipeline stage
        holds a slice of it)."""
        if "global" not in xs:
            return x, {}
        blocks = jax.tree.leaves(xs["global"])[0].shape[0]
        per_block = self.layout.locals_per_block
        local_xs = jax.tree.map(lambda a: a.reshape(blocks, per_block, *a.shape[1:]),
                                xs.get("local"))

        def block(x, block_xs):
            local_ys = None
            if per_block:
                x, local_ys = jax.lax.scan(steps["local"], x, block_xs[0],
                                           unroll=self.cfg.unroll_layers)
            x, global_ys = steps["global"](x, block_xs[1])
            return x, (local_ys, global_ys)

        x, (local_ys, global_ys) = jax.lax.scan(block, x, (local_xs, xs["global"]),
                                               unroll=self.cfg.unroll_layers)
        ys = {"global": global_ys}
        if per_block:
            ys["local"] = jax.tree.map(lambda a: a.reshape(blocks * per_block, *a.shape[2:]),
                                       local_ys)
        return x, ys

    def _scan_steps(self, ropes, segment_ids_BxL, kinds) -> dict:
        """The remat'ed scan body of each stack in `kinds` that has layers."""
        steps = {}
        for kind in kinds:
            stack = self._stack(kind)
            if stack is None:
                continue
            window = None if kind == "global" else self.cfg.sliding_window
            steps[kind] = self._scan_step(stack, ropes[kind], segment_ids_BxL, window)
        return steps

    def _scan_step(self, stack, cos_sin, segment_ids_BxL, window):
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
