"""Joining a multi-process job (parallel/job.py says which): `jax.distributed.initialize`.

Joining never waits in silence: a line every 15 s says for whom; past
`distributed.init_timeout_s`, or on SIGTERM/SIGINT, the process ends with exit code 5 and one
sentence (parallel/waiting.py), even though JAX's client blocks inside C++ meanwhile. Once
joined, a process that JAX aborts (a peer gone, a missed barrier) prints every thread's Python
stack on stderr: where it was when the job ended; and the checks every process makes together
before the first step (`together`), and the first run of each program (`first_run_together`),
are said and bounded the same way.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import logging
import os
import signal
import socket
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from tunix_train import backend
from tunix_train.config import ConfigError, DistributedConfig
from tunix_train.parallel.job import CLUSTERS, SCHEDULED, Job, discover
from tunix_train.parallel.launcher import LAUNCHER_ENV
from tunix_train.parallel import torchrun
from tunix_train.parallel.rendezvous import PEERS_EXIT_CODE
from tunix_train.parallel.waiting import Waiting

log = logging.getLogger(__name__)

# JAX aborts the whole process (no Python exception) when its own initialisation deadline
# passes, so our watchdog fires first and says what to fix; JAX's deadline is a backstop.
_JAX_DEADLINE_MARGIN_S = 30
INIT_TIMEOUT_EXIT_CODE = PEERS_EXIT_CODE  # the exit code table is in docs/monitoring.md


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
    where = job.coordinator or "the coordinator JAX reads from the scheduler's variables"
    hint = (f"start every process with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE="
            f"{job.num_processes}, or raise distributed.init_timeout_s")
    if job.source in SCHEDULED:
        hint = ("check that every task of the job runs the same command, or raise "
                "distributed.init_timeout_s")
    if job.process_id == 0 and job.source not in CLUSTERS and job.coordinator:
        check_coordinator_port(job)
    # keep_sigterm: once joined, JAX's preemption notifier owns SIGTERM (training/preemption.py).
    with Waiting(f"the {job.num_processes} processes of the job to join at {where} (this is "
                 f"process {job.process_id})", cfg.init_timeout_s, INIT_TIMEOUT_EXIT_CODE, hint,
                 keep_sigterm=True):
        jax.distributed.initialize(**_initialize_args(cfg, job))
    # JAX's coordination service aborts every process of a job (SIGABRT) when one of them
    # fails or misses a barrier: each then prints where its threads were (Python's stacks).
    faulthandler.enable(all_threads=True)
    check_homogeneous(jax.devices())
    log.info("process %d of %d (%s); %d local devices of %d: %s", jax.process_index(),
             jax.process_count(), job.describe(), jax.local_device_count(),
             jax.device_count(), jax.devices()[0].device_kind)
    share_compilation_cache()
    return job


def share_compilation_cache() -> None:
    """Lets every process of a multi-process CPU job read the programs JAX's persistent
    compilation cache holds.

    JAX keys a program by, among others, its devices' topology, which a CPU client describes
    from its own process: in each process the same program gets another key, and only process 0
    writes entries, so process 0 alone would load a program that the others compile, and
    reach its first collective that much sooner. Gloo waits 30 s at most for the peers of a
    collective it has not run before (XLA's GlooKeyValueStore): a compile longer than that
    (the train step, on a loaded machine) failed the job with `Gloo context initialization
    failed`. Keyed by its devices' kinds instead, as JAX keys a program for a backend that has
    no topology to describe (the device assignment, every device's global id, stays in the
    key), a program has one key in every process: all load it, or all compile it. A JAX
    without that hook gets the cache turned off for the job, and every process compiles.
    """
    if (jax.process_count() == 1 or not backend.is_cpu()
            or not jax.config.jax_enable_compilation_cache
            or not jax.config.jax_compilation_cache_dir):
        return
    try:
        from jax._src import cache_key
        cache_key._hash_accelerator_config  # noqa: B018 - replaced only where JAX has it
        by_kinds = cache_key._hash_devices
    except (ImportError, AttributeError):
        jax.config.update("jax_enable_compilation_cache", False)
        if jax.process_index() == 0:
            log.info("persistent compilation cache (%s) off for this multi-process CPU job: "
                     "its keys would differ between processes, so process 0 would load "
                     "programs that the others compile, and run ahead of them",
                     jax.config.jax_compilation_cache_dir)
        return
    cache_key._hash_accelerator_config = by_kinds


def check_coordinator_port(job: Job) -> None:
    """Process 0 starts JAX's coordinator; if its port is taken, JAX's gRPC server crashes the
    process (SIGSEGV, no Python error). Binding it first turns that into one sentence."""
    port = int(job.coordinator.rsplit(":", 1)[1])
    fix = {"torchrun": f"give torchrun another --master_port (tunix_train uses it + 1 and + 2: "
                       f"{port - torchrun.COORDINATOR_PORT_OFFSET} is torchrun's own store)",
           "jax": "set JAX_COORDINATOR_ADDRESS to a free port on every process"}.get(
        job.source, "start every process of the job with another MASTER_PORT")
    try:
        with socket.create_server(("", port)):
            pass
    except OSError as error:
        cause = os.strerror(error.errno) if error.errno else str(error)
        raise ConfigError(f"process 0 cannot start JAX's coordinator on port {port} of this "
                          f"machine ({cause}; the job's coordinator address is "
                          f"{job.coordinator}): {fix}.") from None


def _initialize_args(cfg: DistributedConfig, job: Job,
                     env: Mapping[str, str] = os.environ) -> dict:
    args = dict(initialization_timeout=cfg.init_timeout_s + _JAX_DEADLINE_MARGIN_S,
                heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    if job.source in SCHEDULED:  # the GPUs the scheduler gave this process
        ids = cluster_device_ids(job, env)
        if ids is not None:
            args["local_device_ids"] = ids
    elif job.local_world_size > 1:
        # One process per GPU: each process sees only the device of its local rank (CPU
        # backends ignore this).
        args["local_device_ids"] = [job.local_rank]
    if job.source not in CLUSTERS:  # JAX's cluster detection reads these for slurm and mpi
        args.update(coordinator_address=job.coordinator, num_processes=job.num_processes,
                    process_id=job.process_id)
    return args


def cluster_device_ids(job: Job, env: Mapping[str, str] = os.environ) -> list[int] | None:
    """The GPUs a SLURM task, Open MPI rank or submitit local task uses, numbered among those
    it sees. JAX's own choice under SLURM and Open MPI is the GPU numbered by the local rank,
    which is wrong twice: a task bound to its own GPU (`--gpus-per-task`,
    CUDA_VISIBLE_DEVICES=its one GPU) sees it as GPU 0, and a task alone on its node
    (`--ntasks-per-node=1 --gpus-per-node=4`) should use all four. The rule: the GPUs it sees
    (CUDA_VISIBLE_DEVICES, else the machine's), shared out evenly between the node's processes
    unless SLURM bound them per task. None without GPUs (JAX's CPU backend ignores the
    choice)."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    hidden = "CUDA_VISIBLE_DEVICES" in env and not visible  # set empty: no GPU for it
    count = 0 if hidden else len(visible) or _machine_gpus()
    if count == 0:
        return None
    share = job.local_world_size
    if env.get("SLURM_GPUS_PER_TASK") or count % share:
        return list(range(count))
    each = count // share
    return list(range(job.local_rank * each, (job.local_rank + 1) * each))


def _machine_gpus() -> int:
    """NVIDIA GPUs the driver lists (no CUDA call: JAX's backend must start after initialize)."""
    listed = Path("/proc/driver/nvidia/gpus")
    return len(list(listed.iterdir())) if listed.is_dir() else 0


EXIT_GRACE_S = 120  # after leaving the job, the longest a process may take to exit


def leave() -> None:
    """A process of a multi-process job leaves it here rather than in JAX's exit hook, where
    the wait was silent: JAX's shutdown barrier waits for every process (and after its 300 s
    aborts them all), said every 30 s. Past the barrier, a process that has not exited within
    EXIT_GRACE_S (a thread that never ends) prints every thread's stack and exits 1: a job
    does not hang on its way out."""
    if jax.process_count() == 1:
        return
    with Waiting("the other processes to finish and leave the job", None, PEERS_EXIT_CODE,
                 every_s=30, first_s=30):
        jax.distributed.shutdown()
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)


def together(check: str, timeout_s: float) -> contextlib.AbstractContextManager:
    """Around a start-up check that every process of the job makes together (a collective on
    the host, before the watchdog's first step): a process waiting there for the others says so
    after 5 s and every 15 s, naming `check`, and past `timeout_s` (distributed.init_timeout_s)
    ends with one sentence and exit code 5. Without it a process stuck before the check, but
    alive (its heartbeat going on, so JAX never declares it gone), kept the others waiting in
    the collective for ever, in silence. SIGTERM stays JAX's preemption notifier's."""
    if jax.process_count() == 1:
        return contextlib.nullcontext()
    return Waiting(f"the other processes of the job at {check}", timeout_s, PEERS_EXIT_CODE,
                   "a process of the job is stuck before it or gone; its own lines say where "
                   "(raise distributed.init_timeout_s if one is only slow to get there)",
                   signals=False)


_FIRST_RUNS = itertools.count()  # the processes of a job reach their first runs in one order


def first_run_together(run: Callable, what: str, timeout_s: float) -> Callable:
    """`run` (a compiled program, or a jitted function) whose first run every process of the
    job starts together: each compiles it first (a jitted function from its first arguments,
    into the cache its calls read), then waits for the others at a barrier of JAX's
    coordination service (`together`: said after 5 s, bounded by `timeout_s`), then runs it.
    XLA's CPU collectives (gloo) connect a group of devices at its first collective and give
    the others a fixed 30 s to arrive: a process that had compiled an evaluation step more
    than 30 s before another ended the job (`Gloo context initialization failed: …
    GetKeyValue() timed out`). The barrier is not a device collective, which would meet the
    same deadline. One process: `run` itself."""
    if jax.process_count() == 1:
        return run
    from orbax.checkpoint import multihost

    ran = False

    def first_together(*args, **kwargs) -> Any:
        nonlocal ran
        if not ran:
            if hasattr(run, "lower"):  # a jitted function: compiled here, not in the call
                run.lower(*args, **kwargs).compile()
            key = f"tunix_train: first run {next(_FIRST_RUNS)}, {what}"
            with together(f"the first run of {what}", timeout_s):
                # Past timeout_s the wait above ends the process; JAX's own deadline is later.
                multihost.get_barrier_sync_fn()(key=key, timeout_ms=int(timeout_s + 60) * 1000)
            ran = True
        return run(*args, **kwargs)

    return first_together


def check_same_run_dir(run_dir: Path, timeout_s: float) -> None:
    """Refuses a job whose processes write to different run dirs (each would wait for ever on
    the others' checkpoint commits): one sentence naming them, on every process. Waits for the
    others at most `timeout_s` (`together`)."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    encoded = np.zeros(4096, np.uint8)
    text = str(run_dir.resolve()).encode()[:4096]
    encoded[:len(text)] = np.frombuffer(text, np.uint8)
    with together("the check that they share one run dir", timeout_s):
        gathered = multihost_utils.process_allgather(encoded)
    gathered = np.asarray(gathered).reshape(-1, 4096)
    dirs = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gathered]
    if len(set(dirs)) > 1:
        named = "; ".join(f"process {i}: {d}" for i, d in enumerate(dirs))
        raise ConfigError(f"the processes of this job write to different run dirs ({named}); "
                          f"give them all the same hydra.run.dir, or start them with python -m "
                          f"tunix_train.launch.")


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
