"""One GRPO step's data: prompts → completions (the compiled KV-cache sampler on the training
mesh) → rewards → advantages → the update batch the train step reads.

Shapes never change from step to step: prompts are left-padded to P = data.seq_len −
grpo.max_new_tokens columns and completions take the remaining N, so the sampler, the reference
scorer and the update step each compile once. A row of the update batch is

    [pad … pad | prompt | completion (N columns, zeros after EOS)]

with `segment_ids` 0 on the padding (it attends only to itself) and positions counted from
the prompt's first token, as the sampler saw them. The completion's tokens are the targets at
columns P−1 … P+N−2; those columns carry the sampler's log-probabilities (π_old), the
advantage and the aggregation weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tunix_train.config import GrpoConfig
from tunix_train.data import tokenizer as tokenizer_lib
from tunix_train.grpo import objective as objective_lib
from tunix_train.grpo.prompts import Prompt
from tunix_train.grpo.rewards import Rewards
from tunix_train.inference.sampler import Sampler, SamplingOptions
from tunix_train.models import quantization
from tunix_train.parallel import distributed
from tunix_train.parallel import sharding as sharding_lib
from tunix_train.parallel.sharding import global_array as _global
from tunix_train.training.setup import Setup

EXTRA_INPUTS = ("old_logps", "advantages", "completion_mask")  # float32 batch entries


@dataclass
class Rollouts:
    """Completions of one step and what was made of them (host arrays, S = prompts × G rows)."""

    prompts: list[Prompt]  # one per row
    tokens: np.ndarray  # [S, N], 0 after EOS
    counts: np.ndarray  # [S] tokens generated, EOS included
    logps: np.ndarray  # [S, N] sampler log-probabilities (π_old)
    texts: list[str]  # decoded completions, EOS left out
    rewards: np.ndarray  # [S] weighted total
    each_reward: dict[str, np.ndarray]  # [S] per reward function
    advantages: np.ndarray  # [S]
    eos: np.ndarray  # [S] bool: the completion ended with EOS


class RolloutMaker:
    def __init__(self, setup: Setup, g: GrpoConfig, tokenizer: tokenizer_lib.Tokenizer,
                 rewards: Rewards):
        self.setup, self.g, self.tokenizer, self.rewards = setup, g, tokenizer, rewards
        self.new_tokens = g.max_new_tokens
        self.prompt_tokens = setup.batch.seq_len - g.max_new_tokens
        self.eos_id = -1 if tokenizer.eos_id is None else tokenizer.eos_id
        layout, mesh = setup.params, setup.mesh
        weights = sharding_lib.gathered_over_fsdp(layout.merged_shardings())
        # Decoding keeps each sequence whole: rows over fsdp, and with cp every device of a cp
        # group decodes its group's rows (only the update step splits sequences).
        rules = sharding_lib.whole_sequences(layout.rules.params)
        self.rows = sharding_lib.batch_sharding(mesh, dict(rules))
        options = SamplingOptions(g.max_new_tokens, g.temperature, g.top_k, self.eos_id, g.top_p)
        job_timeout_s = setup.cfg.distributed.init_timeout_s
        self.sampler = Sampler(layout.graphdef, weights, options, layout.compute_dtype, mesh,
                               rules, rows=self.rows, job_timeout_s=job_timeout_s)
        dtype = layout.compute_dtype
        # The policy's weights for decoding: cast once per step and gathered over fsdp, so
        # no generated token waits for a gather.
        self.for_decoding = distributed.first_run_together(
            jax.jit(lambda p: quantization.cast(p, dtype), out_shardings=weights),
            "the cast of the weights for decoding", job_timeout_s)

    def make(self, params: Any, prompts: list[Prompt], rng: jax.Array) -> Rollouts:
        """Rollouts of `params`, the model's whole tree (with LoRA: adapters and base)."""
        g = self.g
        rows = [p for p in prompts for _ in range(g.num_generations)]  # groups are consecutive
        padded, lengths = self.left_padded(rows)
        tokens, counts, logps = jax.device_get(self.sampler.rollouts(
            self.for_decoding(params), _global(padded, self.rows),
            _global(lengths, NamedSharding(self.rows.mesh, P(*self.rows.spec[:1]))), rng))
        eos = np.array([c > 0 and row[c - 1] == self.eos_id for row, c in zip(tokens, counts)])
        texts = [self.tokenizer.decode(row[:c - int(e)].tolist())
                 for row, c, e in zip(tokens, counts, eos)]
        fields = {name: [p.fields[name] for p in rows] for name in rows[0].fields}
        total, each = self.rewards([p.text for p in rows], texts, counts.tolist(), fields)
        total, each = _agreed((total, each))
        advantages = objective_lib.advantages(total.reshape(-1, g.num_generations),
                                              g.advantage).reshape(-1)
        return Rollouts(rows, tokens, counts, logps, texts, total, each, advantages, eos)

    def left_padded(self, rows: list[Prompt]) -> tuple[np.ndarray, np.ndarray]:
        padded = np.zeros((len(rows), self.prompt_tokens), np.int32)
        for i, prompt in enumerate(rows):
            padded[i, self.prompt_tokens - len(prompt.ids):] = prompt.ids
        return padded, np.array([len(p.ids) for p in rows], np.int32)

    def update_batch(self, r: Rollouts, aggregation: str) -> dict[str, np.ndarray]:
        """The [accum, rows, seq_len] arrays of the update step (see the module docstring)."""
        P, N = self.prompt_tokens, self.new_tokens
        padded, lengths = self.left_padded(r.prompts)
        tokens = np.concatenate([padded, r.tokens.astype(np.int32)], axis=1)  # [S, P + N]
        S, L = tokens.shape
        columns = np.arange(L)[None, :]
        starts = (P - lengths)[:, None]
        targets = np.concatenate([tokens[:, 1:], np.zeros((S, 1), np.int32)], axis=1)
        # Completion token j is the target at column P - 1 + j, for j < count.
        completion = (columns >= P - 1) & (columns < P - 1 + r.counts[:, None])
        old = np.zeros((S, L), np.float32)
        old[:, P - 1:P - 1 + N] = r.logps
        batch = {
            "inputs": tokens, "targets": targets,
            "positions": np.maximum(columns - starts, 0).astype(np.int32),
            "segment_ids": (columns >= starts).astype(np.int32),
            "completion_mask": completion.astype(np.float32),
            "weights": objective_lib.token_weights(completion, aggregation),
            "old_logps": np.where(completion, old, 0.0).astype(np.float32),
            "advantages": np.broadcast_to(r.advantages[:, None], (S, L)).astype(np.float32),
        }
        shape = self.setup.batch
        return {k: v.reshape(shape.accum, shape.rows, L) for k, v in batch.items()}


def _agreed(tree: Any) -> Any:
    """Process 0's values everywhere: a reward function need not be deterministic."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))
