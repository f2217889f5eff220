"""What a sweep's console says while Hydra's submitit launcher waits on its jobs.

`-m hydra/launcher=submitit_local|submitit_slurm` submits one job per point and then blocks in
`job.results()` until all have ended: minutes to hours in which the console would print
nothing. This Hydra callback (configs/config.yaml, `hydra.callbacks`) watches submitit's
folder from a thread of the sweep's own process and says what it waits for: the jobs once
submitted (where their output goes), each one that finishes, and every minute that passes
without one. Other launchers run their points in this process, which logs for itself.

Reads submitit's files only (`<job id>_submitted.pkl` when a job is submitted,
`<job id>_<task>_result.pkl` when a task has ended), so it never touches the scheduler.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

POLL_S = 2.0
QUIET_S = 60.0


class SweepProgress(Callback):
    """Started by Hydra at `-m`; a no-op unless the launcher is submitit's."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict:
        """Submitit pickles the launcher, with Hydra's callbacks, into every job: the job
        gets a callback of its own, not this process's thread."""
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = config.hydra.launcher
        target = str(launcher.get("_target_", ""))
        if "submitit" not in target:
            return
        executor = "slurm" if "Slurm" in target else "local"
        folder = Path(str(launcher.submitit_folder).split("%j")[0].rstrip("/"))
        sweep = Path(str(config.hydra.sweep.dir))
        self._thread = threading.Thread(target=self._watch, args=(folder, sweep, executor),
                                        name="sweep-progress", daemon=True)
        self._thread.start()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=POLL_S * 2)

    def _watch(self, folder: Path, sweep: Path, executor: str) -> None:
        said = (0, 0)
        quiet_since = time.monotonic()
        while True:
            stopping = self._stop.wait(POLL_S)  # the last look after the sweep has ended
            submitted, finished = jobs_in(folder)
            if (submitted, finished) != said:
                if submitted and not said[0]:
                    where = " (`squeue --me` lists them)" if executor == "slurm" else ""
                    log.info("sweep: %d job(s) submitted to submitit's %s executor%s; waiting "
                             "for them. Their output: %s/<job id>/<job id>_<task>_log.out|err; "
                             "each point's run dir: %s/<point>/", submitted, executor, where,
                             folder, sweep)
                if finished != said[1]:
                    log.info("sweep: %d of %d job(s) finished", finished, submitted)
                said, quiet_since = (submitted, finished), time.monotonic()
            elif submitted and time.monotonic() - quiet_since >= QUIET_S:
                log.info("sweep: still waiting on %d of %d job(s) of submitit's %s executor "
                         "(output: %s)", submitted - finished, submitted, executor, folder)
                quiet_since = time.monotonic()
            if stopping:
                return


def jobs_in(folder: Path) -> tuple[int, int]:
    """(jobs submitted, jobs with a finished task) in submitit's `folder`."""
    submitted = {p.name.removesuffix("_submitted.pkl") for p in folder.rglob("*_submitted.pkl")}
    finished = {p.name.rsplit("_", 2)[0] for p in folder.rglob("*_result.pkl")}
    return len(submitted), len(finished & submitted)
