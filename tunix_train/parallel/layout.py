"""A model's parameters laid out on a mesh, before any of them is allocated.

`ParamLayout.create` traces the model with `nnx.eval_shape` (nothing is allocated) and derives
from the one rules table (sharding.py) each parameter's sharding as stored and its gradient's
sharding at the run's ZeRO stage: what inference needs to place weights, and the base of the
train state's layout (training/state.py). Nothing here reads weights: starting_weights.py
creates them directly in these shardings, from a checkpoint or at random.

With LoRA (`lora.rank` > 0) the trainable parameters are the adapters alone (models/lora.py):
`abstract`, `shardings` and the gradient and moment layouts describe them, and `frozen`
describes the rest, the base: stored in the compute dtype (bf16 under mixed precision, no fp32
master copy), or quantized (`lora.base_quantization`, models/quantization.py), sharded by the
same rules (over fsdp at ZeRO-3), never given a gradient or an optimizer state. The model sees
the two merged (`merge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train import backend
from tunix_train.config import LoraConfig, ModelConfig
from tunix_train.models import families, lora as lora_lib, moe, quantization
from tunix_train.models.family import LAYERS, TRAILING
from tunix_train.models.layers import logical_axes
from tunix_train.parallel import sharding
from tunix_train.parallel.mesh import TP


@dataclass(frozen=True)
class Frozen:
    """LoRA's base: every parameter that is not an adapter."""

    abstract: Any  # ShapeDtypeStruct per parameter, or a qwix QArray of them (quantized)
    shardings: Any  # NamedSharding per leaf, the same structure
    stacked: Any  # bool per parameter (as ParamLayout.stacked)
    quantization: str  # lora.base_quantization

    @classmethod
    def create(cls, abstract: Any, shardings: Any, stacked: Any, dtype: jnp.dtype,
               quantized: str) -> Frozen:
        cast = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), abstract)
        if quantized == "none":
            return cls(cast, shardings, stacked, quantized)
        qtype = quantization.qtype(quantized)

        def quantize(path, a, s, is_stacked):
            if not quantization.is_quantized_weight(path):
                return a, s
            axis = quantization.tiled_axis(path, is_stacked)
            q = jax.eval_shape(lambda w: quantization.quantize(w, qtype, axis, dtype), a)
            return q, jax.tree.map(lambda leaf: _fitting(s, leaf.shape), q)

        pairs = _map_with_path(quantize, cast, shardings, stacked)
        return cls(_first_of(pairs), _second_of(pairs), stacked, quantized)

    def cast(self, full_precision: Any) -> Any:
        """Base parameters (fp32 or the compute dtype, laid out as stored) in this layout."""
        if self.quantization == "none":
            return jax.jit(lambda p: jax.tree.map(lambda x, a: x.astype(a.dtype), p,
                                                  self.abstract),
                           out_shardings=self.shardings, donate_argnums=0)(full_precision)
        qtype = quantization.qtype(self.quantization)

        def store(params):
            def one(path, w, a, is_stacked):
                if not quantization.is_quantized_weight(path):
                    return w.astype(a.dtype)
                axis = quantization.tiled_axis(path, is_stacked)
                return quantization.quantize(w, qtype, axis, a.scale.dtype)
            return _map_with_path(one, params, self.abstract, self.stacked)

        return jax.jit(store, out_shardings=self.shardings, donate_argnums=0)(full_precision)


