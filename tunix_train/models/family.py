"""The model interface: what a family (Gemma 3, Llama 3, Qwen 3) says about itself, and what the
rest of the package may rely on. `parallel/`, `training/`, `inference/` and `analysis/` see a
model only through this module, `models/families.py` and `models/decoder.py`; none of them names
a family or a family's layers.

A model is an embedding, then `num_blocks` identical blocks, then trailing layers, a final norm
and the output head. A block is a fixed sequence of layers, each taken from a *stack*: the
layers of one kind (same attention window and RoPE), stored stacked on a leading axis and run by
a scan. Gemma 3's block is five local (sliding-window) layers from the stack `local_layers` and
one global layer from `global_layers`, and the local layers left after the last whole block form
the stack `trailing_layers`; a Llama or Qwen block is one layer of the stack `layers`; a
mixture-of-experts model keeps its routed layers (`Stacking.routed`) in stacks of their own,
apart from its dense ones, so each stack's layers stay alike. Pipeline
stages are cut from whole blocks (parallel/stages.py), FSDP gathers one layer of a stack at a
time (parallel/collectives.py), and the KV cache holds one entry per stack (models/kv_cache.py).

A family also decides what its layers are made of (`Architecture`: norm style, post-norms,
activation, q/k norms, embedding scale), its RoPE per stack, and how its Hugging Face
checkpoints are named (`HfNames`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.models.hf_axes import (EXPERTS_TRANSPOSE, HEADS_IN, HEADS_OUT, MATRIX,
                                            TRANSPOSE, VECTOR, AxisMap)

LAYERS = "layers"  # logical axis of a stack of block layers (pipeline stages cut it)
TRAILING = "trailing_layers"  # logical axis of a stack of layers after the last block


@dataclass(frozen=True)
class Segment:
    """`count` consecutive layers of a block, or of the trailing layers, from `stack`."""

    stack: str
    count: int


@dataclass(frozen=True)
class Stacking:
    """How a model's layers split into blocks of stacks, and the trailing layers."""

    block: tuple[Segment, ...]  # one block, in order; each stack at most once
    num_blocks: int
    trailing: tuple[Segment, ...] = ()  # after the last block, in order
    windows: tuple[tuple[str, int], ...] = ()  # (stack, sliding window); others: full causal
    routed: tuple[str, ...] = ()  # stacks whose MLP is routed experts (models/moe.py)

    def window(self, stack: str) -> int | None:
        """Tokens a layer of `stack` attends to, itself included; None: all before it."""
        return dict(self.windows).get(stack)

    @property
    def block_stacks(self) -> tuple[str, ...]:
        """The stacks blocks are made of (what pipeline stages cut), in block order."""
        return tuple(s.stack for s in self.block if s.count) if self.num_blocks else ()

    @property
    def trailing_stacks(self) -> tuple[str, ...]:
        return tuple(s.stack for s in self.trailing if s.count)

    @property
    def stacks(self) -> tuple[str, ...]:
        """Every stack that has layers: the blocks' and then the trailing ones."""
        return self.block_stacks + self.trailing_stacks

    def rows_per_block(self, stack: str) -> int:
        return sum(s.count for s in self.block if s.stack == stack)

    def count(self, stack: str) -> int:
        """Layers in `stack`."""
        trailing = sum(s.count for s in self.trailing if s.stack == stack)
        return self.num_blocks * self.rows_per_block(stack) + trailing

    @property
    def layers_per_block(self) -> int:
        return sum(s.count for s in self.block)

    @property
    def trailing_layers(self) -> int:
        return sum(s.count for s in self.trailing)

    @property
    def num_layers(self) -> int:
        return self.num_blocks * self.layers_per_block + self.trailing_layers

    def axis(self, stack: str) -> str:
        """The logical axis of a stack's leading (layer) dimension."""
        return LAYERS if stack in self.block_stacks else TRAILING

    def placement(self) -> list[tuple[str, int]]:
        """For each layer in model order: (its stack, its index inside that stack)."""
        seen: dict[str, int] = {}
        out = []
        segments = [*[s for _ in range(self.num_blocks) for s in self.block], *self.trailing]
        for segment in segments:
            for _ in range(segment.count):
                index = seen.get(segment.stack, 0)
                out.append((segment.stack, index))
                seen[segment.stack] = index + 1
        return out


@dataclass(frozen=True)
class Architecture:
    """What a family's layers are made of; the shared layers (models/layers.py) read it."""

    norm_offset: float  # RMSNorm multiplies by (offset + scale): Gemma 1 (scale starts at 0), else 0
    post_norms: bool  # norms after attention and MLP too, before the residual add (Gemma 2, 3)
    qk_norm: bool  # per-head RMSNorm of queries and keys before RoPE (Gemma 3, Qwen 3)
    activation: str  # of the gated MLP: "gelu_tanh" (GeGLU) | "silu" (SwiGLU)
    embed_scale: bool  # embeddings multiplied by sqrt(embed_dim) (Gemma)


