"""The decoder every family is: an embedding, scanned stacks of layers, a final norm and the
output head, laid out as the family's `Stacking` says (models/family.py).

The forward pass is a scan over the blocks, each block running its stacks' layers in order
(a scan over a stack's rows in the block, one row included), then the trailing
stacks' scans; compile time is independent of depth. Each stack's attention window and RoPE are
static, which is what lets cuDNN's flash attention run. The blocks are also what pipeline
stages are cut from: `blocks()` runs whichever blocks this module holds, all of them or one
stage's chunk (parallel/pipeline.py), and `rope`, `embed`, `tail` and `head_losses` are the
other pieces a pipeline stage runs. `model.unroll_layers=true` unrolls the scans: on CPU the
step runs ~1.4x faster (XLA schedules across layers), at a compile time that grows with depth.

Shapes are written into names: B batch, L sequence, D embed, T new tokens, V vocabulary.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import LoraConfig, ModelConfig
from tunix_train.models import kv_cache, layers, lora, moe, rope, router_losses
from tunix_train.models.attention import Attention
from tunix_train.models.family import Architecture, Family
from tunix_train.models.head import VocabChunks
from tunix_train.models.layers import (GATED, PROJECTION, ROUTING_PLAN, Embedder, RMSNorm,
                                       Unembedding, adapted, param, scaled_normal)
from tunix_train.models.partitioning import constrain
from tunix_train.models.params import materialize, never_saving_materialized

# What the backward pass keeps of a layer's forward (`training.remat`). None of them keeps the
# layer's materialized parameters (models/params.py): FSDP gathers them again instead.
REMAT_POLICIES = {name: never_saving_materialized(policy) for name, policy in {
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Matmuls without batch dimensions: the projections (layers.project, named because on CPU
    # a custom VJP hides their dot from the policy) and the output head; attention recomputed.
    # And a mixture's routing plan (models/moe.py: a few integers a token), whose sort and
    # scatters the backward pass would otherwise run again.
    "save_dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(PROJECTION, ROUTING_PLAN)),
}.items()}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), GeGLU or SwiGLU; LoRA adapters where targeted."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, activation: str,
                 lora_cfg: LoraConfig = LoraConfig()):
        D, F = cfg.embed_dim, cfg.hidden_dim
        self.gate = param(scaled_normal(rngs, (D, F), D), "embed", "mlp")
        self.up = param(scaled_normal(rngs, (D, F), D), "embed", "mlp")
        self.down = param(scaled_normal(rngs, (F, D), F), "mlp", "embed")
        self.gated = GATED[activation]
        shapes = {"gate": ((D,), ("embed",), (F,), ("mlp",)),
                  "up": ((D,), ("embed",), (F,), ("mlp",)),
                  "down": ((F,), ("mlp",), (D,), ("embed",))}
        for name, adapter in lora.adapters(lora_cfg, rngs, shapes).items():
            setattr(self, name, adapter)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        gate_BxLxF = adapted(self, "gate", x_BxLxD)
        up_BxLxF = adapted(self, "up", x_BxLxD)
        h_BxLxF = self.gated(gate_BxLxF, up_BxLxF)
        h_BxLxF = constrain(h_BxLxF, ("act_batch", "act_seq", "act_mlp"))
        return adapted(self, "down", h_BxLxF)


class Experts(nnx.Module):
    """A routed layer's MLP (models/moe.py): a router [D, E] picks each token's top-k of E
    gated MLPs, stored stacked [E, …] on the logical axis `experts`; no LoRA adapters."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, activation: str):
        D, F, E = cfg.embed_dim, cfg.expert_hidden_dim, cfg.num_experts
        self.router = param(scaled_normal(rngs, (D, E), D), "embed", "expert_scores")
        self.gate = param(scaled_normal(rngs, (E, D, F), D), "experts", "expert_embed",
                          "expert_mlp")
        self.up = param(scaled_normal(rngs, (E, D, F), D), "experts", "expert_embed",
                        "expert_mlp")
        self.down = param(scaled_normal(rngs, (E, F, D), F), "experts", "expert_mlp",
                          "expert_embed")
        self.gated = GATED[activation]
        self.top_k, self.normalize = cfg.experts_per_token, cfg.normalize_top_k
        self.matmul, self.capacity_factor = cfg.moe_matmul, cfg.moe_capacity_factor
        self.buffer_factor, self.num_experts = cfg.moe_ep_buffer_factor, E
        self.force_balance = cfg.moe_force_load_balance

    def __call__(self, x_BxLxD: jax.Array) -> tuple[jax.Array, router_losses.Statistics]:
        B, L, D = x_BxLxD.shape
        x_TxD = x_BxLxD.reshape(B * L, D)
        routing = moe.route(x_TxD, self.router[...], self.top_k, self.normalize,
                            self.force_balance)
        gate = self.gate[...]  # this device's experts: a shard of them under expert parallelism
        y_TxD = moe.experts_mlp(x_TxD, routing, gate, self.up[...], self.down[...], self.gated,
                                self.matmul, self.capacity_factor, self.buffer_factor)
        blocks = moe.blocks_for(B * L, self.top_k, self.num_experts, gate.shape[0],
                                self.capacity_factor, self.buffer_factor)
        stats = router_losses.statistics(routing, self.capacity_factor, blocks)
        return y_TxD.reshape(B, L, D), stats


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residual adds; with the family's post-norms (Gemma
    2 and 3), each block's output is normalised again before the add. A routed layer's MLP is
    `Experts`, and the layer returns its router statistics beside its output (None otherwise)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, arch: Architecture,
                 lora_cfg: LoraConfig = LoraConfig(), routed: bool = False):
        eps, offset = cfg.rms_norm_eps, arch.norm_offset
        self.pre_attention_norm = RMSNorm(cfg.embed_dim, eps, offset)
        self.attention = Attention(cfg, rngs, arch, lora_cfg)
        self.pre_mlp_norm = RMSNorm(cfg.embed_dim, eps, offset)
        # A mixture of experts' dense layers take no adapters either: PEFT (0.18) gives a
        # Qwen3-MoE's dense MLPs none, so an adapter there would not export.
        self.mlp = (Experts(cfg, rngs, arch.activation) if routed
                    else MLP(cfg, rngs, arch.activation,
                             LoraConfig() if cfg.num_experts else lora_cfg))
        self.routed = routed
        if arch.post_norms:
            self.post_attention_norm = RMSNorm(cfg.embed_dim, eps, offset)
            self.post_mlp_norm = RMSNorm(cfg.embed_dim, eps, offset)
        self.post_norms = arch.post_norms

    def __call__(self, x_BxLxD, cos_sin, segment_ids_BxL, window: int | None
                 ) -> tuple[jax.Array, router_losses.Statistics | None]:
        attn = self.attention(self.pre_attention_norm(x_BxLxD), cos_sin, segment_ids_BxL, window)
        return self._mlp_block(x_BxLxD + self._post(attn, "post_attention_norm"))

    def decode(self, x_BxTxD, cos_sin, positions_BxT, cache: kv_cache.LayerView,
               window: int | None) -> tuple[jax.Array, dict]:
        attn, written = self.attention.decode(self.pre_attention_norm(x_BxTxD), cos_sin,
                                              positions_BxT, cache, window)
        return self._mlp_block(x_BxTxD + self._post(attn, "post_attention_norm"))[0], written

    def _mlp_block(self, x_BxLxD: jax.Array) -> tuple[jax.Array, router_losses.Statistics | None]:
        y_BxLxD, stats = self.mlp(self.pre_mlp_norm(x_BxLxD)), None
        if self.routed:
            y_BxLxD, stats = y_BxLxD
        x_BxLxD = x_BxLxD + self._post(y_BxLxD, "post_mlp_norm")
        return constrain(x_BxLxD, ("act_batch", "act_seq", "act_embed")), stats

    def _post(self, y_BxLxD: jax.Array, norm: str) -> jax.Array:
        return getattr(self, norm)(y_BxLxD) if self.post_norms else y_BxLxD


