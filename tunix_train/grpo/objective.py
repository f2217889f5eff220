"""GRPO's formulas: group advantages, the clipped per-token objective, the KL penalty and how
token terms are aggregated. Pure array functions; tests/test_grpo.py checks each against NumPy.

For completion token t of sequence i, with ρ = π_θ / π_old (the sampler's log-probabilities are
π_old) and the sequence's advantage A:

    policy term   max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε_high))                      (PPO clip)
    KL term       k3: exp(Δ) − Δ − 1,  k1: −Δ,  with Δ = log π_ref − log π_θ     (× β)

Aggregation: `sequence-mean-token-mean` averages each sequence's tokens, then the sequences
(GRPO's paper); `token-mean` averages all completion tokens of the batch (DAPO). Both are a
weighted sum Σ w·term / Σ w with per-token weights w (1/|o_i| or 1 on completion tokens), so
the train step's accumulation over micro-batches (sum, then divide once) is exact for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_train.config import GrpoConfig
from tunix_train.models.head import VocabChunks

STD_EPS = 1e-6


def advantages(rewards_PxG: np.ndarray, kind: str) -> np.ndarray:
    """One advantage per completion from the rewards of each prompt's group of G.

    grpo: (r − mean) / (std + 1e-6), std over the group (ddof 0, as Tunix); dr_grpo: r − mean;
    rloo: r minus the mean of the other G − 1 completions."""
    r = np.asarray(rewards_PxG, np.float64)
    mean = r.mean(axis=1, keepdims=True)
    if kind == "grpo":
        out = (r - mean) / (r.std(axis=1, keepdims=True) + STD_EPS)
    elif kind == "dr_grpo":
        out = r - mean
    elif kind == "rloo":
        g = r.shape[1]
        out = r - (r.sum(axis=1, keepdims=True) - r) / (g - 1)
    else:
        raise ValueError(f"unknown advantage {kind!r}")
    return out.astype(np.float32)


def token_weights(mask_BxL: np.ndarray, aggregation: str) -> np.ndarray:
    """w with loss = Σ w·term / Σ w: 1/|o_i| per token (sequence-mean-token-mean) or 1."""
    mask = np.asarray(mask_BxL, np.float32)
    if aggregation == "token-mean":
        return mask
    lengths = mask.sum(axis=-1, keepdims=True)
    return np.where(lengths > 0, mask / np.maximum(lengths, 1.0), 0.0).astype(np.float32)


@dataclass(frozen=True)
class Objective:
    epsilon: float
    epsilon_high: float
    beta: float
    kl_estimator: str
    temperature: float

    @classmethod
    def of(cls, g: GrpoConfig) -> Objective:
        high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        return cls(g.epsilon, high, g.beta, g.kl_estimator, g.temperature)

    def terms(self, logp: jax.Array, old_logp: jax.Array, ref_logp: jax.Array | None,
              advantage: jax.Array) -> dict[str, jax.Array]:
        """Per-token policy term, KL, total loss and which tokens the clip holds (same shape)."""
        ratio = jnp.exp(logp - old_logp)
        clipped_ratio = jnp.clip(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        policy = jnp.maximum(-advantage * ratio, -advantage * clipped_ratio)
        # Where the clipped term wins the gradient is zero: the token is "clipped".
        clipped = (-advantage * clipped_ratio > -advantage * ratio).astype(jnp.float32)
        kl = jnp.zeros_like(logp) if ref_logp is None else self.kl(ref_logp - logp)
        return {"policy": policy, "kl": kl, "loss": policy + self.beta * kl, "clipped": clipped}

    def kl(self, delta: jax.Array) -> jax.Array:
        """Δ = log π_ref − log π_θ per token → the estimator of KL(π_θ ‖ π_ref)."""
        if self.kl_estimator == "k3":
            return jnp.exp(delta) - delta - 1
        return -delta


def loss_sums(objective: Objective, graphdef: nnx.GraphDef, params: Any, batch: dict,
              vocab_chunks: VocabChunks = VocabChunks()) -> tuple[jax.Array, dict]:
    """The train step's loss function (training/train_step.py's LossFn) for a [B, L] micro-batch
    of rollouts: batch["weights"] are `token_weights`, zero off the completion tokens."""
    model = nnx.merge(graphdef, params)
    logp = -model.token_losses(batch["inputs"], batch["targets"], batch["positions"],
                               batch["segment_ids"], vocab_chunks, objective.temperature)
    terms = objective.terms(logp, batch["old_logps"], batch.get("ref_logps"),
                            batch["advantages"])
    w, mask = batch["weights"], batch["completion_mask"]
    sums = {"tokens": jnp.sum(w), "policy_loss": jnp.sum(w * terms["policy"]),
            "kl": jnp.sum(w * terms["kl"]), "clipped": jnp.sum(mask * terms["clipped"]),
            "completion_tokens": jnp.sum(mask)}
    return jnp.sum(w * terms["loss"]), sums
