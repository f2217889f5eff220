"""Llama 3 (3.1, 3.2, 3.3 dense): the family's layout, layers and Hugging Face names.

Every layer is the same (full causal attention), so a block is one layer and there is one
stack, `layers`. RMSNorm multiplies by its scale (which starts at 1), a norm before attention
and one before the MLP and none after, SwiGLU, grouped-query attention without biases, RoPE
with base 500,000 and, from 3.1, the `llama3` frequency scaling (models/rope.py); the output
head is tied to the embedding for 3.2 1B/3B and a weight of its own for 8B.

Hugging Face: `LlamaForCausalLM`. HF's `post_attention_layernorm` is the norm before the MLP
(our `pre_mlp_norm`); its q/k projections are already in rotate-half order, which is ours.
"""

from __future__ import annotations

from typing import Any

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.models import family
from tunix_train.models.family import (ATTENTION_AND_MLP, EMBEDDING_AND_NORM, UNTIED_HEAD,
                                       Architecture, HfTensor, Rope, Segment, Stacking)
from tunix_train.models.hf_axes import VECTOR

STACK = "layers"

# LlamaConfig's defaults, for keys a checkpoint's config.json leaves out (head_dim and
# num_key_value_heads default to hidden_size / num_attention_heads and num_attention_heads).
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 11_008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0, "hidden_act": "silu", "tie_word_embeddings": False,
}

# Our key ← config.json key, for the dimensions taken over one to one.
_DIRECT = {
    "vocab_size": "vocab_size", "embed_dim": "hidden_size", "hidden_dim": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
}

_UNSUPPORTED = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))


class Llama3(family.Family):
    name = "llama3"
    display = "Llama 3"
    architecture = Architecture(norm_offset=0.0, post_norms=False, qk_norm=False,
                                activation="silu", embed_scale=False)
    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
    default_token_ids = {"bos_token_id": 128_000, "eos_token_id": 128_001}
    chat_turn = ("<|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n")
    end_turn = "<|eot_id|>"
    unsupported = _UNSUPPORTED

    def stacking(self, model: ModelConfig) -> Stacking:
        return Stacking(block=(Segment(STACK, 1),), num_blocks=model.num_layers)

    def ropes(self, model: ModelConfig) -> dict[str, Rope]:
        return {STACK: Rope(model.global_rope_base, model.global_rope_scale, model.rope_type,
                            model.rope_low_freq_factor, model.rope_high_freq_factor,
                            model.rope_original_context)}

    def check(self, model: ModelConfig) -> None:
        if model.query_pre_attn_scalar is not None:
            raise ConfigError(f"model.query_pre_attn_scalar={model.query_pre_attn_scalar}: "
                              f"{self.display} scales attention by head_dim^-1/2; leave it null.")

    def hf_defaults(self) -> dict[str, Any]:
        return _HF_DEFAULTS

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        family.refuse_unsupported(hf, self.unsupported, self.display)
        hf = {**hf, "head_dim": hf.get("head_dim") or
              hf["hidden_size"] // hf["num_attention_heads"],
              "num_key_value_heads": hf.get("num_key_value_heads") or
              hf["num_attention_heads"]}
        fields = {ours: hf[theirs] for ours, theirs in _DIRECT.items()}
        fields.update(_rope(family.rope_parameters(hf)), query_pre_attn_scalar=None)
        return fields

    def to_hf(self, model: ModelConfig) -> dict[str, Any]:
        config = {theirs: getattr(model, ours) for ours, theirs in _DIRECT.items()}
        rope = {"rope_type": "default", "rope_theta": model.global_rope_base}
        if model.global_rope_scale != 1.0:
            rope.update(rope_type=model.rope_type, factor=model.global_rope_scale)
            if model.rope_type == "llama3":
                rope.update(low_freq_factor=model.rope_low_freq_factor,
                            high_freq_factor=model.rope_high_freq_factor,
                            original_max_position_embeddings=model.rope_original_context)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        config.update(model_type=self.model_types[0], hidden_act="silu", attention_bias=False,
                      rope_parameters=rope, rope_theta=model.global_rope_base,
                      rope_scaling=scaling if model.global_rope_scale != 1.0 else None,
                      max_position_embeddings=131_072, **self.extra_hf(model))
        return config

    def extra_hf(self, model: ModelConfig) -> dict[str, Any]:
        return {"mlp_bias": False}

    def hf_top_level(self, model: ModelConfig) -> dict[tuple, HfTensor]:
        return {**EMBEDDING_AND_NORM, **({} if model.tie_embeddings else UNTIED_HEAD)}

    def hf_per_layer(self, model: ModelConfig) -> dict[tuple, HfTensor]:
        return {**ATTENTION_AND_MLP,
                ("pre_mlp_norm", "scale"): HfTensor("post_attention_layernorm.weight", VECTOR)}


def _rope(params: dict[str, Any]) -> dict[str, Any]:
    """Our RoPE keys from a config.json's (newer-style) RoPE parameters."""
    kind = family.rope_kind(params)
    fields = {"global_rope_base": float(params["rope_theta"]), "global_rope_scale": 1.0,
              "rope_type": "linear"}
    if kind == "default":
        return fields
    if kind not in ("linear", "llama3"):
        raise ConfigError(f"model.init_from: RoPE type {kind!r} is not supported (default, "
                          f"linear and llama3 are).")
    fields.update(global_rope_scale=float(params["factor"]), rope_type=kind)
    if kind == "llama3":
        fields.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                      rope_high_freq_factor=float(params["high_freq_factor"]),
                      rope_original_context=int(params["original_max_position_embeddings"]))
    return fields


FAMILY = Llama3()