@dataclass(frozen=True)
class ParamLayout:
    mesh: Mesh
    rules: sharding.ZeroRules
    model: ModelConfig
    graphdef: nnx.GraphDef  # of the whole model (adapters included)
    abstract: Any  # ShapeDtypeStruct per trainable parameter (a plain nested dict)
    shardings: Any  # NamedSharding per trainable parameter, as stored
    grad_shardings: Any  # NamedSharding per trainable parameter's reduced gradient
    moment_shardings: Any  # NamedSharding of a parameter-shaped optimizer moment
    stacked: Any  # bool per trainable parameter: a scanned layer stack (leading axis "layers"
    # or "trailing_layers")
    compute_dtype: jnp.dtype  # what the fp32 parameters are cast to for compute
    frozen: Frozen | None = None  # LoRA's base; None: every parameter trains
    full_abstract: Any = None  # every parameter in fp32 (what init and import produce)
    full_shardings: Any = None
    lora: LoraConfig = field(default_factory=LoraConfig)

    @classmethod
    def create(cls, model: ModelConfig, mesh: Mesh, zero_stage: int, remat: str = "none",
               mixed_precision: str = "auto", pipeline_repeats: int = 1,
               lora: LoraConfig = LoraConfig()) -> ParamLayout:
        families.of(model).check(model)
        model = replace(model, moe_matmul=moe.chosen_matmul(model, mesh.shape.get(TP, 1)))
        rules = sharding.zero_rules(model, mesh, zero_stage, pipeline_repeats)
        graphdef, variables = nnx.split(nnx.eval_shape(
            lambda: families.build(model, nnx.Rngs(0), remat, lora)))

        abstract = nnx.to_pure_dict(variables)

        def shardings(rules_of_state):
            return sharding.spread_over_ranks(nnx.to_pure_dict(
                sharding.state_shardings(variables, mesh, rules_of_state)), abstract, mesh)

        stacked = nnx.to_pure_dict(nnx.map_state(
            lambda _, v: v.replace(logical_axes(v)[0] in (LAYERS, TRAILING)),
            variables))
        trees = (abstract, shardings(rules.params), shardings(rules.grads),
                 shardings(rules.optimizer), stacked)
        dtype = compute_dtype(mixed_precision)
        if not lora.on:
            return cls(mesh, rules, model, graphdef, *trees, dtype, None, trees[0], trees[1])
        trainable = [select(t, lora_lib.is_adapter) for t in trees]
        base = [select(t, lambda path: not lora_lib.is_adapter(path))
                for t in (abstract, trees[1], stacked)]
        frozen = Frozen.create(*base, dtype, lora.base_quantization)
        return cls(mesh, rules, model, graphdef, *trainable, dtype, frozen, trees[0], trees[1],
                   lora)

    def base_abstract(self) -> Any:
        """The base's parameters in fp32, as a whole-model run saves them."""
        return select(self.full_abstract, lambda path: not lora_lib.is_adapter(path))

    def base_shardings(self) -> Any:
        return select(self.full_shardings, lambda path: not lora_lib.is_adapter(path))

    def merge(self, trainable: Any, frozen: Any) -> Any:
        """The tree the model reads: trainable parameters and frozen base together."""
        return trainable if frozen is None else merged(trainable, frozen)

    def merged_shardings(self) -> Any:
        return self.merge(self.shardings, None if self.frozen is None else self.frozen.shardings)


def compute_dtype(mixed_precision: str) -> jnp.dtype:
    """`training.mixed_precision`: auto = bf16 on accelerators, fp32 on CPUs (where bf16 is
    10-25% slower)."""
    if mixed_precision == "auto":
        mixed_precision = "fp32" if backend.is_cpu() else "bf16"
    return jnp.bfloat16 if mixed_precision == "bf16" else jnp.float32


# ---------------------------------------------------------------------------------------------
# Parameter trees are nested dicts; these split and join them by path.

def select(tree: Any, keep: Callable[[tuple], bool], path: tuple = ()) -> Any:
    """The leaves of nested dict `tree` whose path `keep` accepts (empty dicts dropped)."""
    if not isinstance(tree, dict):
        return tree if keep(path) else None
    out = {}
    for key, sub in tree.items():
        kept = select(sub, keep, (*path, key))
        if kept is not None and not (isinstance(kept, dict) and not kept):
            out[key] = kept
    return out


def merged(a: Any, b: Any) -> Any:
    """Two nested dicts with disjoint leaves, as one."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        raise ValueError("parameter trees overlap")
    out = dict(b)
    for key, sub in a.items():
        out[key] = merged(sub, out[key]) if key in out else sub
    return out


def _map_with_path(fn: Callable, tree: Any, *rest: Any, path: tuple = ()) -> Any:
    """fn(path, leaf, *leaves of `rest`) over the leaves of nested dict `tree`."""
    if not isinstance(tree, dict):
        return fn(path, tree, *rest)
    return {k: _map_with_path(fn, v, *(r[k] for r in rest), path=(*path, k))
            for k, v in tree.items()}


def _first_of(pairs: Any) -> Any:
    return pairs[0] if isinstance(pairs, tuple) else {k: _first_of(v) for k, v in pairs.items()}


def _second_of(pairs: Any) -> Any:
    return pairs[1] if isinstance(pairs, tuple) else {k: _second_of(v) for k, v in pairs.items()}


def _fitting(weight: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
    """The weight's sharding for an array of `shape` (a quantized weight's codes or scales):
    a dimension its mesh axes do not divide (a scale's blocks) stays whole."""
    mesh = weight.mesh

    def ways(entry) -> int:
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        return math.prod(mesh.shape[n] for n in names)

    spec = tuple(weight.spec) + (None,) * (len(shape) - len(weight.spec))
    return NamedSharding(mesh, P(*(e if d % ways(e) == 0 else None for d, e in zip(shape, spec))),
                         memory_kind=weight.memory_kind)
