"""Environment discovery, the homogeneity check and the cross-process mesh layout (no processes)."""

import logging
import signal
import time
from collections import namedtuple

import pytest

from tunix_train.parallel import distributed
from tunix_train.parallel import job as job_lib
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.parallel import torchrun
from tunix_train.config import ConfigError, DistributedConfig

FakeDevice = namedtuple("FakeDevice", "id process_index device_kind")


def test_launcher_and_torchrun_variables():
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "5", "WORLD_SIZE": "8",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    job = job_lib.discover(env)
    assert job == job_lib.Job("env", "10.0.0.1:29500", 8, 5, 1, 4,  # not our launcher
                                  handshake="10.0.0.1:29501")
    args = distributed._initialize_args(DistributedConfig(init_timeout_s=7), job)
    assert args["local_device_ids"] == [1]  # one process per GPU
    assert args["process_id"] == 5 and args["initialization_timeout"] > 7
    # torchrun's store owns MASTER_PORT: the run dir's handshake and JAX's coordinator go above
    torchrun = job_lib.discover({**env, "TORCHELASTIC_RUN_ID": "abc"})
    assert (torchrun.source, torchrun.coordinator, torchrun.handshake) == (
        "torchrun", "10.0.0.1:29502", "10.0.0.1:29501")
    assert torchrun.describe() == "started by torchrun"
    assert distributed._initialize_args(DistributedConfig(), torchrun)[
        "coordinator_address"] == "10.0.0.1:29502"


def test_jax_variables_and_cluster_detection():
    job = job_lib.discover({"JAX_COORDINATOR_ADDRESS": "h:1234", "JAX_NUM_PROCESSES": "2",
                                "JAX_PROCESS_ID": "1"})
    assert (job.source, job.coordinator, job.num_processes, job.process_id, job.handshake) == (
        "jax", "h:1234", 2, 1, "h:1235")
    slurm = job_lib.discover({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "7", "SLURM_PROCID": "5",
                                  "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                                  "SLURM_STEP_NODELIST": "node[1-3]",
                                  "SLURM_STEP_TASKS_PER_NODE": "3(x2),1"})
    assert slurm == job_lib.Job("slurm", None, 7, 5, 1, 1, "slurm-77")  # node 2: 1 task
    assert slurm.describe() == "SLURM job 77, task 5 of 7"
    mpi_env = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3",
               "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
               "OMPI_MCA_orte_hnp_uri": "441057280.0;tcp://10.0.0.2:43517"}
    mpi = job_lib.discover(mpi_env)
    assert mpi == job_lib.Job("mpi", None, 8, 3, 3, 4, "mpi-441057280")
    assert mpi.describe() == "Open MPI rank 3 of 8"
    in_slurm = job_lib.discover({**mpi_env, "SLURM_JOB_ID": "5", "SLURM_NTASKS": "8"})
    assert in_slurm.run_name == "slurm-5"  # mpirun in a batch job: requeued, it finds its run
    for job in (slurm, mpi):
        args = distributed._initialize_args(DistributedConfig(), job)
        assert "coordinator_address" not in args  # JAX's own SLURM / Open MPI detection
        assert "local_device_ids" not in args
    assert job_lib.discover({}) == job_lib.Job("single")
    assert job_lib.discover({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "1"}).run_name == "slurm-9"


