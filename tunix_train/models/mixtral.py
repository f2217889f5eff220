"""Mixtral (8x7B, 8x22B): Llama's attention and norms (no q/k norms, RoPE base 1,000,000,
RMSNorm eps 1e-5, an output head of its own), and in every layer a mixture of experts in
place of the dense MLP (models/moe.py): a router picks each token's 2 of 8 SwiGLU experts, the
two weights renormalised to sum to 1 (family.RoutedExperts).

Hugging Face: `MixtralForCausalLM`. The Hub's files (and transformers 5.24's `save_pretrained`)
name the mixture `block_sparse_moe`: the router `block_sparse_moe.gate.weight` [E, D] and each
expert's `w1` (gate), `w3` (up) and `w2` (down); transformers 5 keeps them in memory as
`mlp.gate.weight` and fused `mlp.experts.gate_up_proj` / `down_proj`. Import reads both, export
writes the Hub's. `intermediate_size` is each expert's width; Mixtral has no dense MLP.
"""

from __future__ import annotations

from typing import Any

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.models.family import HfTensor, RoutedExperts
from tunix_train.models.hf_axes import TRANSPOSE
from tunix_train.models.llama3 import Llama3

# MixtralConfig's defaults, for keys a checkpoint's config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 14_336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001,
}


class Mixtral(RoutedExperts, Llama3):
    name = "mixtral"
    display = "Mixtral"
    model_types = ("mixtral",)
    architectures = ("MixtralForCausalLM",)
    default_token_ids = {"bos_token_id": 1, "eos_token_id": 2}
    chat_turn = "[INST] {prompt} [/INST]"
    end_turn = "</s>"
    unsupported = (("hidden_act", "silu"), ("sliding_window", None),
                   ("router_jitter_noise", 0.0))
    per_expert = {
        ("mlp", "router"): HfTensor("block_sparse_moe.gate.weight", TRANSPOSE),
        ("mlp", "gate"): HfTensor("block_sparse_moe.experts.{j}.w1.weight", TRANSPOSE),
        ("mlp", "up"): HfTensor("block_sparse_moe.experts.{j}.w3.weight", TRANSPOSE),
        ("mlp", "down"): HfTensor("block_sparse_moe.experts.{j}.w2.weight", TRANSPOSE),
    }

    def hf_defaults(self) -> dict[str, Any]:
        return _HF_DEFAULTS

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().from_hf(hf)
        fields.update(num_experts=hf["num_local_experts"],
                      experts_per_token=hf["num_experts_per_tok"],
                      expert_hidden_dim=hf["intermediate_size"], normalize_top_k=True,
                      moe_every=1, router_aux_loss_coef=hf["router_aux_loss_coef"])
        return fields

    def to_hf(self, model: ModelConfig) -> dict[str, Any]:
        config = super().to_hf(model)
        config.update(intermediate_size=model.expert_hidden_dim,
                      num_local_experts=model.num_experts,
                      num_experts_per_tok=model.experts_per_token,
                      router_aux_loss_coef=model.router_aux_loss_coef,
                      output_router_logits=False, router_jitter_noise=0.0)
        return config

    def extra_hf(self, model: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": None}

    def check(self, model: ModelConfig) -> None:
        super().check(model)
        if model.num_experts and (model.moe_every != 1 or not model.normalize_top_k):
            raise ConfigError(f"model.moe_every={model.moe_every} and model.normalize_top_k="
                              f"{model.normalize_top_k}: every Mixtral layer routes, its top-k "
                              f"weights renormalised; set moe_every=1 and normalize_top_k=true.")


FAMILY = Mixtral()
