"""Qwen 3 (dense): Llama 3's layout and layers plus a per-head RMSNorm of queries and keys
before RoPE (base 1,000,000), head dim 128 whatever the width; tied heads up to 4B, untied for
8B. Hugging Face: `Qwen3ForCausalLM`, named like Llama with `self_attn.q_norm`/`k_norm`.
"""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig
from tunix_train.models.family import QK_NORMS, Architecture, HfTensor
from tunix_train.models.llama3 import Llama3

# Qwen3Config's defaults, for keys a checkpoint's config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "hidden_act": "silu",
    "tie_word_embeddings": False,
}


class Qwen3(Llama3):
    name = "qwen3"
    display = "Qwen 3"
    architecture = Architecture(norm_offset=0.0, post_norms=False, qk_norm=True,
                                activation="silu", embed_scale=False)
    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)
    default_token_ids = {"bos_token_id": 151_643, "eos_token_id": 151_643}
    chat_turn = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    end_turn = "<|im_end|>\n"
    unsupported = (("hidden_act", "silu"), ("attention_bias", False),
                   ("use_sliding_window", False))

    def hf_defaults(self) -> dict[str, Any]:
        return _HF_DEFAULTS

    def extra_hf(self, model: ModelConfig) -> dict[str, Any]:
        return {"use_sliding_window": False, "sliding_window": None,
                "layer_types": ["full_attention"] * model.num_layers}

    def hf_per_layer(self, model: ModelConfig) -> dict[tuple, HfTensor]:
        return {**super().hf_per_layer(model), **QK_NORMS}


FAMILY = Qwen3()
