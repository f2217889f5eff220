"""Stuck-step watchdog: a training step slower than `distributed.step_timeout_s` is a hang.

A hung collective (a dead peer, a deadlocked NCCL ring) blocks the host forever and keeps
renting the machines. The loop calls `beat()` once per step; a daemon thread that sees no beat
for `timeout_s` logs every thread's Python stack (to train.log and the console) and ends the
process with `EXIT_CODE`. The first beat arms it, so the first step's compilation is not timed;
`paused()` exempts work that is not a training step (evaluation, the blocking part of a save).
What it does not time it still says (`untimed`): the first step, and a pause given a name,
running past `SAY_EVERY_S` are logged then and every `SAY_EVERY_S` after, so a hang there is
not silent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from typing import Iterator, Optional

from tunix_train.parallel.waiting import Waiting

log = logging.getLogger("tunix_train")

EXIT_CODE = 4


SAY_EVERY_S = 300.0  # what runs untimed says so this often


def untimed(what: str, say_every_s: float = SAY_EVERY_S) -> Waiting:
    """Around work no timeout bounds (a first compilation, an evaluation): said every
    `say_every_s` while it lasts, signals left alone (SIGTERM is the preemption notice's)."""
    return Waiting(f"{what}, not timed by distributed.step_timeout_s", None, 0,
                   every_s=say_every_s, first_s=say_every_s, signals=False)


class Watchdog:
    def __init__(self, timeout_s: float, first_step: int = 1, say_every_s: float = SAY_EVERY_S):
        self.timeout_s, self.say_every_s = timeout_s, say_every_s
        self._lock = threading.Lock()
        self._last_beat: Optional[float] = None  # None until armed, and while paused
        self._step = 0
        self._first_step: Optional[Waiting] = untimed(f"step {first_step}'s batch and "
                                                      "compilation", say_every_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tunix-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        self._first_step.__enter__()  # said until the first beat
        return self

    def __exit__(self, *exc) -> None:
        self._first_said()
        self._stop.set()
        self._thread.join()

    def beat(self, step: int) -> None:
        self._first_said()
        with self._lock:
            self._last_beat, self._step = time.monotonic(), step

    def _first_said(self) -> None:
        if self._first_step is not None:
            self._first_step.__exit__(None, None, None)
            self._first_step = None

    @contextlib.contextmanager
    def paused(self, what: Optional[str] = None) -> Iterator[None]:
        """Not timed while inside; said as `what` if named (a save says its own waits)."""
        with self._lock:
            armed, self._last_beat = self._last_beat is not None, None
        try:
            with untimed(what, self.say_every_s) if what else contextlib.nullcontext():
                yield
        finally:
            if armed:
                self.beat(self._step)

    def _watch(self) -> None:
        poll_s = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll_s):
            with self._lock:
                last, step = self._last_beat, self._step
            if last is not None and time.monotonic() - last > self.timeout_s:
                self._trip(step + 1, time.monotonic() - last)

    def _trip(self, step: int, elapsed_s: float) -> None:
        log.error("step %d has not finished after %.0f s (distributed.step_timeout_s=%s): the "
                  "job is stuck; exiting with code %d. Python stacks of all threads:\n%s",
                  step, elapsed_s, self.timeout_s, EXIT_CODE, all_stacks())
        for handler in logging.getLogger().handlers:
            handler.flush()
        # os._exit, not sys.exit: the main thread is the one that is stuck.
        os._exit(EXIT_CODE)


def all_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sorted(sys._current_frames().items(),  # noqa: SLF001 - the documented way
                    key=lambda item: item[0] != threading.main_thread().ident)  # main first
    parts = []
    for ident, frame in frames:
        stack = "".join(traceback.format_stack(frame))
        parts.append(f'Thread "{names.get(ident, ident)}":\n{stack}')
    return "\n".join(parts)
