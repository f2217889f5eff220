"""Training under real schedulers on this machine, with no launcher and no MASTER_* variables:
a SLURM of two nodes at 127.0.0.1 (tools/slurm/start_local_cluster.sh: munge, slurmctld, two
slurmd) whose `srun` tasks join one JAX job through JAX's own SLURM detection, Open MPI's
`mpirun`, and Hydra's submitit launcher (to that SLURM, and its local executor). Every process
of a job agrees on one run dir."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from compile_flags import with_fast_compile
from helpers import REPO, compose_config, train_losses
from test_docs import split_command
from test_launch import losses
from typed_docs import CPU_SCALE, Typed, page_commands

pytestmark = pytest.mark.slow
PACKAGES = "slurm-wlm munge openmpi-bin"


def require(*commands: str) -> None:
    """Skips, saying what to install, where `commands` are missing; fails under CI, which
    installs them (.ci/run): there a skip would hide a failure."""
    missing = [c for c in commands if not shutil.which(c)]
    if missing:
        message = (f"{', '.join(missing)} not installed here: apt-get install {PACKAGES} "
                   f"(Debian's packages; .ci/run installs them)")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A two-node SLURM cluster; yields the environment its commands need (SLURM_CONF)."""
    require("slurmctld", "slurmd", "munged", "srun")
    state = tmp_path_factory.mktemp("slurm")
    tools = REPO / "tools" / "slurm"
    started = subprocess.run(["bash", str(tools / "start_local_cluster.sh"), str(state), "2"],
                             capture_output=True, text=True, timeout=120)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield {"SLURM_CONF": str(state / "slurm.conf"), "JAX_PLATFORMS": "cpu"}
    finally:
        subprocess.run(["bash", str(tools / "stop_local_cluster.sh"), str(state)], timeout=60)


PAGE = REPO / "docs" / "multi_node.md"


def batch_script(*append: str, script: str = "run_training.py") -> str:
    """docs/multi_node.md's `train.sh` as shown, `append` added to its srun line (and, for the
    fault-injection test only, another script in place of run_training.py)."""
    [shown] = [b for b in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), flags=re.S)
               if b.startswith("#!/bin/bash")]
    lines = shown.splitlines()
    assert lines[-1].startswith("srun --kill-on-bad-exit=1 python run_training.py ")
    lines[-1] = (lines[-1].replace(" run_training.py ", f" {script} ") + " "
                 + shlex.join(append))
    return "\n".join(lines) + "\n"


