"""`trainer=grpo`: the default trainer's Setup, Loop, checkpoints and metrics, with a GRPO step.

    setup (training/setup.py) → prompts, rewards → restore or initialise → reference weights
    → Loop (training/loop.py), whose step is `GrpoStep`: rollouts (rollouts.py), then
      grpo.num_iterations updates of the train step with GRPO's loss (objective.py)

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
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train import validation
from tunix_train.checkpoint import Checkpoints
from tunix_train.config import Config, ConfigError
from tunix_train.data import tokenizer as tokenizer_lib
from tunix_train.grpo import objective as objective_lib
from tunix_train.grpo.prompts import PromptOrder, read_prompts
from tunix_train.grpo.rewards import Rewards
from tunix_train.grpo.rollouts import (EXTRA_INPUTS, RolloutMaker, Rollouts, on_devices,
                                      reference_scorer)
from tunix_train.models import families
from tunix_train.parallel import distributed
from tunix_train.training.loop import Loop, StepHooks
from tunix_train.training.metrics import MetricsWriter, Throughput, setup_process_logging
from tunix_train.training.run import (already_complete, finishing, log_startup,
                                      report_startup_costs)
from tunix_train.training.setup import Setup
from tunix_train.training.state import FROZEN

log = logging.getLogger("tunix_train")

SAMPLES_SHOWN = 4  # completions written as TensorBoard text every grpo.sample_every_steps


def run(cfg: Config, run_dir: Path, hooks: StepHooks = StepHooks()) -> dict[str, Any]:
    validation.validate(cfg)
    job = distributed.initialize(cfg.distributed)
    distributed.check_same_run_dir(run_dir)
    setup_process_logging(jax.process_index())
    setup = Setup.create(cfg, processes_per_node=job.local_world_size)
    g = cfg.grpo
    if setup.batch.sequences % g.num_generations:
        raise ConfigError(
            f"grpo.num_generations={g.num_generations} does not divide the "
            f"{setup.batch.sequences} completions of a step (training.micro_batch_size × fsdp × "
            f"gradient_accumulation_steps, or training.global_batch_size); use a multiple of "
            f"{g.num_generations}.")
    tokenizer = tokenizer_lib.open_tokenizer(cfg.data.tokenizer)
    tokenizer_lib.check_vocab(tokenizer, cfg.model.vocab_size)
    prompts = read_prompts(cfg.data, tokenizer, setup.batch.seq_len - g.max_new_tokens,
                           families.of(cfg.model).chat_turn)
    rewards = Rewards.create(g, prompts[0].fields)
    order = PromptOrder(prompts, setup.batch.sequences // g.num_generations, cfg.training.seed)
    state = setup.initial_state(run_dir, order)
    first_step = int(jax.device_get(state["step"])) // g.num_iterations
    if first_step >= cfg.training.steps:
        return already_complete(first_step)
    writer = MetricsWriter(run_dir, cfg.logging, cfg.training.steps, first_step)
    log_startup(setup, state, writer)
    log.info("grpo: %d prompts; %d per step × %d generations, %d prompt + %d new tokens; "
             "rewards %s", len(prompts), order.per_step, g.num_generations,
             setup.batch.seq_len - g.max_new_tokens, g.max_new_tokens, ", ".join(g.rewards))
    step = GrpoStep(setup, RolloutMaker(setup, g, tokenizer, rewards), _compiled_update(
        setup, writer, run_dir), _reference(setup, run_dir), writer, first_step)
    checkpoints = Checkpoints(run_dir, cfg.checkpoint)
    try:
        with writer.console():
            loop = Loop(step, order, lambda state: math.nan, writer, checkpoints, hooks,
                        cfg.training, cfg.logging, cfg.distributed.step_timeout_s,
                        Throughput(first_step, setup.tokens_per_step),
                        setup.saved_config(state.get(FROZEN)))
            state, summary = loop.run(state, first_step)
            with finishing(summary["final_step"]):
                checkpoints.close()
    finally:
        checkpoints.close()
        writer.close()
    return summary


def _compiled_update(setup: Setup, writer: MetricsWriter, run_dir: Path):
    """The train step with GRPO's loss, compiled ahead of time (its costs reported like the
    default trainer's)."""
    loss_fn = functools.partial(objective_lib.loss_sums, objective_lib.Objective.of(setup.cfg.grpo))
    extra = {name: jnp.float32 for name in EXTRA_INPUTS}
    if setup.cfg.grpo.beta > 0:
        extra["ref_logps"] = jnp.float32
    compiled = setup.compile_train_step(loss_fn, extra)
    report_startup_costs(setup, compiled, writer, run_dir)
    return setup.runnable(compiled, loss_fn)


ADAPTERS_OFF = "adapters off"  # LoRA's reference: the frozen base (GrpoStep.reference_params)


def _reference(setup: Setup, run_dir: Path):
    """The frozen reference weights (sharded like the policy's), None when grpo.beta = 0, and
    ADAPTERS_OFF with LoRA."""
    cfg = setup.cfg
    if cfg.grpo.beta == 0:
        return None
    if cfg.lora.on:
        log.info("reference model for the KL penalty: the LoRA base, adapters off")
        return ADAPTERS_OFF
    if cfg.checkpoint.init_params_from:
        params = setup.params.run_params(cfg.checkpoint.init_params_from)
        source = cfg.checkpoint.init_params_from
    else:
        params = setup.params.initial_params(cfg.training.seed)
        source = cfg.model.init_from or f"the random initialisation of seed {cfg.training.seed}"
    log.info("reference model for the KL penalty: %s", source)
    return params


class GrpoStep:
    """The Loop's step: (state, prompts) → (state, metrics), one batch of rollouts."""

    def __init__(self, setup: Setup, rollouts: RolloutMaker, update, reference,
                 writer: MetricsWriter, first_step: int):
        g = setup.cfg.grpo
        self.setup, self.g, self.rollouts, self.update = setup, g, rollouts, update
        self.reference, self.writer, self.step = reference, writer, first_step
        self.score = reference_scorer(setup, g.temperature) if reference is not None else None
        self.key = jax.random.key(setup.cfg.training.seed)

    def __call__(self, state, prompts) -> tuple[Any, dict]:
        self.step += 1
        start = time.perf_counter()
        policy = self.setup.state.model_params(state)
        r = self.rollouts.make(policy, prompts, jax.random.fold_in(self.key, self.step))
        rollout_s = time.perf_counter() - start
        batch = on_devices(self.rollouts.update_batch(r, self.g.loss_aggregation),
                           self.setup.batch_sharding)
        if self.score is not None:
            batch["ref_logps"] = self.score(self.reference_params(state), batch)
        updates = []
        for _ in range(self.g.num_iterations):
            state, metrics = self.update(state, batch)
            updates.append(metrics)
        jax.block_until_ready(state["step"])  # the next rollouts need these weights anyway
        update_s = time.perf_counter() - start - rollout_s
        if self.step % self.g.sample_every_steps == 0 or self.step == 1:
            self._show_samples(r)
        return state, {**_update_metrics(updates), **_rollout_metrics(r, rollout_s, update_s)}

    def reference_params(self, state) -> Any:
        """The reference's whole parameter tree. With LoRA the reference is the base itself,
        the adapters switched off (zeros in their place: no second copy of the base)."""
        if self.reference is not ADAPTERS_OFF:
            return self.reference
        off = jax.tree.map(jnp.zeros_like, state["params"])
        return self.setup.state.model_params({**state, "params": off})

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
