"""Which saved step a restore reads (checkpoint.py's `restore` and `load_params`): the newest
that every process reads whole. A step proven damaged (a file missing or truncated) is passed
over, said in one line and set aside; any other read error is retried, then stops everything
(`StorageError`, exit code 6) with nothing moved; anything else is raised at once.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from tunix_train.checkpoint_storage import first_line, is_storage
from tunix_train.config import ConfigError
from tunix_train.paths import StorageError

log = logging.getLogger("tunix_train")

# Tensorstore's status codes for data that is not there or not whole: proof of damage.
DAMAGE_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION")
READ_ATTEMPTS = 3  # other read errors are retried this often, with growing pauses
RETRY_PAUSE_S = 1.0


def newest_readable(directory: Path, steps: list[int],
                    read: Callable[[int], Any]) -> tuple[Any, list[int]]:
    """Tries `read` from the newest step down; every process must succeed on the same step.
    Only a step proven damaged is passed over; any other error stops everything."""
    damaged: list[int] = []
    for i, step in enumerate(steps):
        result, error = _read_with_retries(read, step)
        outcome = "ok" if error is None else "damaged" if _proves_damage(error) else "failed"
        outcomes = _gather(outcome)
        if outcomes == {"ok"}:
            return result, damaged
        if "failed" in outcomes:
            reason = first_line(error) if outcome == "failed" else "on another process"
            raise StorageError(
                f"could not read checkpoint step {step} in {directory} after {READ_ATTEMPTS} "
                f"attempts ({reason}); nothing was moved: check the storage and start again.")
        damaged.append(step)
        fallback = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "none left"
        reason = first_line(error) if error else "another process could not read it"
        log.warning("checkpoint step %d in %s is damaged or incomplete (%s); %s", step,
                    directory, reason, fallback)
    raise ConfigError(f"no readable checkpoint in {directory} (steps {steps} are all damaged: "
                      f"files missing or truncated); move the directory aside to start afresh "
                      f"or point checkpoint.resume_from at a good one.")


def _read_with_retries(read: Callable[[int], Any], step: int) -> tuple[Any, Exception | None]:
    for attempt in range(READ_ATTEMPTS):
        try:
            return read(step), None
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted below into damage, storage and bugs
            if not (_proves_damage(e) or is_storage(e)):
                raise
            if _proves_damage(e) or attempt + 1 == READ_ATTEMPTS:
                return None, e
            log.warning("reading checkpoint step %d failed (%s); retrying", step,
                        first_line(e))
            time.sleep(RETRY_PAUSE_S * 2 ** attempt)
    raise AssertionError("unreachable")


def _proves_damage(error: BaseException) -> bool:
    """Whether `error` (or one it came from) says data is missing or not whole."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, (FileNotFoundError, json.JSONDecodeError, EOFError)):
            return True
        if str(seen).startswith(DAMAGE_CODES):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _gather(outcome: str) -> set[str]:
    """Every process's outcome (they must agree on which step to restore)."""
    if jax.process_count() == 1:
        return {outcome}
    codes = ("ok", "damaged", "failed")
    gathered = multihost_utils.process_allgather(np.array(codes.index(outcome)))
    return {codes[int(c)] for c in np.ravel(gathered)}


def set_aside(directory: Path, steps: list[int], destination: Path) -> None:
    if jax.process_index() == 0:
        destination.mkdir(parents=True, exist_ok=True)
        for step in steps:
            target, copy = destination / str(step), 1
            while target.exists():  # an earlier damaged copy of the same step number
                target, copy = destination / f"{step}.{copy}", copy + 1
            shutil.move(str(directory / str(step)), str(target))
            log.warning("moved damaged checkpoint step %d to %s", step, target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("tunix_train:damaged checkpoints set aside")
