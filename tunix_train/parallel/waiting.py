"""A wait on other processes that is never silent and never endless.

    with Waiting(lambda: "1 of 2 processes at 10.0.0.1:29500", timeout_s=300, exit_code=5,
                 on_timeout="start every process with the same MASTER_ADDR …"):
        jax.distributed.initialize(...)   # may block inside C++ for minutes

While the block runs, a thread says what is awaited after `first_s` seconds, then every
`every_s` seconds; past `timeout_s`
it logs one sentence and ends the process with `exit_code`; and SIGTERM or SIGINT end it at
once, with a line saying what it was waiting for. The thread does the ending (`os._exit`)
because the main thread may be blocked inside a C++ call that never returns to Python, where
a Python signal handler would never run: the signals reach the thread through Python's wakeup
file descriptor, which the interpreter's C-level handler writes from whatever thread received
the signal.

`keep_sigterm=True` leaves SIGTERM's handler as the block left it: `jax.distributed.initialize`
installs JAX's preemption notifier for SIGTERM after joining, and restoring ours would remove it.
`signals=False` leaves the signals alone (a wait inside a joined job, where SIGTERM is that
notifier's and a preemption notice must reach it): the wait is still said and still bounded.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from typing import Callable

from tunix_train.parallel import torchrun

log = logging.getLogger("tunix_train")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Waiting:
    def __init__(self, what: Callable[[], str] | str, timeout_s: float | None, exit_code: int,
                 on_timeout: str = "", every_s: float = 15.0, keep_sigterm: bool = False,
                 first_s: float = 5.0, signals: bool = True):
        self._what = what if callable(what) else (lambda: what)
        self.timeout_s, self.exit_code, self.every_s = timeout_s, exit_code, every_s
        self.first_s = min(first_s, every_s)
        self.on_timeout, self.keep_sigterm, self.signals = on_timeout, keep_sigterm, signals
        # What a signal while waiting most likely means; under torchrun, that a peer failed.
        self.on_signal = torchrun.why_stopped()
        self._done = threading.Event()
        self._previous: dict[int, object] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    def __enter__(self) -> "Waiting":
        self._start = time.monotonic()
        if self.signals and threading.current_thread() is threading.main_thread():
            self._catch_signals()
        threading.Thread(target=self._watch, name="tunix-waiting", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            for sig, handler in self._previous.items():
                if not (sig == signal.SIGTERM and self.keep_sigterm):
                    signal.signal(sig, handler)
            # The thread may be in select() on the read end: it closes both ends itself.

    def _catch_signals(self) -> None:
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        for sig in SIGNALS:
            # A Python-level handler makes the interpreter's C handler the process's; what it
            # does is never reached while the main thread is stuck, the thread below acts.
            self._previous[sig] = signal.signal(sig, lambda *_: None)
        self._old_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def _watch(self) -> None:
        next_line = self._start + self.first_s
        try:
            while not self._done.is_set():
                now = time.monotonic()
                if self.timeout_s is not None and now - self._start > self.timeout_s:
                    self._exit(f"{self._what()}: gave up after {self.timeout_s:g} s"
                               + (f"; {self.on_timeout}" if self.on_timeout else ""))
                if now >= next_line:
                    log.warning("waiting for %s (%.0f s%s)", self._what(), now - self._start,
                                f" of {self.timeout_s:g}" if self.timeout_s is not None else "")
                    next_line += self.every_s
                self._wait_for_signal(min(0.5, max(next_line - now, 0.01)))
        finally:
            if self._pipe is not None:
                for fd in self._pipe:
                    os.close(fd)

    def _wait_for_signal(self, seconds: float) -> None:
        if self._pipe is None:
            self._done.wait(seconds)
            return
        ready, _, _ = select.select([self._pipe[0]], [], [], seconds)
        if ready and not self._done.is_set():
            received = os.read(self._pipe[0], 64)
            name = signal.Signals(received[-1]).name if received else "a signal"
            self._exit(f"{name} received while waiting for {self._what()}; exiting"
                       + (f": {self.on_signal}" if self.on_signal else ""), signalled=True)

    def _exit(self, sentence: str, signalled: bool = False) -> None:
        log.error("error: %s (exit code %d).", sentence, self.exit_code)
        if not signalled:  # a stopped process is not the cause of its job's end
            torchrun.record_error(sentence)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(self.exit_code)
