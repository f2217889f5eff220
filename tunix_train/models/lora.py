"""Low-rank adapters: a projection W becomes W + A·B·(alpha / rank), only A and B train.

A projection is named by its logical role (`lora.targets`: q, k, v, o of attention, gate, up,
down of the MLP). Its adapter holds A [in..., r] (random, fan-in scaled) and B [r, out...]
(zeros, so step 0 is the base model), carrying the logical axes of the weight's own input and
output dimensions and `lora_rank` for r: the one rules table shards them like the weight they
adapt (a query adapter's A over fsdp along d, its B over tp along the heads), under every ZeRO
stage. `lora.dropout` drops the adapter's input in training steps (a key is in effect, see
`dropout_key`), never in evaluation or generation.

The adapters are the trainable parameters and everything else is the frozen base: `is_adapter`
tells them apart by path (parallel/layout.py splits the tree with it).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import LoraConfig
from tunix_train.models.layers import LORA_SUFFIX as SUFFIX
from tunix_train.models.layers import param, project, project_unsaved, scaled_normal

RANK = "lora_rank"  # logical axis of r: replicated (sharding.RULES)

_dropout_key: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "tunix_train_lora_dropout_key", default=None)


class Adapter(nnx.Module):
    def __init__(self, in_shape: tuple[int, ...], in_axes: tuple[str, ...],
                 out_shape: tuple[int, ...], out_axes: tuple[str, ...], lora: LoraConfig,
                 rngs: nnx.Rngs):
        r = lora.rank
        self.a = param(scaled_normal(rngs, (*in_shape, r), math.prod(in_shape)), *in_axes, RANK)
        self.b = param(jnp.zeros((r, *out_shape), jnp.float32), RANK, *out_axes)
        self.scale, self.dropout = lora.alpha / r, lora.dropout

    def __call__(self, x: jax.Array, contract: int) -> jax.Array:
        x = _dropped(x, self.dropout)
        h = project(x, self.a[...], contract)
        # As wide as the base projection's output, which `training.remat=save_dots` keeps
        # already: kept too, it would double what a LoRA layer saves for the backward pass.
        return project_unsaved(h, self.b[...]) * jnp.asarray(self.scale, h.dtype)


def adapters(lora: LoraConfig, rngs: nnx.Rngs,
             shapes: dict[str, tuple[tuple, tuple, tuple, tuple]]) -> dict[str, Adapter]:
    """The adapters of the targeted projections among `shapes` (name → (in shape, in axes,
    out shape, out axes) of its weight), as attributes to set: {"q_lora": Adapter, …}."""
    if not lora.on:
        return {}
    return {name + SUFFIX: Adapter(*shapes[name], lora, rngs) for name in lora.target_names()
            if name in shapes}


def is_adapter(path: tuple) -> bool:
    """Whether the parameter at `path` (keys of the parameter tree) belongs to an adapter."""
    return any(isinstance(key, str) and key.endswith(SUFFIX) for key in path)


@contextlib.contextmanager
def dropout_key(key: jax.Array | None) -> Iterator[None]:
    """Adapters drop their inputs with this key while tracing inside the block (a training
    step); outside, or with None, they drop nothing."""
    token = _dropout_key.set(key)
    try:
        yield
    finally:
        _dropout_key.reset(token)


@contextlib.contextmanager
def folded_in(value: jax.Array | int) -> Iterator[None]:
    """Within the block, the dropout key (if any) is the current one with `value` folded in:
    each layer of a scanned stack draws its own masks."""
    key = _dropout_key.get()
    if key is None:
        yield
        return
    with dropout_key(jax.random.fold_in(key, value)):
        yield


def _dropped(x: jax.Array, rate: float) -> jax.Array:
    key = _dropout_key.get()
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(jax.random.fold_in(key, x.size), 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def folded(params: Any, lora: LoraConfig) -> Any:
    """A whole parameter tree (its base dequantized) with each adapter folded into the weight
    it adapts, W + A·B·(alpha / rank), and removed: the tree of the same model without LoRA."""
    if not isinstance(params, dict):
        return params
    out = {}
    for key, value in params.items():
        if isinstance(key, str) and key.endswith(SUFFIX):
            continue
        adapter = params.get(f"{key}{SUFFIX}")
        out[key] = (folded(value, lora) if adapter is None
                    else value + update(value.shape, adapter["a"], adapter["b"], lora))
    return out


def update(shape: tuple[int, ...], a: jax.Array, b: jax.Array, lora: LoraConfig) -> jax.Array:
    """A·B·(alpha / rank) as a weight of `shape` (stacked layers: per layer)."""
    stacked = a.ndim + b.ndim - len(shape) - 2  # leading layer axes, shared by a, b and W
    lead, r = shape[:stacked], a.shape[-1]
    product = jnp.einsum("...ir,...ro->...io", a.reshape(*lead, -1, r), b.reshape(*lead, r, -1))
    return (product * (lora.alpha / lora.rank)).reshape(shape).astype(a.dtype)
