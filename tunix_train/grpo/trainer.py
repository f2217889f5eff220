"""`trainer=grpo`: GRPO's part (`GrpoTask`) of the one run of training/run.py.

    prompts, rewards → (run: restore or initialise) → reference weights (training/reference.py)
    → the loop's step is `GrpoStep`: rollouts (rollouts.py), then grpo.num_iterations updates
      of the train step with GRPO's loss (objective.py)

A step is one batch of rollouts: `training.global_batch_size` completions (its micro-batches
and gradient accumulation as in the default trainer), `grpo.num_generations` per prompt.
`training.steps` counts these steps; the optimizer makes num_iterations updates in each, and
its schedule spans all of them. Checkpoints hold the policy, the optimizer state and the
prompt position; the sampling key of step s is fold_in(key(training.seed), s), so a resumed
run draws what the uninterrupted one would have. The reference model is not saved: it is
re-derived from the run's own source (checkpoint.init_params_from, model.init_from or the
random initialisation of training.seed).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config, ConfigError
from tunix_train.data import tokenizer as tokenizer_lib
from tunix_train.grpo import objective as objective_lib
from tunix_train.grpo.prompts import PromptOrder, read_prompts
from tunix_train.grpo.rewards import Rewards
from tunix_train.grpo.rollouts import EXTRA_INPUTS, RolloutMaker, Rollouts
from tunix_train.models import families
from tunix_train.parallel.sharding import on_devices
from tunix_train.training import reference as reference_lib
from tunix_train.training import run as run_lib
from tunix_train.training.loop import StepHooks
from tunix_train.training.metrics import MetricsWriter
from tunix_train.training.setup import Setup

log = logging.getLogger("tunix_train")

SAMPLES_SHOWN = 4  # completions written as TensorBoard text every grpo.sample_every_steps


def run(cfg: Config, run_dir: Path, hooks: StepHooks = StepHooks()) -> dict[str, Any]:
    return run_lib.run(cfg, run_dir, GrpoTask, hooks)


class GrpoTask(run_lib.Task):
    """trainer=grpo's part of the run: prompts in, rollouts and num_iterations updates a step."""

    mfu = False  # a step is mostly sampling, whose FLOPs the training formula does not count

    def __init__(self, setup: Setup):
        cfg, g = setup.cfg, setup.cfg.grpo
        if setup.batch.sequences % g.num_generations:
            raise ConfigError(
                f"grpo.num_generations={g.num_generations} does not divide the "
                f"{setup.batch.sequences} completions of a step (training.micro_batch_size × "
                f"fsdp × gradient_accumulation_steps, or training.global_batch_size); use a "
                f"multiple of {g.num_generations}.")
        self.setup, self.g = setup, g
        self.tokenizer = tokenizer_lib.open_tokenizer(cfg.data.tokenizer)
        tokenizer_lib.check_vocab(self.tokenizer, cfg.model.vocab_size)
        self.prompts = read_prompts(cfg.data, self.tokenizer, setup.batch.seq_len -
                                    g.max_new_tokens, families.of(cfg.model).chat_turn)
        self.rewards = Rewards.create(g, self.prompts[0].fields)
        self.inputs = PromptOrder(self.prompts, setup.batch.sequences // g.num_generations,
                                  cfg.training.seed)
        self.reference = self.score = None

    @staticmethod
    def loss(cfg: Config) -> tuple[Callable, dict[str, Any]]:
        extra = {name: jnp.float32 for name in EXTRA_INPUTS}
        if cfg.grpo.beta > 0:
            extra["ref_logps"] = jnp.float32
        return functools.partial(objective_lib.loss_sums, objective_lib.Objective.of(cfg.grpo)), \
            extra

    def steps_done(self, state) -> int:
        return int(jax.device_get(state["step"])) // self.g.num_iterations

    def start(self, state, writer: MetricsWriter, first_step: int) -> None:
        g, setup = self.g, self.setup
        log.info("grpo: %d prompts; %d per step × %d generations, %d prompt + %d new tokens; "
                 "rewards %s", len(self.prompts), self.inputs.per_step, g.num_generations,
                 setup.batch.seq_len - g.max_new_tokens, g.max_new_tokens, ", ".join(g.rewards))
        if g.beta > 0:
            self.reference = reference_lib.starting_weights(setup, "the KL penalty")
            self.score = reference_lib.scorer(setup, g.temperature)
        self.writer, self.first_step = writer, first_step

    def step(self, update: Callable) -> Callable:
        return GrpoStep(self, RolloutMaker(self.setup, self.g, self.tokenizer, self.rewards),
                        update)

    def evaluator(self) -> None:
        return None  # progress is the reward, logged every step

    def close(self) -> None:
        pass


