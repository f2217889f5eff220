"""The registry of model families: `model.family` → its `Family` (models/family.py), and the
model built from it. The one place that names every family; a new family adds its module and a
line here (docs/models.md, "Adding a model family")."""

from __future__ import annotations

import jax
from flax import nnx

from tunix_train.config import ConfigError, LoraConfig, ModelConfig
from tunix_train.models import gemma3, llama3, mixtral, qwen3, qwen3_moe
from tunix_train.models.decoder import Decoder
from tunix_train.models.family import Family, Stacking

FAMILIES: dict[str, Family] = {f.name: f for f in (gemma3.FAMILY, llama3.FAMILY, qwen3.FAMILY,
                                                    qwen3_moe.FAMILY, mixtral.FAMILY)}


def of(model: ModelConfig) -> Family:
    if model.family not in FAMILIES:
        raise ConfigError(f"model.family={model.family!r} is not one of "
                          f"{', '.join(FAMILIES)}.")
    return FAMILIES[model.family]


def by_model_type(model_type: str, source: str) -> Family:
    """The family whose Hugging Face `model_type` this is (`source`: the file, for errors)."""
    for candidate in FAMILIES.values():
        if model_type in candidate.model_types:
            return candidate
    known = ", ".join(t for f in FAMILIES.values() for t in f.model_types)
    raise ConfigError(f"model.init_from: {source} describes model_type {model_type!r}; the "
                      f"supported ones are {known}.")


def build(model: ModelConfig, rngs: nnx.Rngs, remat: str = "none",
          lora: LoraConfig = LoraConfig()) -> Decoder:
    return Decoder(model, of(model), rngs=rngs, remat=remat, lora_cfg=lora)


def stacking(model: ModelConfig) -> Stacking:
    return of(model).stacking(model)


def count_params(model: ModelConfig) -> int:
    """Parameter count from shapes alone (no allocation)."""
    abstract = nnx.eval_shape(lambda: build(model, nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


def embedding_size(model: ModelConfig) -> int:
    """Parameters of the input embedding alone (a lookup: no FLOPs when the head is its own)."""
    return model.vocab_size * model.embed_dim


def active_params(model: ModelConfig) -> int:
    """Parameters a token's forward pass multiplies by: all of them, less in each routed layer
    the experts it does not go to (E - k of E), as MFU and a mixture's "A3B" count them."""
    idle = model.num_experts - model.experts_per_token
    return count_params(model) - idle * expert_params(model) // max(model.num_experts, 1)


def expert_params(model: ModelConfig) -> int:
    """Parameters of every routed layer's experts (their gate, up and down projections)."""
    stacking = of(model).stacking(model)
    routed = sum(stacking.count(stack) for stack in stacking.routed)
    return routed * model.num_experts * 3 * model.embed_dim * model.expert_hidden_dim


def experts_line(model: ModelConfig, ep: int) -> str | None:
    """What each device holds of a mixture's experts, and the grouped matmul that multiplies them
    (`model`'s moe_matmul, `auto` decided: ParamLayout's); None for a dense model."""
    if not model.num_experts:
        return None
    return (f"experts: {model.num_experts // ep} of {model.num_experts} per routed layer on "
            f"each device (ep={ep}): {expert_params(model) // ep:,} of "
            f"{expert_params(model):,} expert parameters; grouped matmul {model.moe_matmul}"
            + ("; routing forced balanced by pseudo-random logits (model.moe_force_load_balance: "
               "for benchmarks, the router's choices are not used)"
               if model.moe_force_load_balance else ""))
