"""Joining a multi-process job: environment discovery and `jax.distributed.initialize`.

Sources, first match wins:
  1. our launcher or torchrun:  MASTER_ADDR MASTER_PORT RANK WORLD_SIZE [LOCAL_RANK LOCAL_WORLD_SIZE]
  2. JAX's own variables:       JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID
  3. SLURM or Open MPI:         left to JAX's cluster detection (`initialize()` with no address)
Anything else is a single-process run and initialises nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

import jax

from tunix_train.config import ConfigError, DistributedConfig
from tunix_train.parallel.launcher import LAUNCHER_ENV

log = logging.getLogger(__name__)

# JAX aborts the whole process (no Python exception) when its own initialisation deadline
# passes, so our watchdog fires first and says what to fix; JAX's deadline is a backstop.
_JAX_DEADLINE_MARGIN_S = 30
INIT_TIMEOUT_EXIT_CODE = 5  # 2 config error, 3 non-finite loss, 4 stuck step (see cli.py)


@dataclass(frozen=True)
class Job:
    source: str  # launcher | jax | cluster | single
    coordinator: str | None = None  # host:port of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0
    local_rank: int = 0
    local_world_size: int = 1  # processes on this node


def discover(env: Mapping[str, str] = os.environ) -> Job:
    """The job this process belongs to, read from the environment only (no JAX calls)."""
    local = dict(local_rank=int(env.get("LOCAL_RANK", 0)),
                 local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)))
    if int(env.get("WORLD_SIZE", 1)) > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK") if k not in env]
        if missing:
            raise ConfigError(f"WORLD_SIZE={env['WORLD_SIZE']} is set but {', '.join(missing)} "
                              f"is not; set all of MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.")
        return Job("launcher", f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                   int(env["WORLD_SIZE"]), int(env["RANK"]), **local)
    if int(env.get("JAX_NUM_PROCESSES", 1)) > 1:
        return Job("jax", env.get("JAX_COORDINATOR_ADDRESS"), int(env["JAX_NUM_PROCESSES"]),
                   int(env.get("JAX_PROCESS_ID", 0)), **local)
    if int(env.get("SLURM_NTASKS", 1)) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", 1)) > 1:
        return Job("cluster", local_world_size=int(
            env.get("SLURM_NTASKS_PER_NODE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1))))
    return Job("single")


def die_with_launcher(env: Mapping[str, str] = os.environ) -> None:
    """Under our launcher: this process gets SIGKILL when the launcher dies, however it dies
    (Linux's parent-death signal, set here rather than in a preexec_fn)."""
    launcher = env.get(LAUNCHER_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != int(launcher):  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def initialize(cfg: DistributedConfig) -> Job:
    """Initialises jax.distributed for a multi-process job; checks the devices match."""
    die_with_launcher()
    job = discover()
    if job.source == "single":
        return job
    with _init_watchdog(cfg.init_timeout_s, job):
        jax.distributed.initialize(**_initialize_args(cfg, job))
    check_homogeneous(jax.devices())
    log.info("process %d of %d (%s); %d local devices of %d: %s", jax.process_index(),
             jax.process_count(), job.source, jax.local_device_count(), jax.device_count(),
             jax.devices()[0].device_kind)
    return job


def _initialize_args(cfg: DistributedConfig, job: Job) -> dict:
    args = dict(initialization_timeout=cfg.init_timeout_s + _JAX_DEADLINE_MARGIN_S,
                heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    if job.source != "cluster":
        args.update(coordinator_address=job.coordinator, num_processes=job.num_processes,
                    process_id=job.process_id)
    if job.local_world_size > 1 and job.source != "cluster":
        # One process per GPU: each process sees only the device of its local rank (CPU
        # backends ignore this). Under SLURM / Open MPI, JAX's cluster detection decides.
        args["local_device_ids"] = [job.local_rank]
    return args


class _init_watchdog:
    """Exits with one clear sentence if the job does not form within `timeout_s`."""

    def __init__(self, timeout_s: int, job: Job):
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(timeout_s, job), daemon=True)

    def _watch(self, timeout_s: int, job: Job) -> None:
        if self._done.wait(timeout_s):
            return
        log.error(
            "error: distributed.init_timeout_s=%d passed before all %d processes joined the "
            "coordinator at %s (this is process %d); start every process with the same "
            "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise distributed.init_timeout_s.",
            timeout_s, job.num_processes, job.coordinator or "the cluster's", job.process_id)
        logging.shutdown()
        os._exit(INIT_TIMEOUT_EXIT_CODE)  # the main thread is blocked inside JAX's C++ client

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()


def check_homogeneous(devices: Sequence[jax.Device]) -> None:
    """Refuses a job whose processes have different device kinds or counts."""
    per_process: dict[int, list[str]] = defaultdict(list)
    for device in devices:
        per_process[device.process_index].append(device.device_kind)
    shapes = {(len(kinds), frozenset(kinds)) for kinds in per_process.values()}
    if len(shapes) > 1 or any(len(set(kinds)) > 1 for kinds in per_process.values()):
        described = "; ".join(
            f"process {p}: {len(kinds)} × {', '.join(sorted(set(kinds)))}"
            for p, kinds in sorted(per_process.items()))
        raise ConfigError(f"Devices are not homogeneous: {described}; run each kind of device "
                          f"as its own job.")