@dataclass(frozen=True)
class Rope:
    """One RoPE: inverse frequencies 1 / base^(2i/H), then scaled (models/rope.py)."""

    base: float
    factor: float = 1.0  # 1 = unscaled
    kind: str = "linear"  # linear (positions / factor) | llama3 (by wavelength, Llama 3.1+)
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class HfTensor:
    """One Hugging Face tensor: its name (after the model's prefix, e.g. "model.", unless
    `top` says it sits at the top, like an untied `lm_head.weight`) and how it maps onto ours
    (hf_axes.AxisMap)."""

    name: str  # "{j}" in it: one tensor per expert j, the rows of our leaf's expert axis
    axes: AxisMap
    top: bool = False
    half: int | None = None  # of a fused tensor (gate_up_proj): which half of its axis 1


class Family:
    """A model family; one instance per family, registered in models/families.py."""

    name: str = ""
    architecture: Architecture
    display: str = ""  # the family's name in sentences ("Gemma 3")
    model_types: tuple[str, ...] = ()  # config.json's `model_type` values it reads
    architectures: tuple[str, ...] = ()  # config.json's `architectures` it writes
    chat_turn: str = "{prompt}"  # one user turn and the model's cue (data.chat_template=true)
    end_turn: str = ""  # what closes the model's turn (chat messages of preference pairs)

    def stacking(self, model: ModelConfig) -> Stacking:
        raise NotImplementedError

    def ropes(self, model: ModelConfig) -> dict[str, Rope]:
        """The RoPE of each stack."""
        raise NotImplementedError

    def check(self, model: ModelConfig) -> None:
        """Refuses settings this family does not have (one sentence naming the key)."""

    # Hugging Face: config.json and tensor names (models/hf_config.py and hf_weights.py).
    def hf_defaults(self) -> dict[str, Any]:
        """transformers' defaults for the config.json keys `from_hf` reads."""
        raise NotImplementedError

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig fields of a config.json (with `hf_defaults` filled in)."""
        raise NotImplementedError

    def to_hf(self, model: ModelConfig) -> dict[str, Any]:
        """config.json for `model` (token ids are added by the caller)."""
        raise NotImplementedError

    def hf_top_level(self, model: ModelConfig) -> dict[tuple, HfTensor]:
        """Our leaf path → HF tensor, outside the layers."""
        raise NotImplementedError

    def hf_per_layer(self, model: ModelConfig) -> dict[tuple, HfTensor]:
        """Our leaf path inside a layer → HF tensor name after `layers.<i>.`."""
        raise NotImplementedError

    def hf_layer(self, model: ModelConfig, stack: str, fused: bool) -> dict[tuple, HfTensor]:
        """`hf_per_layer` for a layer of `stack`; `fused`: the checkpoint holds each layer's
        experts in one tensor per projection, not one per expert (`hf_fused`)."""
        return self.hf_per_layer(model)

    def hf_fused(self, names) -> bool:
        """Whether a checkpoint with these tensor names stores its experts fused."""
        return False

    default_token_ids: dict[str, int] = {}


def refuse_unsupported(hf: dict[str, Any], unsupported: tuple[tuple[str, Any], ...],
                       family: str) -> None:
    """config.json keys whose values this implementation does not support, by name."""
    for key, supported in unsupported:
        if hf.get(key, supported) != supported:
            raise ConfigError(
                f"model.init_from: config.json has {key}={hf[key]!r}, which this {family} "
                f"implementation does not support (it needs {supported!r}).")


# Tensor names all three families share, inside `layers.<i>.` (our path → HF).
ATTENTION_AND_MLP = {
    ("attention", "q"): HfTensor("self_attn.q_proj.weight", HEADS_OUT),
    ("attention", "k"): HfTensor("self_attn.k_proj.weight", HEADS_OUT),
    ("attention", "v"): HfTensor("self_attn.v_proj.weight", HEADS_OUT),
    ("attention", "o"): HfTensor("self_attn.o_proj.weight", HEADS_IN),
    ("mlp", "gate"): HfTensor("mlp.gate_proj.weight", TRANSPOSE),
    ("mlp", "up"): HfTensor("mlp.up_proj.weight", TRANSPOSE),
    ("mlp", "down"): HfTensor("mlp.down_proj.weight", TRANSPOSE),
    ("pre_attention_norm", "scale"): HfTensor("input_layernorm.weight", VECTOR),
}
QK_NORMS = {
    ("attention", "q_norm", "scale"): HfTensor("self_attn.q_norm.weight", VECTOR),
    ("attention", "k_norm", "scale"): HfTensor("self_attn.k_norm.weight", VECTOR),
}
EMBEDDING_AND_NORM = {
    ("embedder", "embedding"): HfTensor("embed_tokens.weight", MATRIX),
    ("final_norm", "scale"): HfTensor("norm.weight", VECTOR),
}
UNTIED_HEAD = {("head", "weight"): HfTensor("lm_head.weight", MATRIX, top=True)}


def rope_parameters(hf: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """A config.json's RoPE settings in the newer style (`rope_parameters`, per layer type
    where it has them), from the legacy one (`rope_theta` + `rope_scaling`) where it has not."""
    params = hf.get("rope_parameters")
    if params and layer_type is not None and layer_type in params:
        return params[layer_type]
    if params and "rope_theta" in params:
        return params
    return {"rope_theta": hf["rope_theta"], **(hf.get("rope_scaling") or {})}


def rope_kind(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


# ---------------------------------------------------------------------------------------------
# Mixtures of experts (Qwen 3 MoE, Mixtral): what such a family adds to a dense one.

DENSE_LAYERS = "dense_layers"  # a mixture's dense layers between routed ones (stack `layers`)
FUSED_EXPERTS = {  # transformers 5 in memory: [E, 2F, D] (gate first) and [E, D, F]
    ("mlp", "gate"): HfTensor("mlp.experts.gate_up_proj", EXPERTS_TRANSPOSE, half=0),
    ("mlp", "up"): HfTensor("mlp.experts.gate_up_proj", EXPERTS_TRANSPOSE, half=1),
    ("mlp", "down"): HfTensor("mlp.experts.down_proj", EXPERTS_TRANSPOSE),
    ("mlp", "router"): HfTensor("mlp.gate.weight", TRANSPOSE),
}


class RoutedExperts:
    """Mixed into a dense family: layer i routes through experts when i + 1 is a multiple of
    `model.moe_every` (1: every layer). Routed layers are the stack `layers`; with moe_every =
    n > 1 a block is n - 1 dense layers (`dense_layers`) then a routed one, and the layers
    after the last routed one are `trailing_layers`. `per_expert` names a routed layer's
    router and experts as the Hub's files hold them (`{j}`: the expert); `FUSED_EXPERTS` as
    transformers 5 keeps them in memory."""

    per_expert: dict[tuple, HfTensor] = {}

    def stacking(self, model: ModelConfig) -> Stacking:
        n = model.moe_every
        if model.num_experts == 0:
            return super().stacking(model)  # type: ignore[misc]
        if n == 1:
            return Stacking(block=(Segment(LAYERS, 1),), num_blocks=model.num_layers,
                               routed=(LAYERS,))
        return Stacking(block=(Segment(DENSE_LAYERS, n - 1), Segment(LAYERS, 1)),
                           num_blocks=model.num_layers // n,
                           trailing=(Segment(TRAILING, model.num_layers % n),),
                           routed=(LAYERS,))

    def ropes(self, model: ModelConfig) -> dict[str, Rope]:
        rope = super().ropes(model)[LAYERS]  # type: ignore[misc]
        return {stack: rope for stack in (LAYERS, DENSE_LAYERS, TRAILING)}

    def check(self, model: ModelConfig) -> None:
        super().check(model)  # type: ignore[misc]
        if not model.num_experts:
            return
        if not 0 < model.moe_every <= model.num_layers:
            raise ConfigError(f"model.moe_every={model.moe_every}: a routed layer comes every "
                              f"moe_every layers; use 1 to {model.num_layers} (num_layers).")
        if not 0 < model.experts_per_token <= model.num_experts:
            raise ConfigError(f"model.experts_per_token={model.experts_per_token}: each token "
                              f"goes to between 1 and num_experts ({model.num_experts}) experts.")
        if model.expert_hidden_dim <= 0:
            raise ConfigError(f"model.expert_hidden_dim={model.expert_hidden_dim}: set each "
                              f"expert's MLP width (HF moe_intermediate_size), e.g. 768.")

    def hf_layer(self, model: ModelConfig, stack: str, fused: bool) -> dict[tuple, HfTensor]:
        tensors = self.hf_per_layer(model)  # type: ignore[attr-defined]
        if stack not in self.stacking(model).routed:
            return tensors
        tensors = {p: t for p, t in tensors.items() if p[0] != "mlp"}
        return {**tensors, **(FUSED_EXPERTS if fused else self.per_expert)}

    def hf_fused(self, names) -> bool:
        return any(name.endswith(FUSED_EXPERTS[("mlp", "gate")].name) for name in names)