class GrpoStep:
    """The Loop's step: (state, prompts) → (state, metrics), one batch of rollouts."""

    def __init__(self, task: GrpoTask, rollouts: RolloutMaker, update: Callable):
        self.task, self.setup, self.g = task, task.setup, task.g
        self.rollouts, self.update = rollouts, update
        self.writer, self.step = task.writer, task.first_step
        self.key = jax.random.key(self.setup.cfg.training.seed)

    def __call__(self, state, prompts) -> tuple[Any, dict]:
        self.step += 1
        start = time.perf_counter()
        policy = self.setup.state.model_params(state)
        r = self.rollouts.make(policy, prompts, jax.random.fold_in(self.key, self.step))
        rollout_s = time.perf_counter() - start
        batch = on_devices(self.rollouts.update_batch(r, self.g.loss_aggregation),
                           self.setup.batch_sharding)
        if self.task.score is not None:
            batch["ref_logps"] = self.task.score(
                reference_lib.params_of(self.task.reference, self.setup, state), batch)
        updates = []
        for _ in range(self.g.num_iterations):
            state, metrics = self.update(state, batch)
            updates.append(metrics)
        jax.block_until_ready(state["step"])  # the next rollouts need these weights anyway
        update_s = time.perf_counter() - start - rollout_s
        if self.step % self.g.sample_every_steps == 0 or self.step == 1:
            self._show_samples(r)
        return state, {**_update_metrics(updates), **_rollout_metrics(r, rollout_s, update_s)}

    def _show_samples(self, r: Rollouts) -> None:
        shown = [f"**prompt** {r.prompts[i].text!r}\n**completion** {r.texts[i]!r}\n"
                 f"**reward** {r.rewards[i]:.3f}" for i in range(min(SAMPLES_SHOWN, len(r.texts)))]
        self.writer.text(f"samples/step_{self.step}", "\n\n".join(shown))


def _update_metrics(updates: list[dict]) -> dict:
    """Over the step's num_iterations updates (device arrays: nothing waits here): the mean
    loss (non-finite if any was), the last update's norm, rate and skip count."""
    mean = lambda key, by: jnp.mean(jnp.stack([m[key] / m[by] for m in updates]))  # noqa: E731
    last = updates[-1]
    return {
        "loss": jnp.mean(jnp.stack([m["loss"] for m in updates])),
        "grad_norm": last["grad_norm"], "lr": last["lr"], "tokens": last["tokens"],
        "skipped_steps": last["skipped_steps"],
        "policy_loss": mean("policy_loss", "tokens"), "kl": mean("kl", "tokens"),
        "clip_fraction": mean("clipped", "completion_tokens"),
    }


def _rollout_metrics(r: Rollouts, rollout_s: float, update_s: float) -> dict[str, float]:
    values = {
        "reward_mean": float(r.rewards.mean()), "reward_std": float(r.rewards.std()),
        "completion_length_mean": float(r.counts.mean()),
        "completion_length_max": float(r.counts.max()),
        "eos_fraction": float(r.eos.mean()),
        "rollout_s": rollout_s, "update_s": update_s,
        "rollout_tokens_per_s": float(r.counts.sum()) / max(rollout_s, 1e-9),
    }
    for name, each in r.each_reward.items():
        values[f"reward/{name}_mean"] = float(np.mean(each))
        values[f"reward/{name}_std"] = float(np.std(each))
    return values
