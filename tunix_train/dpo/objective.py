"""DPO's formulas: per-pair log-ratios, the three losses and the implicit rewards. Pure array
functions; tests/test_dpo.py checks each against NumPy.

A row of the batch holds one pair: prompt + chosen response as segment 1, prompt + rejected as
segment 2 (dpo/pairs.py), so one forward pass scores both. With log π(y|x) the sum of the
response tokens' log-probabilities (the prompt's are masked out) and

    h = [log π(y_w|x) − log π_ref(y_w|x)] − [log π(y_l|x) − log π_ref(y_l|x)],

the loss of a pair is

    sigmoid  −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)     DPO (Rafailov et al. 2023, eq. 7);
                                                      ε = label_smoothing: conservative DPO
    ipo      (h − 1/(2β))²                            IPO (Azar et al. 2023, eq. 17; sums of
                                                      log-probs as in the paper, not TRL's means)
    hinge    max(0, 1 − β·h)                          SLiC (Zhao et al. 2023)

and the implicit rewards are β·(log π − log π_ref) of each response; the accuracy counts pairs
whose chosen reward is the larger. Every sum is over pairs, so the train step's accumulation
(sum, then divide once by the pair count) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.config import DpoConfig
from tunix_train.models import partitioning
from tunix_train.models.head import VocabChunks

CHOSEN, REJECTED = 1, 2  # segment ids of a pair's two sequences in its row


@dataclass(frozen=True)
class Objective:
    beta: float
    loss: str
    label_smoothing: float

    @classmethod
    def of(cls, d: DpoConfig) -> Objective:
        return cls(d.beta, d.loss, d.label_smoothing)

    def pair_losses(self, h: jax.Array) -> jax.Array:
        """h (the log-ratio margin of each pair) → the loss of each pair."""
        beta = self.beta
        if self.loss == "sigmoid":
            eps = self.label_smoothing
            return -(1 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
        if self.loss == "ipo":
            return (h - 1 / (2 * beta)) ** 2
        if self.loss == "hinge":
            return jax.nn.relu(1 - beta * h)
        raise ValueError(f"unknown DPO loss {self.loss!r}")


def sequence_logps(token_logp_BxL: jax.Array, weights_BxL: jax.Array,
                   segment_ids_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: the summed log-probabilities of the chosen and of the rejected response's
    tokens (weights are 1 on response tokens, 0 on the prompt and padding)."""
    w = weights_BxL.astype(jnp.float32)
    logp = token_logp_BxL.astype(jnp.float32)
    chosen = jnp.sum(logp * w * (segment_ids_BxL == CHOSEN), axis=-1)
    rejected = jnp.sum(logp * w * (segment_ids_BxL == REJECTED), axis=-1)
    return partitioning.sequence_sum(chosen), partitioning.sequence_sum(rejected)


def pair_sums(objective: Objective, logp_BxL: jax.Array, ref_logp_BxL: jax.Array,
              weights_BxL: jax.Array, segment_ids_BxL: jax.Array) -> tuple[jax.Array, dict]:
    """(sum of pair losses, metric sums with "tokens" = the number of pairs). Rows without a
    pair (an evaluation batch's padding) count nothing. With each row split over cp devices
    (the train step) every one of them sees its pairs' whole sums and adds its share."""
    policy_w, policy_l = sequence_logps(logp_BxL, weights_BxL, segment_ids_BxL)
    ref_w, ref_l = sequence_logps(ref_logp_BxL, weights_BxL, segment_ids_BxL)
    chosen_tokens = partitioning.sequence_sum(
        jnp.sum(weights_BxL * (segment_ids_BxL == CHOSEN), axis=-1))
    pair = (chosen_tokens > 0).astype(jnp.float32) * partitioning.sequence_share()
    chosen_reward = objective.beta * (policy_w - ref_w)
    rejected_reward = objective.beta * (policy_l - ref_l)
    losses = objective.pair_losses((policy_w - ref_w) - (policy_l - ref_l))
    sums = {
        "tokens": jnp.sum(pair),
        "chosen_reward": jnp.sum(pair * chosen_reward),
        "rejected_reward": jnp.sum(pair * rejected_reward),
        "margin": jnp.sum(pair * (chosen_reward - rejected_reward)),
        "accuracy": jnp.sum(pair * (chosen_reward > rejected_reward)),
    }
    return jnp.sum(pair * losses), sums


def loss_sums(objective: Objective, graphdef: nnx.GraphDef, params: Any, batch: dict,
              vocab_chunks: VocabChunks = VocabChunks()) -> tuple[jax.Array, dict]:
    """The train step's loss function (training/train_step.py's LossFn) for a [B, L]
    micro-batch of pairs; batch["ref_logps"] holds the reference's token log-probabilities."""
    model = nnx.merge(graphdef, params)
    logp = -model.token_losses(batch["inputs"], batch["targets"], batch["positions"],
                               batch["segment_ids"], vocab_chunks)
    return pair_sums(objective, logp, batch["ref_logps"], batch["weights"],
                     batch["segment_ids"])


METRICS = ("chosen_reward", "rejected_reward", "margin", "accuracy")  # per pair, once divided


def per_pair(sums: dict, names: tuple[str, ...] = METRICS) -> dict:
    """The loss function's sums `names` divided by the pair count."""
    pairs = jnp.maximum(sums["tokens"], 1.0)
    return {name: sums[name] / pairs for name in names}