# CPU scale, appended; each of the script's 2 tasks simulates its node's 4 devices.
APPEND = [*CPU_SCALE, "training.steps=6", "logging.every_steps=1", "training.global_batch_size=8"]
NODE_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def slurm_env(cluster: dict, **extra: str) -> dict:
    """This process's environment for a SLURM command (no SLURM_* of an outer job)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, **cluster, **extra}


def slurm(cluster: dict, *command: str) -> str:
    return subprocess.run(command, env=slurm_env(cluster), check=True, capture_output=True,
                          text=True, timeout=30).stdout


def job_state(job: str, cluster: dict) -> dict[str, str]:
    shown = slurm(cluster, "scontrol", "show", "job", job)
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def wait_for(condition, what: str, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.5)


# A job's states before it ends.
RUNNING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED")


def ended(job: str, cluster: dict) -> tuple[str, str]:
    """(JobState, ExitCode) once the job has ended. Polled here every 0.5 s: `sbatch --wait`
    polls at doubling intervals up to 32 s, which kept each waiting test ~30 s past its job."""
    wait_for(lambda: job_state(job, cluster)["JobState"] not in RUNNING, f"job {job} to end")
    state = job_state(job, cluster)
    return state["JobState"], state["ExitCode"]


@pytest.fixture(scope="module")
def typed_job(cluster, tmp_path_factory):
    """`sbatch train.sh` as the page shows it, from a fresh copy of the repository:
    (the copy, the job id, its output, its run dir)."""
    typed = Typed(tmp_path_factory.mktemp("typed") / "tunix_train")
    (typed.root / "train.sh").write_text(batch_script(*APPEND))
    [submit] = [c for c in page_commands("docs/multi_node.md") if c.startswith("sbatch")]
    result = typed.run(submit, env={**cluster, **NODE_DEVICES})
    assert result.returncode == 0, result.stdout + result.stderr
    job = re.search(r"Submitted batch job (\d+)", result.stdout).group(1)
    finished = ended(job, cluster)
    output = (typed.root / f"slurm-{job}.out").read_text()
    assert finished == ("COMPLETED", "0:0"), output
    [run_dir] = (typed.root / "outputs").glob(f"*/slurm-{job}")
    return typed, job, output, run_dir


def test_the_pages_batch_script_trains_on_two_nodes_as_one_process_would(typed_job):
    """2 nodes × 1 task × 4 devices on fsdp 8: the losses of one process on 8 devices, in one
    run dir named by the job id, each task saying which SLURM task it is."""
    typed, job, output, run_dir = typed_job
    assert f"(SLURM job {job}, task 1 of 2)" in output and "finished step 6 of 6" in output, output
    assert all(p.name.startswith("slurm-") for p in (typed.root / "outputs").glob("*/*"))
    words = split_command(batch_script(*APPEND).splitlines()[-1])[1]
    want = train_losses(compose_config(*words), 6)[0]
    np.testing.assert_allclose(losses(run_dir), want, rtol=1e-5)
    assert ("continue: srun --kill-on-bad-exit=1 --nodes=2 --ntasks=2 python run_training.py"
            in output)


def submit_paused(typed: Typed, cluster: dict, go: Path):
    """The page's script through tests/faulty_training.py, both tasks paused after step 2
    until `go` exists: (the job id, a function reading its output so far)."""
    faults = json.dumps({"pause_at_step": 2, "resume_file": str(go)})
    script = typed.root / f"faulty-{go.parent.name}.sh"
    script.write_text(batch_script(*APPEND, script="tests/faulty_training.py"))
    submitted = typed.run(f"sbatch --parsable {script.name}", env={
        **cluster, **NODE_DEVICES, "TUNIX_TRAIN_TEST_FAULTS": faults})
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    out = typed.root / f"slurm-{job}.out"
    text = lambda: out.read_text() if out.exists() else ""  # noqa: E731
    wait_for(lambda: text().count("paused after step 2 ") == 2, "both tasks to pause")
    return job, text


def test_scancel_sigterm_then_scontrol_requeue_resumes_to_the_uninterrupted_losses(
        cluster, typed_job, tmp_path):
    """The page's script, paused after step 2 (tests/faults.py) to be sure it is mid-run, gets
    `scancel --signal=TERM`: both tasks stop at one step and save, and the job ends.
    `scontrol requeue` runs it again under the same job id: it finds its run dir, resumes, and
    its losses are the uninterrupted job's, bitwise."""
    typed = typed_job[0]
    go = tmp_path / "go"
    job, text = submit_paused(typed, cluster, go)
    slurm(cluster, "scancel", "--signal=TERM", job)
    go.touch()
    wait_for(lambda: job_state(job, cluster).get("JobState") == "COMPLETED", "the job to end")
    assert "for preemption; checkpoint saved" in text(), text()[-3000:]
    [run_dir] = (typed.root / "outputs").glob(f"*/slurm-{job}")
    stopped = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert 2 <= stopped < 6

    slurm(cluster, "scontrol", "requeue", job)
    # SLURM holds a requeued job for 2 minutes before it may start again; not worth waiting for.
    # Not at once either: slurmd refuses a launch whose credential dates from the very second
    # the run it replaces was ended ("Job 2 already killed, do not launch batch job", credential
    # times are whole seconds), and the job fails.
    slurm(cluster, "scontrol", "update", f"JobId={job}", "StartTime=now+2")
    wait_for(lambda: job_state(job, cluster).get("Restarts") == "1"
             and job_state(job, cluster).get("JobState") == "COMPLETED", "the requeued job")
    assert f"resuming from step {stopped}" in text() and "finished step 6 of 6" in text()
    assert losses(run_dir).tolist() == losses(typed_job[3]).tolist()


def test_python_run_by_an_sbatch_script_itself_is_told_to_use_srun(cluster, tmp_path):
    """Two tasks asked for, but the batch script runs Python itself: one sentence, exit 2,
    before JAX looks for a coordinator."""
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{sys.executable} {REPO / 'run_training.py'}\n")
    job = slurm(cluster, "sbatch", "--parsable", "--ntasks=2", f"--output={tmp_path}/out.txt",
                f"--chdir={tmp_path}", str(script)).strip().split(";")[0]
    assert ended(job, cluster) == ("FAILED", "2:0"), (tmp_path / "out.txt").read_text()
    [error] = [line for line in Path(tmp_path / "out.txt").read_text().splitlines()
               if "error" in line.lower()]
    assert "SLURM_NTASKS=2 but this process is not a task of srun" in error
    assert "start training with srun python run_training.py" in error


