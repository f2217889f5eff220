"""What running under PyTorch's launcher (`torchrun`) changes.

torchrun's agent keeps a store of its own on MASTER_ADDR:MASTER_PORT, so the processes it starts
cannot put JAX's coordinator there as ours do: under torchrun the run-dir handshake takes
MASTER_PORT + 1 (as everywhere) and JAX's coordinator MASTER_PORT + 2. When a process fails,
torchrun stops the others with SIGTERM and prints a summary whose "Root Cause" is read from the
file named by TORCHELASTIC_ERROR_FILE: a process that ends on one of our one-sentence errors
writes the sentence there, so the summary shows it instead of "To enable traceback see …".
"""

from __future__ import annotations

import json
import os
import time
from typing import Mapping

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun for every process it starts
COORDINATOR_PORT_OFFSET = 2  # MASTER_PORT: torchrun's store; + 1: the run-dir handshake
CONSEQUENCE_DELAY_S = 2  # see record_error


def started_by_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    return bool(env.get(RUN_ID_ENV))


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
