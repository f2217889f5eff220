"""The training loop: step → check → log → evaluate → save, until the end, preemption or NaN.

Host↔device traffic is deliberate:
- After dispatching step s the host waits for step s-1 (it has finished or is about to), never
  for step s itself: the device always has the next step queued, the host never runs more than
  one step ahead (so the watchdog times real steps), and no transfer is made.
- Every step's metrics are fetched after the next step is dispatched (one step late, when they
  are ready) and checked for non-finite values: `training.nan_policy=halt` stops at most one
  step after a bad one. Before a save the saved step itself is checked too, so a checkpoint never
  holds a state that `halt` would have refused.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax

from tunix_train.analysis import profiling
from tunix_train.checkpoint import Checkpoints
from tunix_train.config import ConfigError, LoggingConfig, TrainingConfig
from tunix_train.data.pipeline import GlobalBatches
from tunix_train.training import optim
from tunix_train.training.metrics import MetricsWriter, Throughput, format_line
from tunix_train.training.preemption import PreemptionSignal
from tunix_train.training.watchdog import Watchdog

log = logging.getLogger("tunix_train")


class NonFiniteLoss(FloatingPointError):
    """training.nan_policy=halt met a non-finite step; the message names it."""


class StepHooks:
    """Points in a run (the loop's, and one before it) where the tests inject failures
    (tests/faults.py). A real run uses these no-ops: nothing in the package can switch them
    on. Steps are 1-based, as logged."""

    def before_start_checks(self) -> None:
        """The state is restored or initialised; the checks the processes make together
        (the checkpoint folder's room) come next."""

    def batch(self, step: int, batch: dict) -> dict:
        return batch

    def after_step(self, step: int) -> None:
        """Step `step` is dispatched and step - 1 has finished."""

    def after_save_started(self, step: int) -> None:
        """The save of `step` is in flight."""


@dataclass
class Loop:
    train_step: Callable
    data: GlobalBatches
    evaluate: Callable[[Any], dict[str, float]] | None  # held-out metrics; None: no evaluation
    writer: MetricsWriter
    checkpoints: Checkpoints
    hooks: StepHooks
    training: TrainingConfig
    logging: LoggingConfig
    step_timeout_s: float  # distributed.step_timeout_s
    throughput: Throughput
    saved_config: dict  # the run's resolved config, saved with every checkpoint
    summary: dict = field(default_factory=dict)
    _unchecked: list = field(default_factory=list)  # [(step, device metrics)] not yet fetched
    _done_at: dict = field(default_factory=dict)  # step → when the host first saw it finished
    _skipped: int = 0  # skipped updates counted so far (optimizer state survives resumes)

    def run(self, state, first: int) -> tuple[Any, dict]:
        """Steps first + 1 … training.steps, from `state` (whose step is `first`)."""
        self._skipped = int(jax.device_get(optim.skipped_updates(state["opt_state"])))
        self.summary.update(final_step=first, preempted=False, skipped_steps=self._skipped)
        with PreemptionSignal() as preemption, Watchdog(self.step_timeout_s, first + 1) as watchdog:
            for step in range(first + 1, self.training.steps + 1):
                state = self._step(state, step, watchdog)
                stop = preemption.reached(step)
                self._after_step(state, step, stop, watchdog)
                if stop:
                    log.warning("stopped after step %d for preemption; checkpoint saved", step)
                    self.summary["preempted"] = True
                    break
        return state, self.summary

    def _step(self, state, step: int, watchdog: Watchdog):
        previous = self._unchecked[-1] if self._unchecked else None
        if previous is not None and not (isinstance(loss := previous[1]["loss"], jax.Array)
                                         and not loss.is_ready()):
            self._finished(previous[0])  # a step that runs to its end on the host (GRPO's)
        state, metrics = self.train_step(state, self.hooks.batch(step, self._next_batch(step)))
        if previous is not None:
            jax.block_until_ready(previous[1]["loss"])  # step-1 is done; step is queued behind
            self._finished(previous[0])
        watchdog.beat(step)
        self.writer.tick(step)
        self.hooks.after_step(step)
        self._unchecked.append((step, metrics))
        self.summary["final_step"] = step
        return state

    def _next_batch(self, step: int) -> dict:
        try:
            return next(self.data)
        except ConfigError as error:  # a bad record deep in a large file, met mid-run
            saved = self.checkpoints.latest_step()  # committed once the run dir is closed
            kept = (f"its checkpoint of step {saved} is kept: fix it and run the same command "
                    f"again to go on from there" if saved is not None else
                    f"it saved no checkpoint (checkpoint.every_steps="
                    f"{self.checkpoints.cfg.every_steps}): fix it and run the same command again")
            raise ConfigError(f"{error} The run stopped before step {step}; {kept}.") from None

    def _after_step(self, state, step: int, stop: bool, watchdog: Watchdog) -> None:
        save = stop or self.checkpoints.due(step) or step == self.training.steps
        self.checkpoints.raise_if_failed()  # a save in the background whose writes failed
        self._check(up_to=step - 1)  # finished: fetching its few scalars costs no wait
        if save:
            self._check(up_to=step)  # waits for this step: still timed by the watchdog
            with watchdog.paused():
                self._save(state, step)
        if self._eval_due(step) and not stop:  # the grace period is for saving
            with watchdog.paused(f"the evaluation at step {step} to finish"):
                values = self.evaluate(state)
            self.writer.scalars(step, values, group="eval")
            log.info("step %d | validation %s", step,
                     " | ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def _log_due(self, step: int) -> bool:
        every, total = self.logging.every_steps, self.training.steps
        return step > 0 and (step % every == 0 or step == total)

    def _eval_due(self, step: int) -> bool:
        every = self.training.eval_every_steps
        return (self.evaluate is not None and bool(every) and step % every == 0
                and step != self.training.steps)

    def _check(self, up_to: int) -> None:
        """Fetches the unchecked steps ≤ up_to: non-finite ones halt or count; logged ones log."""
        ready = [(s, m) for s, m in self._unchecked if s <= up_to]
        self._unchecked = [(s, m) for s, m in self._unchecked if s > up_to]
        for step, metrics in zip([s for s, _ in ready], jax.device_get([m for _, m in ready])):
            self._finished(step)  # the last step: its fetch waited for it
            values = {k: float(v) for k, v in metrics.items() if k != "tokens"}
            values["skipped_steps"] = int(values["skipped_steps"])
            self._check_finite(step, values)
            if self._log_due(step):
                self._report(step, values)

    def _check_finite(self, step: int, values: dict[str, float]) -> None:
        skipped = values["skipped_steps"]
        if math.isfinite(values["loss"]) and skipped == self._skipped:
            return
        self._skipped = self.summary["skipped_steps"] = skipped
        if self.training.nan_policy == "halt":
            latest = self.checkpoints.manager.latest_step()
            saved = f"the latest checkpoint is step {latest}" if latest else "no checkpoint yet"
            raise NonFiniteLoss(
                f"non-finite loss or gradients at step {step}: training.nan_policy=halt stopped "
                f"without applying it and {saved} (set training.nan_policy=skip to skip such "
                f"steps)")
        log.warning("step %d: non-finite loss or gradients, update skipped (%d skipped so far)",
                    step, skipped)

    def _finished(self, step: int) -> None:
        self._done_at.setdefault(step, time.perf_counter())

    def _report(self, step: int, values: dict[str, float]) -> None:
        # Rates up to when the step finished, not to when it is reported: the last step is
        # reported right after the one before it, and a synchronous step (GRPO's) after the
        # next one has run.
        values.update(self.throughput.interval(step, self._done_at[step]))
        self._done_at = {s: t for s, t in self._done_at.items() if s > step}
        values.update(profiling.memory_scalars())  # peak device memory, where the backend counts
        self.summary.setdefault("first_loss", values["loss"])
        self.summary["last_loss"] = values["loss"]
        self.writer.scalars(step, values)
        self.writer.progress(step, values)
        log.info(format_line(step, self.training.steps, values))

    def _save(self, state, step: int) -> None:
        if self.checkpoints.save(step, state, self.data.get_state(), self.saved_config):
            log.info("checkpoint of step %d started", step)
            self.hooks.after_save_started(step)
