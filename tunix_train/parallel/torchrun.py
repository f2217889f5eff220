"""What running under PyTorch's launcher (`torchrun`) changes.

torchrun's agent keeps a store of its own on MASTER_ADDR:MASTER_PORT, so the processes it starts
cannot put JAX's coordinator there as ours do: under torchrun the run-dir handshake takes
MASTER_PORT + 1 (as everywhere) and JAX's coordinator MASTER_PORT + 2. When a process fails,
torchrun stops the others with SIGTERM and prints a summary whose "Root Cause" is read from the
file named by TORCHELASTIC_ERROR_FILE: a process that ends on one of our one-sentence errors
writes the sentence there, so the summary shows it instead of "To enable traceback see …".
A process that torchrun stops says why (`STOPPED`), from its first moments (`say_why_when_stopped`,
while Python still imports) and in every wait on its peers (`parallel/waiting.py`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Mapping

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun for every process it starts
COORDINATOR_PORT_OFFSET = 2  # MASTER_PORT: torchrun's store; + 1: the run-dir handshake
CONSEQUENCE_DELAY_S = 2  # see record_error
STOPPED = ("torchrun stops every process of a job when one of them fails; that one's error is "
           "above, and in torchrun's summary under Root Cause")


def started_by_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    return bool(env.get(RUN_ID_ENV))


def why_stopped(env: Mapping[str, str] = os.environ) -> str:
    """What a SIGTERM most likely means to this process: under torchrun, with peers, that one
    of them failed ("" elsewhere)."""
    return STOPPED if started_by_torchrun(env) and int(env.get("WORLD_SIZE") or 1) > 1 else ""


def say_why_when_stopped(env: Mapping[str, str] = os.environ) -> None:
    """run_training.py's first step: a process of a torchrun job stopped before it waits on its
    peers (most often still importing, when another one failed at once) ends with `STOPPED` on
    stderr instead of silently. A wait on peers (`parallel/waiting.py`) has its own handler
    while it waits; the join leaves SIGTERM to JAX's preemption notifier."""
    if not why_stopped(env):
        return

    def stop(signum: int, _frame) -> None:
        sys.stderr.write(f"error: {signal.Signals(signum).name} received while starting; "
                         f"exiting: {STOPPED}.\n")
        sys.stderr.flush()
        os._exit(128 + signum)  # as a shell reports a process that a signal ended

    signal.signal(signal.SIGTERM, stop)


def record_error(sentence: str, consequence: bool = False,
                 env: Mapping[str, str] = os.environ) -> None:
    """Hands `sentence` to torchrun's failure summary (nothing outside torchrun). Its Root Cause
    is the failure with the earliest timestamp, in whole seconds, the lowest rank on a tie; a
    process killed by a signal writes no file and is dated when torchrun's agent sees it gone,
    which can be after a `consequence` (this process stopped because another failed) has ended
    and in the next second. So a consequence is dated two seconds later: the process that failed
    first is named unless the agent sees it more than a second after the consequence ended."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path or not started_by_torchrun(env):
        return
    stamp = int(time.time()) + (CONSEQUENCE_DELAY_S if consequence else 0)
    try:
        with open(path, "w") as file:
            json.dump({"message": sentence, "timestamp": str(stamp)}, file)
    except OSError:
        pass  # the summary then says less; the sentence is on stderr and in train.log anyway
