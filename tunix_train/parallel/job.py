"""Which multi-process job this process belongs to, read from the environment only: no JAX
import, so that the commands can ask it before Hydra starts (cli.py) at no cost.

Sources, first match wins (`discover`):
  1. our launcher, torchrun or by hand:  MASTER_ADDR MASTER_PORT RANK WORLD_SIZE
                                         [LOCAL_RANK LOCAL_WORLD_SIZE]; JAX's coordinator on
                                         MASTER_PORT, or MASTER_PORT + 2 under torchrun, whose
                                         store owns MASTER_PORT (parallel/torchrun.py)
  2. JAX's own variables:       JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID
  3. submitit's local executor (`hydra/launcher=submitit_local`): SUBMITIT_LOCAL_NTASKS
                                SUBMITIT_LOCAL_GLOBALID SUBMITIT_LOCAL_JOB_ID, on 127.0.0.1
  4. Open MPI (`mpirun`, inside a SLURM job or not): OMPI_COMM_WORLD_*, joined by JAX's
                                cluster detection
  5. SLURM (tasks of `srun`):   SLURM_JOB_ID SLURM_NTASKS SLURM_PROCID SLURM_LOCALID
                                SLURM_STEP_NODELIST, joined by JAX's cluster detection
     (`hydra/launcher=submitit_slurm` runs its tasks under srun: that is source 5)
Anything else is a single-process run and initialises nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from tunix_train.config import ConfigError
from tunix_train.parallel import torchrun
from tunix_train.parallel.launcher import LAUNCHER_ENV

_SOURCES = {"launcher": "started by python -m tunix_train.launch",
            "torchrun": "started by torchrun",
            "env": "MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE",
            "jax": "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID",
            "mpi": "Open MPI, detected by JAX"}
CLUSTERS = ("slurm", "mpi")  # joined by JAX's own cluster detection
# The devices of a scheduler's process are those it was given, shared out (cluster_device_ids).
SCHEDULED = (*CLUSTERS, "submitit")


@dataclass(frozen=True)
class Job:
    source: str  # launcher (ours) | torchrun | env (MASTER_* by hand) | jax | slurm | mpi
    #              | submitit (its local executor) | single
    coordinator: str | None = None  # host:port of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0
    local_rank: int = 0
    local_world_size: int = 1  # processes on this node
    # The run dir's name every process of a scheduler's job agrees on: slurm-<SLURM's job id>
    # (the same when the job is requeued), mpi-<mpirun's job id>; "" for other starts.
    run_name: str = ""
    # host:port where process 0 hands every process its run dir (rendezvous.py) before Hydra
    # starts, for processes started one by one (by hand, torchrun, JAX's variables).
    handshake: str | None = None

    def describe(self) -> str:
        """How the processes were started, for the start-up line."""
        if self.source == "slurm":
            return (f"SLURM job {self.run_name.removeprefix('slurm-')}, task {self.process_id} "
                    f"of {self.num_processes}")
        if self.source == "mpi":
            return f"Open MPI rank {self.process_id} of {self.num_processes}"
        if self.source == "submitit":
            return f"submitit local job, task {self.process_id} of {self.num_processes}"
        return _SOURCES[self.source]


def discover(env: Mapping[str, str] = os.environ) -> Job:
    """The job this process belongs to, read from the environment only (no JAX calls): the
    first of these launchers whose variables say the job has more than one process."""
    for reader in (_torch_style, _jax_style, _submitit, _mpi, _slurm):
        job = reader(env)
        if job is not None:
            return job
    return Job("single", run_name=_slurm_job(env))


def _torch_style(env: Mapping[str, str]) -> Job | None:
    """torchrun, tunix_train.launch, or the variables set by hand."""
    if int(env.get("WORLD_SIZE", 1)) <= 1:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK") if k not in env]
    if missing:
        raise ConfigError(f"WORLD_SIZE={env['WORLD_SIZE']} is set but {', '.join(missing)} "
                          f"is not; set all of MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE.")
    source = ("launcher" if env.get(LAUNCHER_ENV) else
              "torchrun" if torchrun.started_by_torchrun(env) else "env")
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    offset = torchrun.COORDINATOR_PORT_OFFSET if source == "torchrun" else 0
    return Job(source, f"{addr}:{port + offset}", int(env["WORLD_SIZE"]), int(env["RANK"]),
               **_local(env), handshake=f"{addr}:{port + 1}")


def _jax_style(env: Mapping[str, str]) -> Job | None:
    if int(env.get("JAX_NUM_PROCESSES", 1)) <= 1:
        return None
    coordinator = env.get("JAX_COORDINATOR_ADDRESS")
    handshake = None
    if coordinator:
        host, port = coordinator.rsplit(":", 1)
        handshake = f"{host}:{int(port) + 1}"
    return Job("jax", coordinator, int(env["JAX_NUM_PROCESSES"]),
               int(env.get("JAX_PROCESS_ID", 0)), **_local(env), handshake=handshake)


def _submitit(env: Mapping[str, str]) -> Job | None:
    """submitit's local executor: one node, tasks numbered 0..n-1."""
    if int(env.get("SUBMITIT_LOCAL_NTASKS", 1)) <= 1:
        return None
    tasks = int(env["SUBMITIT_LOCAL_NTASKS"])
    rank = int(env.get("SUBMITIT_LOCAL_GLOBALID", 0))
    return Job("submitit", f"127.0.0.1:{submitit_port(env['SUBMITIT_LOCAL_JOB_ID'])}",
               tasks, rank, rank, tasks)


