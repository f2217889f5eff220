"""Gemma 3: the family's layout, layers and Hugging Face names.

Gemma 3 interleaves local (sliding-window, RoPE base 10k) and global (full causal, RoPE base 1M,
linearly scaled from 4B) layers, one global after every `global_every - 1` local ones. The
layers are kept in three stacks, so that each kind's attention is static (a fixed window is
what lets cuDNN's flash attention run): the locals and the globals of the repeating
[locals..., global] blocks, and the locals that trail the last block (gemma3_1b: 4 blocks of
6 layers, then 2), which have a stack of their own because pipeline stages are cut from whole
blocks. Norms scale by (1 + w), every sub-block is normalised before and after, queries and keys
get a per-head norm, the MLP is GeGLU, embeddings are scaled by sqrt(D) and tied to the head.

Hugging Face: two styles of `config.json` exist. Released checkpoints write `rope_theta` +
`rope_local_base_freq` (+ `rope_scaling`, `sliding_window_pattern`); newer `transformers` writes
`rope_parameters` per layer type and an explicit `layer_types` list. Both are read; exports
write both, so old and new `transformers` load them alike. Multimodal checkpoints (Gemma 3 4B
and up) nest the text model under `text_config` and omit what equals `Gemma3TextConfig`'s
defaults, which are listed here.
"""

from __future__ import annotations

from typing import Any

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.models import family
from tunix_train.models.family import (ATTENTION_AND_MLP, EMBEDDING_AND_NORM, QK_NORMS,
                                       Architecture, HfTensor, Rope, Segment, Stacking)
from tunix_train.models.hf_axes import VECTOR

LOCAL, GLOBAL, TRAILING = "local_layers", "global_layers", "trailing_layers"

# Gemma3TextConfig's defaults, for keys a checkpoint's config.json leaves out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
}

# Our key ← config.json key, for the dimensions taken over one to one.
_DIRECT = {
    "vocab_size": "vocab_size", "embed_dim": "hidden_size", "hidden_dim": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "sliding_window": "sliding_window", "rms_norm_eps": "rms_norm_eps",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
}

# Features of other Gemma versions our model does not implement: (key, the value we support).
_UNSUPPORTED = (
    ("hidden_activation", "gelu_pytorch_tanh"), ("tie_word_embeddings", True),
    ("final_logit_softcapping", None), ("attn_logit_softcapping", None),
    ("attention_bias", False), ("use_bidirectional_attention", False),
)


class Gemma3(family.Family):
    name = "gemma3"
    architecture = Architecture(norm_offset=1.0, post_norms=True, qk_norm=True,
                                activation="gelu_tanh", embed_scale=True)
    display = "Gemma 3"
    model_types = ("gemma3_text", "gemma3")
    architectures = ("Gemma3ForCausalLM",)
    default_token_ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    chat_turn = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"
    end_turn = "<end_of_turn>\n"

    def stacking(self, model: ModelConfig) -> Stacking:
        blocks, trailing = divmod(model.num_layers, model.global_every)
        return Stacking(
            block=(Segment(LOCAL, model.global_every - 1), Segment(GLOBAL, 1)),
            num_blocks=blocks, trailing=(Segment(TRAILING, trailing),),
            windows=((LOCAL, model.sliding_window), (TRAILING, model.sliding_window)))

    def ropes(self, model: ModelConfig) -> dict[str, Rope]:
        local = Rope(model.local_rope_base)
        return {LOCAL: local, TRAILING: local,
                GLOBAL: Rope(model.global_rope_base, model.global_rope_scale)}

    def check(self, model: ModelConfig) -> None:
        if not model.tie_embeddings:
            raise ConfigError("model.tie_embeddings=false: Gemma 3's output head is its "
                              "embedding; set model.tie_embeddings=true.")
        if model.rope_type != "linear":
            raise ConfigError(f"model.rope_type={model.rope_type}: Gemma 3 scales RoPE linearly; "
                              f"set model.rope_type=linear.")

    def hf_defaults(self) -> dict[str, Any]:
        return _HF_DEFAULTS

    def from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        family.refuse_unsupported(hf, _UNSUPPORTED, "Gemma 3")
        fields = {ours: hf[theirs] for ours, theirs in _DIRECT.items()}
        fields["global_every"] = _global_every(hf)
        fields.update(_rope(hf), tie_embeddings=True, rope_type="linear")
        return fields

    def to_hf(self, model: ModelConfig) -> dict[str, Any]:
        layer_types = ["full_attention" if (i + 1) % model.global_every == 0 else
                       "sliding_attention" for i in range(model.num_layers)]
        full_rope = {"rope_type": "default", "rope_theta": model.global_rope_base}
        rope_scaling = None
        if model.global_rope_scale != 1.0:
            rope_scaling = {"rope_type": "linear", "factor": model.global_rope_scale}
            full_rope.update(rope_scaling)
        config = {theirs: getattr(model, ours) for ours, theirs in _DIRECT.items()}
        config.update(
            model_type="gemma3_text",
            query_pre_attn_scalar=model.query_pre_attn_scalar or model.head_dim,
            layer_types=layer_types, sliding_window_pattern=model.global_every,
            rope_parameters={"full_attention": full_rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": model.local_rope_base}},
            rope_theta=model.global_rope_base, rope_local_base_freq=model.local_rope_base,
            rope_scaling=rope_scaling, hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True, attention_bias=False, final_logit_softcapping=None,
            attn_logit_softcapping=None, max_position_embeddings=131_072)
        return config

    def hf_top_level(self, model: ModelConfig) -> dict[tuple, HfTensor]:
        return dict(EMBEDDING_AND_NORM)

    def hf_per_layer(self, model: ModelConfig) -> dict[tuple, HfTensor]:
        return {**ATTENTION_AND_MLP, **QK_NORMS,
                ("post_attention_norm", "scale"): HfTensor("post_attention_layernorm.weight",
                                                           VECTOR),
                ("pre_mlp_norm", "scale"): HfTensor("pre_feedforward_layernorm.weight", VECTOR),
                ("post_mlp_norm", "scale"): HfTensor("post_feedforward_layernorm.weight",
                                                     VECTOR)}


def _global_every(hf: dict[str, Any]) -> int:
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        return int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else layers + 1  # no global layer at all: one incomplete block
    expected = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                for i in range(layers)]
    if list(types) != expected:
        raise ConfigError(
            "model.init_from: config.json's layer_types is not a repeating pattern of local "
            "layers followed by one global layer, which is the only layout supported."
        )
    return every


def _rope(hf: dict[str, Any]) -> dict[str, float]:
    params = hf.get("rope_parameters")
    if params is not None and "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention", {})
        full_theta = full.get("rope_theta", hf["rope_theta"])
        local_theta = local.get("rope_theta", hf["rope_local_base_freq"])
        scaling = full
        if family.rope_kind(local) != "default":
            raise ConfigError("model.init_from: scaled RoPE on local layers is not supported.")
    else:
        full_theta, local_theta = hf["rope_theta"], hf["rope_local_base_freq"]
        scaling = hf.get("rope_scaling") or {}
    kind = family.rope_kind(scaling)
    if kind not in ("default", "linear"):
        raise ConfigError(
            f"model.init_from: RoPE type {kind!r} is not supported (default and linear are)."
        )
    factor = float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
    return {"local_rope_base": float(local_theta), "global_rope_base": float(full_theta),
            "global_rope_scale": factor}


FAMILY = Gemma3()
