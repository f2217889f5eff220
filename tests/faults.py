"""Fault injection for tests: a poisoned batch, a hung step, a kill mid-save, slow steps.

Read once at start-up from the environment variable `TUNIX_TRAIN_FAULTS` (JSON), so a normal
run pays one dict lookup and a few integer comparisons per step. Not a user feature: it lets the
end-to-end tests drive the real CLI into the failures that checkpointing, the NaN policy and
the watchdog exist for. Steps are 1-based, as logged ("step 6/10" is the update that makes
the state's step 6).

    TUNIX_TRAIN_FAULTS='{"nan_at_step": 6}'            # that step's batch has NaN loss weights
    TUNIX_TRAIN_FAULTS='{"hang_at_step": 3}'           # the host stops after step 3
    TUNIX_TRAIN_FAULTS='{"kill_in_save_at_step": 4}'   # SIGKILL while step 4's save is in flight
    TUNIX_TRAIN_FAULTS='{"step_delay_s": 0.3}'         # every step takes 0.3 s longer
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

ENV = "TUNIX_TRAIN_FAULTS"
log = logging.getLogger("tunix_train")


@dataclass(frozen=True)
class Faults:
    nan_at_step: Optional[int] = None
    hang_at_step: Optional[int] = None
    kill_in_save_at_step: Optional[int] = None
    step_delay_s: float = 0.0

    def batch(self, step: int, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """NaN weights make the loss and every gradient NaN: a non-finite step, on demand."""
        if step != self.nan_at_step:
            return batch
        log.warning("fault injection: NaN loss weights in the batch of step %d", step)
        return {**batch, "weights": batch["weights"] * jnp.nan}  # keeps the sharding

    def after_step(self, step: int) -> None:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if step == self.hang_at_step:
            log.warning("fault injection: hanging after step %d", step)
            _hang()

    def after_save_started(self, step: int) -> None:
        if step == self.kill_in_save_at_step:
            # The async save has only just started writing: this is a crash mid-save.
            log.warning("fault injection: SIGKILL while the save of step %d is in flight", step)
            os.kill(os.getpid(), signal.SIGKILL)


def _hang() -> None:
    while True:
        time.sleep(3600)


def load() -> Faults:
    text = os.environ.get(ENV)
    return Faults(**json.loads(text)) if text else Faults()