def _mpi(env: Mapping[str, str]) -> Job | None:
    """mpirun, inside a SLURM job or not."""
    if int(env.get("OMPI_COMM_WORLD_SIZE", 1)) <= 1:
        return None
    mpirun_job = env.get("OMPI_MCA_orte_hnp_uri", "").split(".", 1)[0]  # "44105728.0;tcp…"
    return Job("mpi", None, int(env["OMPI_COMM_WORLD_SIZE"]),
               int(env.get("OMPI_COMM_WORLD_RANK", 0)),
               int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
               int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1)),
               _slurm_job(env) or (f"mpi-{mpirun_job}" if mpirun_job else ""))


def _slurm(env: Mapping[str, str]) -> Job | None:
    """srun's tasks."""
    if int(env.get("SLURM_NTASKS", 1)) <= 1:
        return None
    if "SLURM_STEP_NODELIST" not in env:
        raise ConfigError(
            f"SLURM_NTASKS={env['SLURM_NTASKS']} but this process is not a task of srun "
            f"(no SLURM_STEP_NODELIST): in an sbatch script, start training with srun "
            f"python run_training.py … (docs/multi_node.md, SLURM).")
    return Job("slurm", None, int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]),
               int(env.get("SLURM_LOCALID", 0)), _tasks_on_this_node(env), _slurm_job(env))


def _local(env: Mapping[str, str]) -> dict[str, int]:
    return dict(local_rank=int(env.get("LOCAL_RANK", 0)),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)))


def _slurm_job(env: Mapping[str, str]) -> str:
    """The run name a SLURM job gives its processes ("" outside one)."""
    return f"slurm-{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else ""


def submitit_port(job_id: str) -> int:
    """The coordinator's port of a submitit local job, the same in each of its tasks: derived
    from the job id (the pid of submitit's controller, unique on the machine while it runs),
    in 20000-31999, below Linux's ephemeral ports (32768 on) that other programs' connections
    take at random."""
    return 20000 + int(job_id) % 12000


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE ("2(x3),1": 2 on each of the first
    three nodes, 1 on the fourth) and SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1"))
    counts = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts[min(int(env.get("SLURM_NODEID", 0)), len(counts) - 1)]
