"""A model's parameters laid out on a mesh, before any of them is allocated.

`ParamLayout.create` traces the model with `nnx.eval_shape` (nothing is allocated) and derives
from the one rules table (sharding.py) each parameter's sharding as stored and its gradient's
sharding at the run's ZeRO stage: what inference needs to place weights, and the base of the
train state's layout (training/state.py). Parameters are then created directly in their shards:
`initial_params` reads `model.init_from` or initialises at random, so a model larger than one
device's memory never exists whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from tunix_train.config import ModelConfig
from tunix_train.models import families, hf_weights
from tunix_train.models.family import LAYERS, TRAILING
from tunix_train.models.layers import logical_axes
from tunix_train.parallel import sharding


@dataclass(frozen=True)
class ParamLayout:
    mesh: Mesh
    rules: sharding.StageRules
    model: ModelConfig
    graphdef: nnx.GraphDef
    abstract: Any  # ShapeDtypeStruct per parameter (a plain nested dict)
    shardings: Any  # NamedSharding per parameter, as stored
    grad_shardings: Any  # NamedSharding per parameter's reduced gradient
    moment_shardings: Any  # NamedSharding of a parameter-shaped optimizer moment
    stacked: Any  # bool per parameter: a scanned layer stack (leading axis "layers" or
    # "trailing_layers")
    compute_dtype: jnp.dtype  # what the fp32 parameters are cast to for compute

    @classmethod
    def create(cls, model: ModelConfig, mesh: Mesh, zero_stage: int, remat: str = "none",
               mixed_precision: str = "auto", pipeline_repeats: int = 1) -> ParamLayout:
        families.of(model).check(model)
        rules = sharding.stage_rules(model, mesh, zero_stage, pipeline_repeats)
        graphdef, variables = nnx.split(nnx.eval_shape(
            lambda: families.build(model, nnx.Rngs(0), remat)))

        abstract = nnx.to_pure_dict(variables)

        def shardings(rules_of_state):
            return sharding.spread_over_pp(nnx.to_pure_dict(
                sharding.state_shardings(variables, mesh, rules_of_state)), abstract, mesh)

        stacked = nnx.to_pure_dict(nnx.map_state(
            lambda _, v: v.replace(logical_axes(v)[0] in (LAYERS, TRAILING)),
            variables))
        return cls(mesh, rules, model, graphdef, abstract,
                   shardings(rules.params), shardings(rules.grads), shardings(rules.optimizer),
                   stacked, compute_dtype(mixed_precision))

    def initial_params(self, seed: int) -> Any:
        """`model.init_from`'s weights, else the random initialisation of `seed`; each array
        created directly in its sharding."""
        if self.model.init_from:
            return hf_weights.load_init_from(self.model, self.abstract, self.shardings)
        return jax.jit(lambda: nnx.to_pure_dict(nnx.state(families.build(self.model,
                                                                          nnx.Rngs(seed)))),
                       out_shardings=self.shardings)()


def compute_dtype(mixed_precision: str) -> jnp.dtype:
    """`training.mixed_precision`: auto = bf16 on accelerators, fp32 on CPUs (where bf16 is
    10-25% slower)."""
    if mixed_precision == "auto":
        mixed_precision = "fp32" if jax.default_backend() == "cpu" else "bf16"
    return jnp.bfloat16 if mixed_precision == "bf16" else jnp.float32
