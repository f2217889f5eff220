"""Tiny random Hugging Face models of each family (the reference implementations), saved to
safetensors.

Only imported by tests that need `torch` and `transformers` (the `hf` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

# Exercises what Gemma 3 has that a plain decoder does not: grouped-query attention (4 query,
# 2 KV heads), per-head q/k norms, local layers with a sliding window (8 < the test sequences)
# and RoPE base 100 next to global layers with base 10,000 and linear RoPE scaling, a softmax
# scale that is not head_dim^-1/2, and trailing local layers after the last global one.
CONFIG = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
    query_pre_attn_scalar=24, rope_theta=10_000.0, rope_local_base_freq=100.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window_pattern=3,
    max_position_embeddings=1024,
)
# Llama 3: grouped-query attention, an output head of its own, and the llama3 RoPE scaling
# with an original context of 64 tokens, so that of head dim 16's eight frequencies the first
# is kept, the second smoothed and the rest divided by the factor.
LLAMA = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=500_000.0, tie_word_embeddings=False, max_position_embeddings=1024,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
)
# Qwen 3: per-head q/k norms, RoPE base 1M, the head tied to the embedding.
QWEN = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=1024,
)

# Qwen 3 MoE: 5 experts of width 48, 2 per token, weights not renormalised, and every second
# layer routed (layer 1 of 3; layers 0 and 2 dense, the last one after the last routed layer),
# an output head of its own. transformers saves the experts fused.
QWEN_MOE = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, tie_word_embeddings=False, max_position_embeddings=1024,
    num_experts=5, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False,
    decoder_sparse_step=2, router_aux_loss_coef=0.01,
)

# Mixtral: every layer routed through 2 of 5 experts of width 48 (renormalised), Llama's
# attention without q/k norms, saved with the Hub's `block_sparse_moe` names.
MIXTRAL = dict(
    vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=1_000_000.0, tie_word_embeddings=False, max_position_embeddings=1024,
    num_local_experts=5, num_experts_per_tok=2, router_aux_loss_coef=0.02,
)

# family → (config class, model class, settings)
FAMILIES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", CONFIG),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", LLAMA),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", QWEN),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN_MOE),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", MIXTRAL),
}


def model_class(family: str):
    return getattr(transformers, FAMILIES[family][1])


def build(path: Path, seed: int = 0, family: str = "gemma3", **changes):
    """Saves a random model of `family` to `path` and returns it (fp32, eager attention, eval
    mode); `changes` replace entries of its settings (e.g. a larger vocabulary)."""
    config_class, model_class_name, settings = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**settings, **changes},
                                                 attn_implementation="eager")
    model = getattr(transformers, model_class_name)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Larger than HF's 0.02 init so logits are far from uniform and greedy decoding
            # does not collapse onto one token; norm scales away from their initial values.
            param.normal_(0.0, 1.0 if "norm" in name else 0.12)
    model.save_pretrained(path)
    return model


def logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` (with its KV cache), new tokens only."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()