def _stacked_layers(cfg: ModelConfig, arch: Architecture, lora_cfg: LoraConfig, count: int,
                    rngs: nnx.Rngs, axis: str, routed: bool) -> DecoderLayer:
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(layer_rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, layer_rngs, arch, lora_cfg, routed)

    return make(rngs)


class Decoder(nnx.Module):
    """One family's model. Its stacks are attributes named as the stacking names them (Gemma 3:
    `local_layers`, `global_layers`, `trailing_layers`; Llama and Qwen: `layers`)."""

    def __init__(self, cfg: ModelConfig, family: Family, *, rngs: nnx.Rngs, remat: str = "none",
                 lora_cfg: LoraConfig = LoraConfig()):
        self.cfg = cfg
        self.stacking = family.stacking(cfg)
        self.ropes = family.ropes(cfg)
        self.remat = remat
        arch = family.architecture
        self.embedder = Embedder(cfg, rngs, arch.embed_scale)
        for stack in self.stacking.stacks:
            setattr(self, stack, _stacked_layers(cfg, arch, lora_cfg, self.stacking.count(stack),
                                                 rngs, self.stacking.axis(stack),
                                                 stack in self.stacking.routed))
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.rms_norm_eps, arch.norm_offset)
        if not cfg.tie_embeddings:
            self.head = Unembedding(cfg, rngs)
        self.lora_dropout = lora_cfg.dropout if lora_cfg.on else 0.0

    def __call__(
        self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None,
        segment_ids_BxL: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, L, V] in the parameters' dtype."""
        return self.logits(self.hidden(tokens_BxL, positions_BxL, segment_ids_BxL))

    def token_losses(self, tokens_BxL: jax.Array, targets_BxL: jax.Array,
                     positions_BxL: jax.Array | None = None,
                     segment_ids_BxL: jax.Array | None = None,
                     vocab_chunks: VocabChunks = VocabChunks(),
                     temperature: float = 1.0) -> jax.Array:
        """Next-token cross-entropy [B, L] in fp32, the vocabulary a chunk at a time: minus the
        targets' log-probabilities under softmax(logits / temperature) (the head is linear, so
        dividing its input divides the logits)."""
        return self.losses(tokens_BxL, targets_BxL, positions_BxL, segment_ids_BxL,
                           vocab_chunks, temperature)[0]

    def losses(self, tokens_BxL: jax.Array, targets_BxL: jax.Array,
               positions_BxL: jax.Array | None = None, segment_ids_BxL: jax.Array | None = None,
               vocab_chunks: VocabChunks = VocabChunks(), temperature: float = 1.0
               ) -> tuple[jax.Array, router_losses.Statistics | None]:
        """`token_losses`, and the routed layers' router statistics summed over them (None when
        no layer routes), from which the training loss adds the router's losses
        (models/router_losses.py)."""
        hidden_BxLxD, stats = self._hidden(tokens_BxL, positions_BxL, segment_ids_BxL)
        if temperature != 1.0:
            hidden_BxLxD = hidden_BxLxD / jnp.asarray(temperature, hidden_BxLxD.dtype)
        return self.head_losses(hidden_BxLxD, targets_BxL, vocab_chunks), stats

    def hidden(self, tokens_BxL: jax.Array, positions_BxL: jax.Array | None = None,
               segment_ids_BxL: jax.Array | None = None) -> jax.Array:
        """The final normalised hidden states [B, L, D], the output head's input."""
        return self._hidden(tokens_BxL, positions_BxL, segment_ids_BxL)[0]

    def _hidden(self, tokens_BxL, positions_BxL, segment_ids_BxL):
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(tokens_BxL.shape[1]), tokens_BxL.shape)
        ropes = self.rope(positions_BxL)
        steps = self._scan_steps(ropes, segment_ids_BxL, self.stacking.block_stacks)
        x_BxLxD, ys = self._run_blocks(self.embed(tokens_BxL), steps,
                                       self._layer_xs(self.stacking.block_stacks))
        x_BxLxD, tail_ys = self._tail(x_BxLxD, ropes, segment_ids_BxL)
        return x_BxLxD, router_losses.total([*ys.values(), *tail_ys])

    # The pieces, in order: rope → embed → blocks → tail → head_losses (or logits).

    def rope(self, positions_BxL: jax.Array) -> dict[str, rope.CosSin]:
        """Per stack, the RoPE cos/sin tables [B, L, 1, H] of these positions (a pipeline
        computes them once for all its micro-batches)."""
        return rope.tables(positions_BxL, self.ropes, self.cfg.head_dim)

    def embed(self, tokens_BxL: jax.Array) -> jax.Array:
        x_BxLxD = self.embedder.encode(tokens_BxL)
        return constrain(x_BxLxD, ("act_batch", "act_seq", "act_embed"))

    def blocks(self, x_BxLxD: jax.Array, ropes: dict[str, rope.CosSin],
               segment_ids_BxL: jax.Array | None
               ) -> tuple[jax.Array, router_losses.Statistics | None]:
        """The blocks whose layers this module holds: all of them, or one pipeline stage's
        chunk when the stacks are one (parallel/pipeline.py); and their routed layers' router
        statistics summed (None when none routes)."""
        steps = self._scan_steps(ropes, segment_ids_BxL, self.stacking.block_stacks)
        x_BxLxD, ys = self._run_blocks(x_BxLxD, steps, self._layer_xs(self.stacking.block_stacks))
        return x_BxLxD, router_losses.total(list(ys.values()))

    def tail(self, x_BxLxD: jax.Array, ropes: dict[str, rope.CosSin],
             segment_ids_BxL: jax.Array | None
             ) -> tuple[jax.Array, router_losses.Statistics | None]:
        """The trailing layers and the final norm; their router statistics, as `blocks`."""
        x_BxLxD, ys = self._tail(x_BxLxD, ropes, segment_ids_BxL)
        return x_BxLxD, router_losses.total(ys)

    def _tail(self, x_BxLxD, ropes, segment_ids_BxL) -> tuple[jax.Array, list]:
        stacks, ys = self.stacking.trailing_stacks, []
        steps, xs = self._scan_steps(ropes, segment_ids_BxL, stacks), self._layer_xs(stacks)
        for stack in stacks:
            x_BxLxD, y = jax.lax.scan(steps[stack], x_BxLxD, xs[stack],
                                      unroll=self.cfg.unroll_layers)
            ys.append(y)
        return _materialized(self.final_norm)(x_BxLxD), ys

    def head_losses(self, hidden_BxLxD: jax.Array, targets_BxL: jax.Array,
                    vocab_chunks: VocabChunks = VocabChunks()) -> jax.Array:
        """Cross-entropy [B, L] (fp32) of the output head, fused with it (models/head.py)."""
        return layers.token_losses(hidden_BxLxD, self._head_table(), targets_BxL, vocab_chunks)

    def logits(self, hidden_BxLxD: jax.Array) -> jax.Array:
        return layers.logits(hidden_BxLxD, self._head_table())

    def _head_table(self) -> nnx.Param:
        return (self.embedder if self.cfg.tie_embeddings else self.head).table()

    # Generation with a KV cache.

    def decode(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               cache: kv_cache.Cache) -> tuple[jax.Array, kv_cache.Cache]:
        """Logits [B, T, V] of T new tokens attending to the cache and themselves; the cache
        with the new keys and values written. Positions < 0 mark padding (attends to nothing)."""
        x_BxTxD = self.embed(tokens_BxT)
        ropes = self.rope(positions_BxT)
        steps, xs = {}, {}  # per stack: the scan body, and (layer params, layer caches) to scan
        for stack in self.stacking.stacks:
            steps[stack] = self._decode_step(getattr(self, stack), ropes[stack], positions_BxT,
                                             cache[stack], cache["next"],
                                             self.stacking.window(stack))
            xs[stack] = (nnx.state(getattr(self, stack)), cache[stack]["layers"])
        x_BxTxD, kvs = self._run_blocks(x_BxTxD, steps, xs)
        for stack in self.stacking.trailing_stacks:
            x_BxTxD, kvs[stack] = jax.lax.scan(steps[stack], x_BxTxD, xs[stack])
        logits_BxTxV = self.logits(_materialized(self.final_norm)(x_BxTxD))
        return logits_BxTxV, kv_cache.advance(cache, positions_BxT, kvs)

    def init_cache(self, batch: int, max_len: int, dtype: jnp.dtype) -> kv_cache.Cache:
        """An empty cache for rows of up to `max_len` tokens (prompt and generated together):
        a slot per column for full attention, a ring of `window` slots for a sliding window."""
        cfg, cache = self.cfg, {"next": jnp.zeros((), jnp.int32)}
        for stack in self.stacking.stacks:
            window = self.stacking.window(stack)
            size = max_len if window is None else min(window, max_len)
            cache[stack] = kv_cache.empty(self.stacking.count(stack), batch, size,
                                          cfg.num_kv_heads, cfg.head_dim, dtype)
        return cache

    def _layer_xs(self, stacks) -> dict[str, Any]:
        """Per stack, what its scan runs over: the layers' parameters, and with LoRA dropout
        each layer's index in its stack (every layer draws its own masks)."""
        states = {stack: nnx.state(getattr(self, stack)) for stack in stacks}
        if not self.lora_dropout:
            return states
        return {s: (state, jnp.arange(jax.tree.leaves(state)[0].shape[0], dtype=jnp.uint32))
                for s, state in states.items()}

    def _run_blocks(self, x, steps: dict, xs: dict):
        """Runs the blocks: a scan over blocks, each running its segments in order. `xs`: per
        block stack, per-layer inputs stacked like the layers (parameters, and caches when
        decoding); returns x and per block stack the per-layer outputs, stacked the same way.
        How many blocks there are is read off the stacks (a pipeline stage holds a slice)."""
        stacks = [s for s in self.stacking.block_stacks if s in xs]
        if not stacks:
            return x, {}
        per_block = {s: self.stacking.rows_per_block(s) for s in stacks}
        if len(stacks) == 1 and per_block[stacks[0]] == 1 and not self.cfg.unroll_layers:
            # One scan over the layers: a [blocks, 1, ...] view of the stacks would make XLA
            # copy each whole stack into the loop (a layout change of the size-1 axis).
            x, y = jax.lax.scan(steps[stacks[0]], x, xs[stacks[0]])
            return x, {stacks[0]: y}
        blocks = jax.tree.leaves(xs[stacks[0]])[0].shape[0] // per_block[stacks[0]]
        by_block = {s: jax.tree.map(lambda a, n=per_block[s]: a.reshape(blocks, n, *a.shape[1:]),
                                    xs[s]) for s in stacks}

        def block(x, block_xs):
            ys = {}
            for s in stacks:
                if per_block[s] == 1 and self.cfg.unroll_layers:  # JAX would keep a 1-trip loop
                    x, y = steps[s](x, jax.tree.map(lambda a: a[0], block_xs[s]))
                    ys[s] = jax.tree.map(lambda a: a[None], y)
                else:  # a stack's one row scanned too: the backward pass reads its weights
                    # again from the stack; sliced here, they would be stacked as residuals.
                    x, ys[s] = jax.lax.scan(steps[s], x, block_xs[s],
                                            unroll=self.cfg.unroll_layers)
            return x, ys

        x, ys = jax.lax.scan(block, x, by_block, unroll=self.cfg.unroll_layers)
        return x, {s: jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), y)
                   for s, y in ys.items()}

    def _scan_steps(self, ropes, segment_ids_BxL, stacks) -> dict:
        """The remat'ed scan body of each stack in `stacks`."""
        return {stack: self._scan_step(getattr(self, stack), ropes[stack], segment_ids_BxL,
                                       self.stacking.window(stack), zlib.crc32(stack.encode()))
                for stack in stacks}

    def _scan_step(self, stack, cos_sin, segment_ids_BxL, window, salt: int):
        graphdef = nnx.graphdef(stack)
        numbered = bool(self.lora_dropout)

        def step(x_BxLxD, layer_xs):
            layer_state, index = layer_xs if numbered else (layer_xs, None)
            with lora.folded_in(salt), lora.folded_in(index) if numbered else \
                    contextlib.nullcontext():
                # The collectives: under FSDP this all-gathers the layer's shards, and its
                # backward reduce-scatters the layer's gradient (models/params.py).
                layer = nnx.merge(graphdef, materialize(layer_state))
                return layer(x_BxLxD, cos_sin, segment_ids_BxL, window)  # (x, router stats)

        # prevent_cse=False: the scan already keeps iterations apart.
        return jax.checkpoint(step, policy=REMAT_POLICIES[self.remat], prevent_cse=False)

    @staticmethod
    def _decode_step(stack, cos_sin, positions_BxT, stack_cache, next_column, window):
        graphdef = nnx.graphdef(stack)

        def step(x_BxTxD, xs):
            layer_state, layer_kv = xs
            layer = nnx.merge(graphdef, materialize(layer_state))
            view = kv_cache.LayerView(layer_kv, stack_cache["positions"], next_column)
            return layer.decode(x_BxTxD, cos_sin, positions_BxT, view, window)

        return step


def _materialized(module: nnx.Module) -> nnx.Module:
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, materialize(state))
