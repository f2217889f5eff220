"""Batched, jit-compiled generation with a KV cache: one prefill, then one token per step.

This is the rollout engine: `Sampler(...)(params, prompts)` returns new tokens for a batch of
prompts of different lengths. The whole loop (prefill, `lax.scan` over decode steps, sampling)
is one compiled program per (batch, prompt length, max_new_tokens) shape, so the host does not
take part in any step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train.parallel.sharding import LogicalRules, activate


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = the whole vocabulary
    eos_id: int = -1  # -1 = never stop early


def sample(logits_BxV: jax.Array, rng: jax.Array, options: SamplingOptions) -> jax.Array:
    if options.temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV.astype(jnp.float32) / options.temperature
    if options.top_k:
        kth_best = jax.lax.top_k(logits_BxV, options.top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_best, -jnp.inf, logits_BxV)
    return jax.random.categorical(rng, logits_BxV).astype(jnp.int32)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[B, P] prompts aligned on the right (so all rows decode in the same column), and lengths."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.min() < 1:
        raise ValueError("every prompt needs at least one token")
    padded = np.full((len(prompts), lengths.max()), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, padded.shape[1] - len(prompt):] = prompt
    return padded, lengths


def generate_fn(graphdef: nnx.GraphDef, options: SamplingOptions, compute_dtype: jnp.dtype,
                mesh: Mesh | None = None, rules: LogicalRules = ()):
    """The un-jitted (params, prompts [B, P], lengths [B], rng) → (tokens [B, N], counts [B]).

    `counts` is how many tokens each row generated, its EOS included; later ones are padding.
    """

    def generate(params, prompts_BxP, lengths_B, rng):
        with activate(mesh, rules) if mesh is not None else contextlib.nullcontext():
            params = jax.tree.map(lambda x: x.astype(compute_dtype), params)
            model = nnx.merge(graphdef, params)
            batch, prompt_len = prompts_BxP.shape
            cache = model.init_cache(batch, prompt_len + options.max_new_tokens, compute_dtype)
            positions_BxP = jnp.arange(prompt_len)[None, :] - (prompt_len - lengths_B)[:, None]
            logits, cache = model.decode(prompts_BxP, jnp.maximum(positions_BxP, -1), cache)
            first = sample(logits[:, -1], jax.random.fold_in(rng, 0), options)

            def step(carry, i):
                token_B, cache = carry
                logits, cache = model.decode(token_B[:, None], (lengths_B + i)[:, None], cache)
                next_B = sample(logits[:, 0], jax.random.fold_in(rng, i + 1), options)
                return (next_B, cache), next_B

            steps = jnp.arange(options.max_new_tokens - 1)
            _, rest_NxB = jax.lax.scan(step, (first, cache), steps)
        return _stop_at_eos(jnp.concatenate([first[None], rest_NxB]).T, options.eos_id)

    return generate


def _stop_at_eos(tokens_BxN: jax.Array, eos_id: int) -> tuple[jax.Array, jax.Array]:
    is_eos = tokens_BxN == eos_id
    after = jnp.cumsum(is_eos, axis=1) - is_eos > 0  # strictly after the first EOS
    counts = jnp.sum(~after, axis=1).astype(jnp.int32)
    return jnp.where(after, 0, tokens_BxN), counts


class Sampler:
    """Compiled generation for one model and sampling setup; call with params and prompts."""

    def __init__(self, graphdef: nnx.GraphDef, param_shardings: Any, options: SamplingOptions,
                 compute_dtype: jnp.dtype, mesh: Mesh, rules: LogicalRules):
        self.options = options
        self.mesh = mesh
        replicated = NamedSharding(mesh, P())
        self._generate = jax.jit(
            generate_fn(graphdef, options, compute_dtype, mesh, rules),
            in_shardings=(param_shardings, replicated, replicated, replicated),
            out_shardings=(replicated, replicated),
        )

    def __call__(self, params: Any, prompts: Sequence[Sequence[int]],
                 seed: int = 0) -> list[list[int]]:
        """New tokens of each prompt, cut after its EOS."""
        padded, lengths = left_pad(prompts)
        tokens, counts = jax.device_get(
            self._generate(params, padded, lengths, jax.random.key(seed)))
        return [row[:count].tolist() for row, count in zip(tokens, counts)]