def test_a_submitit_local_task_joins_its_jobs_coordinator_on_this_machine():
    """submitit's local executor sets no variable JAX knows: its tasks agree on a coordinator
    port from the job id, and share the GPUs it gave the job (CUDA_VISIBLE_DEVICES)."""
    env = {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1",
           "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_JOB_ID": "123456",
           "SUBMITIT_EXECUTOR": "local", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    job = job_lib.discover(env)
    assert job == job_lib.Job("submitit", "127.0.0.1:23456", 2, 1, 1, 2)
    assert job_lib.discover({**env, "SUBMITIT_LOCAL_GLOBALID": "0"}).coordinator == \
        job.coordinator
    assert job.describe() == "submitit local job, task 1 of 2"
    args = distributed._initialize_args(DistributedConfig(), job, env)
    assert (args["coordinator_address"], args["num_processes"], args["process_id"],
            args["local_device_ids"]) == ("127.0.0.1:23456", 2, 1, [2, 3])
    no_gpus = distributed._initialize_args(DistributedConfig(), job,
                                           {**env, "CUDA_VISIBLE_DEVICES": ""})
    assert "local_device_ids" not in no_gpus  # gpus_per_node=0: CUDA sees none
    single = {**env, "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_GLOBALID": "0"}
    assert job_lib.discover(single).source == "single"


def test_python_started_by_an_sbatch_script_without_srun_is_told_to_use_srun():
    with pytest.raises(ConfigError, match="SLURM_NTASKS=4 but this process is not a task of "
                                          "srun .* start training with srun python"):
        job_lib.discover({"SLURM_JOB_ID": "8", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"})


def test_incomplete_launcher_variables_are_a_config_error():
    with pytest.raises(ConfigError, match="MASTER_ADDR, MASTER_PORT is not"):
        job_lib.discover({"WORLD_SIZE": "2", "RANK": "0"})


def test_mixed_device_kinds_are_refused_by_name():
    devices = [FakeDevice(0, 0, "NVIDIA H100"), FakeDevice(1, 1, "NVIDIA A100")]
    with pytest.raises(ConfigError, match="Devices are not homogeneous: process 0: 1 × NVIDIA "
                                          "H100; process 1: 1 × NVIDIA A100"):
        distributed.check_homogeneous(devices)
    distributed.check_homogeneous([FakeDevice(i, i // 2, "cpu") for i in range(4)])


def test_tp_spanning_processes_stays_inside_a_node_or_warns(caplog):
    devices = [FakeDevice(i, i // 2, "gpu") for i in range(8)]  # 4 processes × 2 devices
    shape = mesh_lib.parse([[2, 4], ["fsdp", "tp"]], 8)
    with caplog.at_level(logging.WARNING):
        grid = mesh_lib._device_grid(shape, devices, per_node=2)  # nodes of 2 processes
    # Each tp row is one node's 4 devices: processes (0, 1) and (2, 3).
    assert [{d.process_index for d in row} for row in grid] == [{0, 1}, {2, 3}]
    assert "across nodes" not in caplog.text
    with caplog.at_level(logging.WARNING):
        mesh_lib._device_grid(shape, devices, per_node=1)  # a node is one 2-device process
    assert "tp=4 across nodes of 2 devices" in caplog.text


def test_pipeline_stages_span_processes_and_tp_stays_inside_one():
    devices = [FakeDevice(i, i // 2, "gpu") for i in range(8)]  # 4 processes × 2 devices
    shape = mesh_lib.parse([[2, 2, 2], ["pp", "fsdp", "tp"]], 8)
    grid = mesh_lib._device_grid(shape, devices, per_node=2)  # [pp, fsdp, tp]
    assert [{d.process_index for d in stage.flat} for stage in grid] == [{0, 1}, {2, 3}]
    assert all(len({d.process_index for d in row}) == 1 for stage in grid for row in stage)
    swapped = mesh_lib._device_grid(mesh_lib.parse([[2, 2, 2], ["fsdp", "tp", "pp"]], 8),
                                    devices, per_node=2)
    assert (swapped == grid.transpose(1, 2, 0)).all()


def test_rendezvous_survives_a_silent_connection(monkeypatch):
    """A peer that connects and says nothing (a port scanner, a stuck launcher) must not block
    node 0's launcher: it is dropped after the greeting timeout and the real peer still joins."""
    import socket
    import threading

    from tunix_train.parallel import rendezvous

    monkeypatch.setattr(rendezvous, "_GREETING_S", 0.5)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    served = {}
    server = threading.Thread(target=lambda: served.update(run_dir=rendezvous.exchange_run_dir(
        "127.0.0.1", port, 0, 1, 2, "/runs/x", timeout_s=30)))
    server.start()
    silent = None
    for _ in range(100):  # until the server listens
        try:
            silent = socket.create_connection(("127.0.0.1", port), timeout=1)
            break
        except OSError:
            threading.Event().wait(0.05)
    assert silent is not None
    with silent:
        fetched = rendezvous.exchange_run_dir("127.0.0.1", port, 1, 1, 2, "", timeout_s=30)
        server.join(timeout=30)
    assert fetched == served["run_dir"] == "/runs/x"


def test_a_child_of_the_launcher_dies_with_it_even_on_sigkill(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    child = ("import os, time; from tunix_train.parallel.distributed import die_with_launcher; "
             f"die_with_launcher(); open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
             "time.sleep(600)")
    launcher = ("import os, subprocess, sys, time; env = dict(os.environ, "
                f"TUNIX_TRAIN_LAUNCHER=str(os.getpid())); subprocess.Popen([sys.executable, '-c', "
                f"{child!r}], env=env, start_new_session=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", launcher])
    try:
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
    finally:
        parent.kill()
        parent.wait()
    for _ in range(100):  # the kernel delivers the parent-death signal at once
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child_pid, signal.SIGKILL)
    raise AssertionError("the launcher's child outlived it")


def test_processes_writing_to_different_run_dirs_are_refused_by_name(monkeypatch, tmp_path):
    """What srun or mpirun would do with a run dir each process timestamps for itself."""
    import numpy as np

    from jax.experimental import multihost_utils

    other = str((tmp_path / "b").resolve()).encode()
    row = np.zeros(4096, np.uint8)
    row[:len(other)] = np.frombuffer(other, np.uint8)
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather",
                        lambda x: np.stack([x, row]))
    with pytest.raises(ConfigError, match=r"write to different run dirs \(process 0: .*/a; "
                                          r"process 1: .*/b\); give them all the same "
                                          r"hydra.run.dir"):
        distributed.check_same_run_dir(tmp_path / "a", 30)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, x]))
    distributed.check_same_run_dir(tmp_path / "a", 30)


@pytest.mark.parametrize("visible,per_task,local,rank,want", [
    ("0", "1", 4, 2, [0]),              # --gpus-per-task=1: its one GPU, whatever its rank
    ("3", "1", 4, 3, [0]),              # the same without cgroups: GPU 3 is its GPU 0
    ("0,1,2,3", "", 4, 2, [2]),         # --gpus-per-node=4, 4 tasks: one each, by local rank
    ("0,1,2,3", "", 1, 0, [0, 1, 2, 3]),  # one task per node: all of them
    ("0,1,2,3,4,5,6,7", "", 2, 1, [4, 5, 6, 7]),  # 2 tasks share 8
    ("0,1", "2", 2, 1, [0, 1]),         # --gpus-per-task=2
])
def test_a_cluster_task_uses_the_gpus_slurm_gave_it(visible, per_task, local, rank, want):
    """Not JAX's default under SLURM / Open MPI (the GPU numbered by the local rank), which
    fails on a task bound to one GPU and idles 3 of 4 GPUs of a task alone on its node."""
    job = job_lib.Job("slurm", None, 8, rank, rank, local, "slurm-1")
    env = {"CUDA_VISIBLE_DEVICES": visible, **({"SLURM_GPUS_PER_TASK": per_task} if per_task
                                               else {})}
    assert distributed.cluster_device_ids(job, env) == want
    assert distributed._initialize_args(DistributedConfig(), job, env)["local_device_ids"] == want


@pytest.mark.parametrize("consequence_ends_at", [10.2, 10.99])
def test_torchruns_root_cause_is_the_killed_process_not_the_one_it_stopped(
        monkeypatch, tmp_path, consequence_ends_at):
    """Rank 1 is SIGKILLed; rank 0 sees the lost peer, records its sentence and ends; torchrun's
    agent sees both gone at its next poll, which can fall in the next whole second and dates
    rank 1's failure (it wrote no file). torch's own summary must still name rank 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "rank0_error.json"
    env = {"TORCHELASTIC_ERROR_FILE": str(error_file), torchrun.RUN_ID_ENV: "job"}
    monkeypatch.setattr(time, "time", lambda: consequence_ends_at)
    torchrun.record_error("a peer is gone; this process stops too", consequence=True, env=env)
    monkeypatch.setattr(time, "time", lambda: consequence_ends_at + 0.1)  # the agent's poll
    failures = {0: ProcessFailure(0, 100, 4, str(error_file)),
                1: ProcessFailure(1, 101, -signal.SIGKILL, str(tmp_path / "none.json"))}
    rank, failure = ChildFailedError("run_training.py", failures).get_first_failure()
    assert (rank, failure.signal_name()) == (1, "SIGKILL")


@pytest.mark.parametrize("world,said", [("2", torchrun.STOPPED), ("1", "")])
def test_a_wait_under_torchrun_reads_a_sigterm_as_a_failed_peer(monkeypatch, world, said):
    """Every wait on peers (the run-dir handshake, the join, the end) of a torchrun job with
    peers ends on SIGTERM with torchrun.STOPPED (tests/test_launch.py: before any wait)."""
    from tunix_train.parallel.waiting import Waiting

    monkeypatch.setenv(torchrun.RUN_ID_ENV, "job")
    monkeypatch.setenv("WORLD_SIZE", world)
    assert Waiting("process 0", None, 5).on_signal == said


def test_a_start_up_check_leaves_sigterm_to_jaxs_preemption_notifier(monkeypatch):
    """A wait before the joined job's first step (`distributed.together`) does not take SIGTERM
    over, where a wait to join does: once joined, SIGTERM is JAX's preemption notifier's, and a
    preemption notice during start-up must still reach it (training/preemption.py)."""
    def notifier(*_):
        pass

    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    previous = signal.signal(signal.SIGTERM, notifier)
    try:
        with distributed.together("the check", 30):
            assert signal.getsignal(signal.SIGTERM) is notifier
        from tunix_train.parallel.waiting import Waiting

        with Waiting("the others to join", 30, 5):
            assert signal.getsignal(signal.SIGTERM) is not notifier
        assert signal.getsignal(signal.SIGTERM) is notifier
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("hook", [True, False], ids=["jax_has_the_hook", "jax_lacks_it"])
def test_a_multi_process_cpu_job_keys_the_cache_by_device_kinds_or_goes_without(
        monkeypatch, hook):
    """share_compilation_cache in a 2-process CPU job: JAX's key hashes the devices' kinds
    instead of the topology each process describes (tests/test_launch.py: both processes load
    the train step); where JAX has no such function to replace, the cache is off for the job."""
    import jax
    from jax._src import cache_key

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    if hook:
        monkeypatch.setattr(cache_key, "_hash_accelerator_config", None)
    else:
        monkeypatch.delattr(cache_key, "_hash_accelerator_config")
    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    try:
        distributed.share_compilation_cache()
        assert jax.config.jax_enable_compilation_cache == hook
        assert getattr(cache_key, "_hash_accelerator_config", None) is (
            cache_key._hash_devices if hook else None)
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
