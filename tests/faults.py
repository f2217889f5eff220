"""Fault injection for the tests: a poisoned batch, a hung step, SIGKILL mid-step or mid-save.

Only `tests/faulty_training.py` (run_training.py with these hooks) reads the variable below;
`python run_training.py` and the package never do. Steps are 1-based, as logged ("step 6/10" is
the update that makes the state's step 6).

    FAULTS='{"nan_at_step": 6}'            # that step's batch has NaN loss weights
    FAULTS='{"hang_at_step": 3}'           # the host stops after step 3
    FAULTS='{"hang_before_start_checks_in_process": 1}'  # process 1 stops (alive) before the
                                           # start-up checks the processes make together
    FAULTS='{"kill_at_step": 5}'           # SIGKILL while step 5 runs on the device
    FAULTS='{"kill_in_save_at_step": 4}'   # SIGKILL while step 4's save is in flight
    FAULTS='{"kill_in_save_at_step": 4, "save_dir": "<run dir>/checkpoints"}'  # once its
                                           # temporary directory exists there (not before)
    FAULTS='{"pause_at_step": 2, "resume_file": "/tmp/go"}'  # wait after step 2 for the file
    FAULTS='{"log_steps": true}'           # a line per dispatched step
    FAULTS='{"check_all_bytes": 0}'        # JSON lines files checked as if large (first lines)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from tunix_train.training.loop import StepHooks

ENV = "TUNIX_TRAIN_TEST_FAULTS"
log = logging.getLogger("tunix_train")


@dataclass(frozen=True)
class Faults(StepHooks):
    nan_at_step: Optional[int] = None
    hang_at_step: Optional[int] = None
    hang_before_start_checks_in_process: Optional[int] = None
    kill_at_step: Optional[int] = None
    kill_in_save_at_step: Optional[int] = None
    save_dir: Optional[str] = None  # with kill_in_save_at_step: wait for the save's files there
    pause_at_step: Optional[int] = None
    resume_file: Optional[str] = None
    log_steps: bool = False
    check_all_bytes: Optional[int] = None  # for data.sources.CHECK_ALL_BYTES

    @classmethod
    def from_env(cls) -> "Faults":
        text = os.environ.get(ENV)
        return cls(**json.loads(text)) if text else cls()

    def before_start_checks(self) -> None:
        if jax.process_index() == self.hang_before_start_checks_in_process:
            log.warning("fault injection: hanging before the start-up checks")
            _hang()

    def batch(self, step: int, batch: dict) -> dict:
        """NaN weights make the loss and every gradient NaN: a non-finite step, on demand."""
        if step != self.nan_at_step:
            return batch
        log.warning("fault injection: NaN loss weights in the batch of step %d", step)
        return {**batch, "weights": batch["weights"] * jnp.nan}  # keeps the sharding

    def after_step(self, step: int) -> None:
        if self.log_steps:
            log.info("fault injection: step %d dispatched", step)
        if step == self.kill_at_step:
            log.warning("fault injection: SIGKILL while step %d runs", step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.pause_at_step:
            log.warning("fault injection: paused after step %d until %s exists", step,
                        self.resume_file)
            while not os.path.exists(self.resume_file):
                time.sleep(0.05)
        if step == self.hang_at_step:
            log.warning("fault injection: hanging after step %d", step)
            _hang()

    def after_save_started(self, step: int) -> None:
        if step == self.kill_in_save_at_step:
            # The async save has only just started writing: this is a crash mid-save. Orbax
            # makes the step's temporary directory on its own thread: on a loaded machine
            # that can come after this line, so wait for it where a test looks for it.
            if self.save_dir is not None:
                log.warning("fault injection: waiting for step %d's save to write in %s", step,
                            self.save_dir)
                _wait_for(lambda: any(Path(self.save_dir).glob(f"{step}.*")), 60)
            log.warning("fault injection: SIGKILL while the save of step %d is in flight", step)
            os.kill(os.getpid(), signal.SIGKILL)


def _hang() -> None:
    while True:
        time.sleep(3600)


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