def test_mpirun_processes_train_as_one_process_would(tmp_path):
    """`mpirun -n 2 --oversubscribe`: two processes of one device each on fsdp 2, joined by
    JAX's Open MPI detection, give the losses of one process on 2 devices in one run dir."""
    require("mpirun")
    args = [*CPU_SCALE, "training.steps=4", "logging.every_steps=1",
            "training.global_batch_size=8", 'model.mesh_shape=[[2,1],["fsdp","tp"]]']
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    if os.geteuid() == 0:  # Open MPI refuses root unless told twice
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    result = subprocess.run(["mpirun", "-n", "2", "--oversubscribe", sys.executable,
                             str(REPO / "run_training.py"), *args], cwd=tmp_path,
                            env=with_fast_compile(env), capture_output=True, text=True,
                            timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "(Open MPI rank 1 of 2)" in output
    [run_dir] = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert run_dir.name.startswith("mpi-")
    want = train_losses(compose_config(*args), 4, jax.devices()[:2])[0]
    np.testing.assert_allclose(losses(run_dir), want, rtol=1e-5)


# The submitit sweeps' CPU scale, appended: 2 tasks per job × 2 simulated devices each.
SWEEP_APPEND = [*CPU_SCALE, "training.steps=4", "logging.every_steps=1",
                "training.global_batch_size=8"]
TASK_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def sweep_command(launcher: str) -> tuple[str, list[str], list[str]]:
    """The page's `-m hydra/launcher=<launcher>` command: (itself, its overrides of the
    config, the values of its one swept key)."""
    [command] = page_commands("docs/multi_node.md", f" -m hydra/launcher={launcher} ")
    words = split_command(command)[1]
    fixed = [w for w in words if not w.startswith(("-", "hydra")) and "," not in w]
    [swept] = [w for w in words if "," in w and not w.startswith("hydra")]
    key, values = swept.split("=", 1)
    return command, fixed, [f"{key}={v}" for v in values.split(",")]


@pytest.fixture(scope="module")
def sweep_reference() -> dict[str, np.ndarray]:
    """Each sweep point's losses from one process on the 4 devices of a job's 2 tasks."""
    _, fixed, points = sweep_command("submitit_local")
    assert sweep_command("submitit_slurm")[1:] == (fixed, points)  # the same sweep
    return {p: train_losses(compose_config(*fixed, p, *SWEEP_APPEND), 4, jax.devices()[:4])[0]
            for p in points}


def check_sweep(typed: Typed, launcher: str, reference: dict[str, np.ndarray],
                job_line: str) -> Path:
    """The sweep dir of the launcher's one sweep: a run dir per point, in order, each with
    its point's losses, written by a job of 2 tasks."""
    [sweep] = [p for p in (typed.root / "outputs").glob("*/*/*") if p.is_dir()]
    assert sorted(p.name for p in sweep.iterdir() if not p.name.startswith(".")) == [
        "0", "1", "multirun.yaml"]
    for number, point in enumerate(sweep_command(launcher)[2]):
        np.testing.assert_allclose(losses(sweep / str(number)), reference[point], rtol=1e-5)
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.out"))
    assert len(re.findall(job_line, logs)) == 2, logs[-3000:]  # task 1 of each job
    return sweep


def test_the_pages_submitit_slurm_sweep_runs_a_two_task_job_per_point(
        cluster, sweep_reference, tmp_path):
    """`-m hydra/launcher=submitit_slurm … optimizer.lr=1e-3,3e-4` as shown: a job of 2 tasks
    per point on the local SLURM, each joined into one JAX job by SLURM's variables, each
    training its own point into its own run dir of the sweep dir."""
    typed = Typed(tmp_path / "tunix_train")
    command = sweep_command("submitit_slurm")[0]
    result = typed.run(command, *SWEEP_APPEND, env={**cluster, **TASK_DEVICES}, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    check_sweep(typed, "submitit_slurm", sweep_reference,
                r"process 1 of 2 \(SLURM job \d+, task 1 of 2\)")
    said = result.stdout + result.stderr
    assert "sweep: 2 job(s) submitted to submitit's slurm executor" in said, said[-3000:]
    assert "sweep: 2 of 2 job(s) finished" in said, said[-3000:]


def test_the_pages_submitit_local_sweep_runs_without_slurm_and_resumes_by_sweep_dir(
        sweep_reference, tmp_path):
    """The same sweep through `submitit_local`: 2 processes per point on this machine, joined
    over 127.0.0.1 from submitit's variables. The same command again with hydra.sweep.dir of
    the first finds each point's run dir, which is complete."""
    typed = Typed(tmp_path / "tunix_train")
    command = sweep_command("submitit_local")[0]
    env = {"JAX_PLATFORMS": "cpu", **TASK_DEVICES}
    result = typed.run(command, *SWEEP_APPEND, env=env, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    sweep = check_sweep(typed, "submitit_local", sweep_reference,
                        r"process 1 of 2 \(submitit local job, task 1 of 2\)")
    # Its console says what it waits for, and when the jobs have ended.
    said = result.stdout + result.stderr
    assert "sweep: 2 job(s) submitted to submitit's local executor; waiting" in said, said[-3000:]
    assert "sweep: 2 of 2 job(s) finished" in said, said[-3000:]
    again = typed.run(command, *SWEEP_APPEND, f"hydra.sweep.dir={sweep}", env=env, timeout=600)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    logs = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_0_log.out"))
    for number in (0, 1):
        run_dir = sweep.relative_to(typed.root) / str(number)
        assert f"{run_dir} is already complete" in logs, logs[-3000:]


def task_pid(job: str, task: int) -> int | None:
    """The pid of a job's task (its Python process), found by the variables srun gave it."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            variables = dict(v.split("=", 1) for v in environ.read_bytes().decode(
                errors="replace").split("\0") if "=" in v)
            command = (environ.parent / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if (variables.get("SLURM_JOB_ID") == job and variables.get("SLURM_PROCID") == str(task)
                and b"training.py" in command):
            return int(environ.parent.name)
    return None


def test_a_task_killed_under_srun_ends_the_job_step_naming_it(cluster, typed_job, tmp_path):
    """The page's script, paused after step 2; task 1 gets SIGKILL. `--kill-on-bad-exit=1`
    ends the whole step at once, srun names the task, and task 0, which would otherwise wait
    in a collective for a partner that is gone, is stopped: the job fails well within
    distributed.heartbeat_timeout_s (100 s), nothing hangs."""
    typed = typed_job[0]
    go = tmp_path / "go"
    job, text = submit_paused(typed, cluster, go)
    pid = task_pid(job, 1)
    assert pid, "task 1's process not found"
    os.kill(pid, 9)
    killed = time.monotonic()
    go.touch()  # task 0 goes on into step 3's collectives, without its partner
    wait_for(lambda: job_state(job, cluster).get("JobState") in ("FAILED", "CANCELLED"),
             "the job to end", timeout_s=100)
    assert time.monotonic() - killed < 100
    assert re.search(r"srun: error: node\d: task 1: Killed", text()), text()[-3000:]
    assert "Terminating StepId" in text()  # srun's own stop of the others (--kill-on-bad-exit)
    assert "finished step" not in text()


def test_srun_on_two_nodes_trains_fsdp_by_tp_as_one_process_would(cluster, sweep_reference,
                                                                   tmp_path):
    """`srun -N 2 -n 2`, 2 simulated devices per task, on fsdp 2 × tp 2 (tp inside each task,
    fsdp across the nodes): the losses of one process on 4 devices (here the submitit sweep's
    first point, trained on fsdp 4: the same arithmetic to fp32 rounding), in one run dir."""
    point = sweep_command("submitit_slurm")[2][0]
    args = ['model.mesh_shape=[[2,2],["fsdp","tp"]]', point, *SWEEP_APPEND]
    result = subprocess.run(["srun", "--kill-on-bad-exit=1", "-N", "2", "-n", "2",
                             sys.executable, str(REPO / "run_training.py"), *args],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env=with_fast_compile(slurm_env(cluster, **TASK_DEVICES)))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert re.search(r"process 1 of 2 \(SLURM job \d+, task 1 of 2\)", output), output[-3000:]
    [run_dir] = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert run_dir.name.startswith("slurm-")
    np.testing.assert_allclose(losses(run_dir), sweep_reference[point], rtol=1e-5)
