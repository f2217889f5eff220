"""Hugging Face Gemma 3 `config.json` ↔ our `ModelConfig`.

Two styles of `config.json` exist: released checkpoints write `rope_theta` + `rope_local_base_freq`
(+ `rope_scaling`, `sliding_window_pattern`); newer `transformers` writes `rope_parameters` per
layer type and an explicit `layer_types` list. Both are read; exports write both, so old and new
`transformers` load them alike. Multimodal checkpoints (Gemma 3 4B and up) nest the text model
under `text_config` and omit what equals `Gemma3TextConfig`'s defaults, which are listed here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.paths import HF_PREFIX

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

# Every ModelConfig key that a checkpoint decides; the rest (mesh, sharding, attention_impl) is ours.
CHECKPOINT_KEYS = (*_DIRECT, "global_every", "local_rope_base", "global_rope_base",
                   "global_rope_scale")

# Features of other Gemma versions our model does not implement: (key, the value we support).
_UNSUPPORTED = (
    ("hidden_activation", "gelu_pytorch_tanh"), ("tie_word_embeddings", True),
    ("final_logit_softcapping", None), ("attn_logit_softcapping", None),
    ("attention_bias", False), ("use_bidirectional_attention", False),
)


def checkpoint_dir(init_from: str) -> Path:
    """The folder named by `model.init_from=hf:<dir>`, checked to hold a config.json."""
    if not init_from.startswith(HF_PREFIX):
        raise ConfigError(
            f"model.init_from={init_from!r} is not supported; use hf:<folder of a Hugging Face "
            f"Gemma 3 checkpoint>."
        )
    path = Path(init_from[len(HF_PREFIX):]).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.init_from={init_from!r}: {path / 'config.json'} does not exist; point it at a "
            f"folder holding config.json and *.safetensors."
        )
    return path


def read(path: Path) -> dict[str, Any]:
    """The text model's config.json entries, with Gemma3TextConfig's defaults filled in."""
    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config", raw) if raw.get("model_type") == "gemma3" else raw
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise ConfigError(
            f"model.init_from: {path / 'config.json'} describes model_type "
            f"{text.get('model_type')!r}; only Gemma 3 (gemma3_text, gemma3) is supported."
        )
    # An explicit null for a defaulted key (e.g. "rope_scaling": null) means the default.
    return {**_HF_DEFAULTS,
            **{k: v for k, v in text.items() if v is not None or k not in _HF_DEFAULTS}}


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields described by a config.json (as returned by `read`)."""
    for key, supported in _UNSUPPORTED:
        if hf.get(key, supported) != supported:
            raise ConfigError(
                f"model.init_from: config.json has {key}={hf[key]!r}, which this Gemma 3 "
                f"implementation does not support (it needs {supported!r})."
            )
    fields = {ours: hf[theirs] for ours, theirs in _DIRECT.items()}
    fields["global_every"] = _global_every(hf)
    fields.update(_rope(hf))
    return fields


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
        if local.get("rope_type", "default") != "default":
            raise ConfigError("model.init_from: scaled RoPE on local layers is not supported.")
    else:
        full_theta, local_theta = hf["rope_theta"], hf["rope_local_base_freq"]
        scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ConfigError(
            f"model.init_from: RoPE type {kind!r} is not supported (default and linear are)."
        )
    factor = float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
    return {"local_rope_base": float(local_theta), "global_rope_base": float(full_theta),
            "global_rope_scale": factor}


def resolve(model: ModelConfig, explicit: Iterable[str]) -> ModelConfig:
    """`model` with the dimensions of its `init_from` checkpoint (see `adopt`)."""
    if not model.init_from:
        return model
    path = checkpoint_dir(model.init_from)
    adopted = adopt(model, model_fields(read(path)), explicit, str(path / "config.json"))
    return dataclasses.replace(adopted, name=path.name)


def adopt(model: ModelConfig, fields: dict[str, Any], explicit: Iterable[str],
          source: str) -> ModelConfig:
    """`model` with `fields` (a checkpoint's dimensions) replacing its own.

    `explicit` names the model keys the user set on the command line: one that contradicts the
    checkpoint is a mistake (a different shape than the weights), not a preference.
    """
    for key in sorted(set(explicit) & set(fields)):
        ours, theirs = getattr(model, key), fields[key]
        if ours is not None and theirs is not None and not _same(ours, theirs):
            raise ConfigError(
                f"model.{key}={ours} contradicts {source}, which gives {theirs}; drop the "
                f"override (the dimensions come from the checkpoint)."
            )
    return dataclasses.replace(model, **fields)


def _same(a: Any, b: Any) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-9) if isinstance(a, float) or \
        isinstance(b, float) else a == b


# Gemma's tokenizer: <pad> 0, <eos> 1, <bos> 2.
GEMMA_TOKEN_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}


def to_hf(model: ModelConfig, token_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """A Gemma3ForCausalLM config.json for `model`, in both the new and the legacy style."""
    layer_types = ["full_attention" if (i + 1) % model.global_every == 0 else "sliding_attention"
                   for i in range(model.num_layers)]
    full_rope = {"rope_type": "default", "rope_theta": model.global_rope_base}
    rope_scaling = None
    if model.global_rope_scale != 1.0:
        rope_scaling = {"rope_type": "linear", "factor": model.global_rope_scale}
        full_rope.update(rope_scaling)
    config = {theirs: getattr(model, ours) for ours, theirs in _DIRECT.items()}
    config.update(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
        query_pre_attn_scalar=model.query_pre_attn_scalar or model.head_dim,
        layer_types=layer_types, sliding_window_pattern=model.global_every,
        rope_parameters={"full_attention": full_rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": model.local_rope_base}},
        rope_theta=model.global_rope_base, rope_local_base_freq=model.local_rope_base,
        rope_scaling=rope_scaling, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, attention_bias=False, final_logit_softcapping=None,
        attn_logit_softcapping=None, max_position_embeddings=131_072,
        **(token_ids or GEMMA_TOKEN_IDS),
    )
    return config
