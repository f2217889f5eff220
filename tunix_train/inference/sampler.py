"""Batched, jit-compiled generation with a KV cache: one prefill, then one token per step.

This is the rollout engine: `Sampler(...)(params, prompts)` returns new tokens for a batch of
prompts of different lengths; `Sampler.rollouts` also returns each new token's log-probability
under the tempered, untruncated distribution (GRPO's π_old: top-k and top-p only choose which
tokens may be drawn, the policy being trained is the whole tempered softmax). The whole loop (prefill, `lax.scan` over decode steps, sampling)
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

from tunix_train.models import quantization
from tunix_train.parallel import distributed
from tunix_train.parallel.sharding import LogicalRules, activate


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = the whole vocabulary
    eos_id: int = -1  # -1 = never stop early
    top_p: float = 1.0  # 1 = no nucleus cut


def sample(logits_BxV: jax.Array, rng: jax.Array,
           options: SamplingOptions) -> tuple[jax.Array, jax.Array]:
    """(tokens [B], their log-probabilities [B] under softmax(logits / temperature))."""
    logits_BxV = logits_BxV.astype(jnp.float32)
    if options.temperature == 0:
        token_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        return token_B, _log_prob(logits_BxV, token_B)
    logits_BxV = logits_BxV / options.temperature
    allowed_BxV = logits_BxV
    if options.top_k:
        kth_best = jax.lax.top_k(logits_BxV, options.top_k)[0][:, -1:]
        allowed_BxV = jnp.where(logits_BxV < kth_best, -jnp.inf, allowed_BxV)
    if options.top_p < 1:
        allowed_BxV = _nucleus(allowed_BxV, options.top_p)
    token_B = jax.random.categorical(rng, allowed_BxV).astype(jnp.int32)
    return token_B, _log_prob(logits_BxV, token_B)


def _nucleus(logits_BxV: jax.Array, top_p: float) -> jax.Array:
    """Keeps the most likely tokens whose probabilities first reach `top_p` in total."""
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # mass of the more likely ones
    kept = jnp.sum(before_BxV < top_p, axis=-1)  # >= 1: the most likely always stays
    threshold_B = jnp.take_along_axis(sorted_BxV, kept[:, None] - 1, axis=-1)
    return jnp.where(logits_BxV < threshold_B, -jnp.inf, logits_BxV)


def _log_prob(logits_BxV: jax.Array, token_B: jax.Array) -> jax.Array:
    return jnp.take_along_axis(jax.nn.log_softmax(logits_BxV, axis=-1), token_B[:, None],
                               axis=-1)[:, 0]


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
    """The un-jitted (params, prompts [B, P], lengths [B], rng) → (tokens [B, N], counts [B],
    log-probs [B, N]).

    `counts` is how many tokens each row generated, its EOS included; later ones are padding
    (token 0, log-prob 0).
    """

    def generate(params, prompts_BxP, lengths_B, rng):
        with activate(mesh, rules) if mesh is not None else contextlib.nullcontext():
            params = quantization.cast(params, compute_dtype)
            model = nnx.merge(graphdef, params)
            batch, prompt_len = prompts_BxP.shape
            cache = model.init_cache(batch, prompt_len + options.max_new_tokens, compute_dtype)
            positions_BxP = jnp.arange(prompt_len)[None, :] - (prompt_len - lengths_B)[:, None]
            logits, cache = model.decode(prompts_BxP, jnp.maximum(positions_BxP, -1), cache)
            first, first_logp = sample(logits[:, -1], jax.random.fold_in(rng, 0), options)

            def step(carry, i):
                token_B, cache = carry
                logits, cache = model.decode(token_B[:, None], (lengths_B + i)[:, None], cache)
                next_B, logp_B = sample(logits[:, 0], jax.random.fold_in(rng, i + 1), options)
                return (next_B, cache), (next_B, logp_B)

            steps = jnp.arange(options.max_new_tokens - 1)
            _, (rest_NxB, rest_logp_NxB) = jax.lax.scan(step, (first, cache), steps)
        tokens_BxN = jnp.concatenate([first[None], rest_NxB]).T
        logps_BxN = jnp.concatenate([first_logp[None], rest_logp_NxB]).T
        return _stop_at_eos(tokens_BxN, logps_BxN, options.eos_id)

    return generate


def _stop_at_eos(tokens_BxN: jax.Array, logps_BxN: jax.Array,
                 eos_id: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    is_eos = tokens_BxN == eos_id
    after = jnp.cumsum(is_eos, axis=1) - is_eos > 0  # strictly after the first EOS
    counts = jnp.sum(~after, axis=1).astype(jnp.int32)
    return jnp.where(after, 0, tokens_BxN), counts, jnp.where(after, 0.0, logps_BxN)


class Sampler:
    """Compiled generation for one model and sampling setup; call with params and prompts.

    `rows`: how the batch's rows are laid out (rollouts spread them over the data axis);
    None = every device decodes every row. `job_timeout_s`: in a multi-process job, the
    generation's first run is made by every process together, each waiting for the others at
    most this long (distributed.first_run_together)."""

    def __init__(self, graphdef: nnx.GraphDef, param_shardings: Any, options: SamplingOptions,
                 compute_dtype: jnp.dtype, mesh: Mesh, rules: LogicalRules,
                 rows: NamedSharding | None = None, job_timeout_s: float | None = None):
        self.options = options
        self.mesh = mesh
        replicated = NamedSharding(mesh, P())
        rows = rows or replicated
        per_row = NamedSharding(mesh, P(*rows.spec[:1]))  # the lengths [B]
        self._generate = jax.jit(
            generate_fn(graphdef, options, compute_dtype, mesh, rules),
            in_shardings=(param_shardings, rows, per_row, replicated),
            out_shardings=(replicated, replicated, replicated),
        )
        if job_timeout_s is not None:
            self._generate = distributed.first_run_together(self._generate, "the generation",
                                                            job_timeout_s)

    def __call__(self, params: Any, prompts: Sequence[Sequence[int]],
                 seed: int = 0) -> list[list[int]]:
        """New tokens of each prompt, cut after its EOS."""
        padded, lengths = left_pad(prompts)
        tokens, counts, _ = jax.device_get(self.rollouts(params, padded, lengths,
                                                         jax.random.key(seed)))
        return [row[:count].tolist() for row, count in zip(tokens, counts)]

    def rollouts(self, params: Any, padded_BxP: np.ndarray, lengths_B: np.ndarray,
                 rng: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(tokens [B, N], counts [B], log-probs [B, N]) of left-padded prompts, on device."""
        return self._generate(params, padded_BxP, lengths_B, rng)
