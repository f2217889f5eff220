"""Where a model's starting weights come from, each array created directly in the sharding its
`ParamLayout` gives it (parallel/layout.py), so a model larger than one device's memory never
exists whole: a Hugging Face checkpoint (`model.init_from`, models/hf_weights.py), a training
run's parameters (`checkpoint.init_params_from`, checkpoint.py), or a random initialisation.

With LoRA the trainable parameters are the adapters (A random, B zero) and the base is frozen:
exactly what the model without adapters would start from, cast (or quantized) as the layout's
`Frozen` stores it.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
from flax import nnx

from tunix_train import checkpoint
from tunix_train.config import LoraConfig
from tunix_train.models import families, hf_weights, lora as lora_lib, quantization
from tunix_train.parallel.layout import ParamLayout, merged, select

log = logging.getLogger("tunix_train")


def initial(layout: ParamLayout, seed: int) -> tuple[Any, Any]:
    """(trainable parameters, frozen base or None): `model.init_from`'s weights, else the
    random initialisation of `seed`."""
    if layout.frozen is None:
        return _whole(layout, layout.full_abstract, layout.full_shardings, seed), None
    return initial_adapters(layout, seed), base(layout, seed)


def initial_params(layout: ParamLayout, seed: int) -> Any:
    """The trainable parameters of `initial` (every parameter without LoRA)."""
    return initial(layout, seed)[0]


def initial_adapters(layout: ParamLayout, seed: int) -> Any:
    """LoRA's adapters at initialisation (A random from `seed`, B zero), nothing else made."""
    return jax.jit(lambda: select(nnx.to_pure_dict(nnx.state(families.build(
        layout.model, nnx.Rngs(seed), lora=layout.lora))), lora_lib.is_adapter),
        out_shardings=layout.shardings)()


def base(layout: ParamLayout, seed: int, init_params_from: str | None = None) -> Any:
    """LoRA's frozen base, from its source: `checkpoint.init_params_from` (a run's parameters;
    a LoRA run's with its adapters folded in), else `model.init_from`, else the random
    initialisation of `seed`."""
    if not init_params_from:
        return layout.frozen.cast(
            _whole(layout, layout.base_abstract(), layout.base_shardings(), seed))
    log.info("LoRA base from %s (its parameters, frozen)", init_params_from)
    return layout.frozen.cast(run_params(layout, init_params_from))


def run_params(layout: ParamLayout, run_dir: str, config: dict | None = None) -> Any:
    """A run's whole model in fp32 (no adapters): its parameters, or, of a LoRA run, its base
    with its adapters folded in (W + A·B·alpha/rank, models/lora.py). `config`: this run's, to
    name what differs when the parameters do not fit (checkpoint.load_params)."""
    saved = checkpoint.saved_config(run_dir)
    trained = LoraConfig(**saved.get("lora", {}))
    abstract, shardings = layout.base_abstract(), layout.base_shardings()
    if not trained.on:
        return checkpoint.load_params(run_dir, abstract, shardings, config)
    theirs = ParamLayout.create(layout.model, layout.mesh, 3, lora=trained,
                                mixed_precision="fp32")
    adapters = checkpoint.load_params(run_dir, theirs.abstract, theirs.shardings, config)
    their_base = base(theirs, saved["training"]["seed"],
                      saved["checkpoint"].get("init_params_from"))
    return jax.jit(lambda a, b: lora_lib.folded(quantization.dequantized(merged(a, b)), trained),
                   out_shardings=shardings)(adapters, their_base)


def _whole(layout: ParamLayout, abstract: Any, shardings: Any, seed: int) -> Any:
    """The model without adapters (or the part of it `abstract` names): imported or random."""
    if layout.model.init_from:
        return hf_weights.load_init_from(layout.model, abstract, shardings)
    return jax.jit(lambda: nnx.to_pure_dict(nnx.state(families.build(
        layout.model, nnx.Rngs(seed), lora=LoraConfig()))), out_shardings=shardings)()
