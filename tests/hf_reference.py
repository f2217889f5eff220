"""A tiny random Hugging Face Gemma 3 (the reference implementation), saved to safetensors.

Only imported by tests that need `torch` and `transformers` (the `hf` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

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


def build(path: Path, seed: int = 0, **changes) -> Gemma3ForCausalLM:
    """Saves a random model to `path` and returns it (fp32, eager attention, eval mode);
    `changes` replace entries of CONFIG (e.g. a larger vocabulary)."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(**{**CONFIG, **changes}, attn_implementation="eager")
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Larger than HF's 0.02 init so logits are far from uniform and greedy decoding
            # does not collapse onto one token; norm scales away from their zero init.
            param.normal_(0.0, 1.0 if "norm" in name else 0.12)
    model.save_pretrained(path)
    return model


def logits(model: Gemma3ForCausalLM, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def greedy(model: Gemma3ForCausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` (with its KV cache), new tokens only."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()
