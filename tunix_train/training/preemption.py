"""SIGTERM / SIGINT → finish the current step, save, exit 0; every process at the same step.

Schedulers announce preemption with SIGTERM (SLURM, Kubernetes, cloud spot VMs) and then kill
after a grace period; people press Ctrl-C. Either way the loop should stop at a step boundary,
save and leave. With several processes no process may decide alone: a checkpoint is a
collective write, so all must stop after the same step.

- One process: Python handlers set a flag; the loop reads it after each step.
- Several processes: JAX's preemption sync point. `jax.distributed.initialize` starts a
  preemption notifier that catches SIGTERM in C++; the notice goes through the coordination
  service to every process, which agree in the background on a step (one past the furthest
  process's current step). `reached(step)` — called every step by every process, a local check
  while nothing happened — is then True at that same step everywhere. SIGINT is turned into
  SIGTERM so Ctrl-C takes the same path. No Python SIGTERM handler is installed there: it would
  replace JAX's.

A second signal gets the default behaviour back (Ctrl-C twice interrupts at once).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import jax
from jax.experimental import multihost_utils

log = logging.getLogger("tunix_train")


class PreemptionSignal:
    def __init__(self) -> None:
        self._requested = False
        self._multi = jax.process_count() > 1
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "PreemptionSignal":
        signals = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        self._restore_handlers()

    def reached(self, step: int) -> bool:
        """True once, at the step after which every process stops and saves."""
        if self._multi:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._requested

    def _on_signal(self, signum: int, _frame) -> None:
        self._restore_handlers()
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)  # into JAX's notifier: all processes agree
            return
        log.warning("%s received: finishing this step, saving a checkpoint, then exiting",
                    signal.Signals(signum).name)
        self._requested = True

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
