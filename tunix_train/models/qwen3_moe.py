"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen 3's attention and norms, and in routed
layers a mixture of experts in place of the dense MLP (models/moe.py): a router picks each
token's `experts_per_token` of `num_experts` SwiGLU experts of width `expert_hidden_dim`, their
weights renormalised to sum to 1 where `normalize_top_k` (HF `norm_topk_prob`) says so.

Layer i routes when (i + 1) is a multiple of `moe_every` (HF `decoder_sparse_step`; 1 in the
released models: every layer); the others have a dense MLP of `hidden_dim` (the stacks:
family.RoutedExperts).

Hugging Face: `Qwen3MoeForCausalLM`. The router is `mlp.gate.weight` [E, D]. The Hub's files
hold each expert apart (`mlp.experts.{j}.gate_proj.weight`, …), as transformers 5.24's
`save_pretrained` writes them too: export writes that and import reads it. In memory
transformers 5 keeps them fused (`mlp.experts.gate_up_proj` [E, 2F, D], gate first,
`mlp.experts.down_proj` [E, D, F]), and files saved from its state dict hold those: import
reads them as well.
"""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.models.family import HfTensor, RoutedExperts
from tunix_train.models.hf_axes import TRANSPOSE
from tunix_train.models.qwen3 import Qwen3

_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
    "num_experts_per_tok": 8, "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001, "mlp_only_layers": [],
}

# Our key ← config.json key, for the mixture's settings taken over one to one.
_MOE = {"experts_per_token": "num_experts_per_tok",
        "expert_hidden_dim": "moe_intermediate_size", "normalize_top_k": "norm_topk_prob",
        "moe_every": "decoder_sparse_step", "router_aux_loss_coef": "router_aux_loss_coef"}


class Qwen3Moe(RoutedExperts, Qwen3):
    name = "qwen3_moe"
    display = "Qwen 3 MoE"
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    unsupported = (("hidden_act", "silu"), ("attention_bias", False),
                   ("use_sliding_window", False), ("mlp_only_layers", []))
    per_expert = {
        ("mlp", "router"): HfTensor("mlp.gate.weight", TRANSPOSE),
        ("mlp", "gate"): HfTensor("mlp.experts.{j}.gate_proj.weight", TRANSPOSE),
        ("mlp", "up"): HfTensor("mlp.experts.{j}.up_proj.weight", TRANSPOSE),
        ("mlp", "down"): HfTensor("mlp.experts.{j}.down_proj.weight", TRANSPOSE),
    }

    def hf_defaults(self) -> dict[str, Any]:
        return _HF_DEFAULTS

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().from_hf({**hf, "mlp_only_layers": hf.get("mlp_only_layers") or []})
        fields.update({ours: hf[theirs] for ours, theirs in _MOE.items()})
        # The Hub's files say num_experts; transformers 5 writes num_local_experts.
        fields["num_experts"] = hf.get("num_experts") or hf.get("num_local_experts") or 128
        return fields

    def to_hf(self, model: ModelConfig) -> dict[str, Any]:
        config = super().to_hf(model)
        config.update({theirs: getattr(model, ours) for ours, theirs in _MOE.items()},
                      num_experts=model.num_experts, mlp_only_layers=[],
                      output_router_logits=False)
        return config


FAMILY = Qwen3Moe()
