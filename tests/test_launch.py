"""The launcher and multi-process training, with real processes on 127.0.0.1 (gloo on CPU)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from compile_flags import with_fast_compile
from helpers import ONE_STACK, REPO, TINY, free_port, mesh_arg, run_cli

pytestmark = pytest.mark.slow

STEPS = ["training.steps=4", "logging.every_steps=1", "training.global_batch_size=8"]


def devices_env(n: int) -> dict:
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}


def launch(args: list[str], cwd: Path, env_extra: dict, nprocs: int = 2,
           script: str = "run_training.py") -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RANK", "WORLD_SIZE")}
    env.update(env_extra)
    with_fast_compile(env)
    return subprocess.Popen(
        [sys.executable, "-m", "tunix_train.launch", f"--nprocs={nprocs}",
         str(REPO / script), *args],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def losses(run_dir: Path) -> np.ndarray:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return np.array([json.loads(line)["loss"] for line in lines if '"loss"' in line])


def only_run_dir(cwd: Path) -> Path:
    runs = [p for p in (cwd / "outputs").glob("*/*/*") if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def wait_for_first_logged_step(proc: subprocess.Popen, cwd: Path) -> None:
    deadline = time.monotonic() + 400
    while not list(cwd.glob("outputs/*/*/*/metrics.jsonl")) or not only_run_dir(
            cwd).joinpath("metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """Single process, 4 devices: the losses every multi-process layout must reproduce."""
    out = {}
    for fsdp, tp in ((4, 1), (2, 2)):
        run_dir = tmp_path_factory.mktemp("single") / "run"
        result = run_cli([*ONE_STACK, *STEPS, mesh_arg(fsdp, tp), f"hydra.run.dir={run_dir}"],
                         cwd=run_dir.parent, env_extra=devices_env(4))
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        out[(fsdp, tp)] = losses(run_dir)
    return out


@pytest.mark.parametrize("fsdp,tp", [(4, 1), (2, 2)])
def test_two_processes_reproduce_the_single_process_losses(tmp_path, reference, fsdp, tp):
    """…and share JAX's persistent cache: a program's key is the same in every CPU process
    (parallel/distributed.py), so the job started again on the cache the first one filled
    loads the train step in both processes (process 0 alone would load it and run ahead: a
    Gloo timeout when the others' compile takes over 30 s), with the same losses."""
    env = {**devices_env(2), "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache")}
    proc = launch([*ONE_STACK, *STEPS, mesh_arg(fsdp, tp)], tmp_path, env)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert "[rank 1]" in output
    run_dir = only_run_dir(tmp_path)  # one directory for the whole job
    assert len(list(run_dir.rglob("metrics.jsonl"))) == 1
    np.testing.assert_allclose(losses(run_dir), reference[(fsdp, tp)], rtol=1e-5)
    again = launch([*ONE_STACK, *STEPS, mesh_arg(fsdp, tp), "hydra.run.dir=again"], tmp_path,
                   {**env, "JAX_LOG_COMPILES": "1"})
    output, _ = again.communicate(timeout=600)
    assert again.returncode == 0, output[-3000:]
    loaded = [line for line in output.splitlines()
              if "Persistent compilation cache hit for 'jit_step'" in line]
    assert len(loaded) == 2 and any(line.startswith("[rank 1]") for line in loaded), loaded
    np.testing.assert_allclose(losses(tmp_path / "again"), reference[(fsdp, tp)], rtol=1e-5)


def test_pipeline_stages_in_two_processes_reproduce_the_run_without_pp(tmp_path):
    """pp=2 across 2 processes of 2 devices (a stage per process) against fsdp 2 × tp 2 in
    one process: the same losses with the circular schedule, 2 rounds, whose permutes are
    GPipe's stage-to-stage ones plus the ring edge that returns each micro-batch from the last
    process to the first (GPipe's own schedule is held to the run without pp in one process by
    tests/test_pipeline.py; across processes it adds no other collective)."""
    model = [*TINY, *STEPS, "model.num_layers=9", "model.global_every=2"]
    run_dir = tmp_path / "single" / "run"
    result = run_cli([*model, mesh_arg(2, 2), f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                     env_extra=devices_env(4))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    launched = tmp_path / "launched"
    launched.mkdir()
    proc = launch([*model, 'model.mesh_shape=[[2,2,1],["pp","fsdp","tp"]]',
                   "training.pipeline_repeats=2"], launched, devices_env(2))
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert "pp=2" in output and ", circular" in output
    np.testing.assert_allclose(losses(only_run_dir(launched)), losses(run_dir), rtol=1e-5)


def test_two_launchers_act_as_two_nodes(tmp_path, reference):
    port = free_port()
    nodes = [launch([*ONE_STACK, *STEPS, mesh_arg(4, 1)], tmp_path,
                    {**devices_env(2), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "RANK": str(rank), "WORLD_SIZE": "2"}, nprocs=1) for rank in (0, 1)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    np.testing.assert_allclose(losses(only_run_dir(tmp_path)), reference[(4, 1)], rtol=1e-5)
    # Every node's launcher closes with a line, the second node's too.
    assert "launcher: ranks 1-1 ended normally; run dir " in outputs[1]
    # Going on needs the same environment: node 0's line carries it (RANK: its first rank).
    assert (f"continue: XLA_FLAGS=--xla_force_host_platform_device_count=2 "
            f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} RANK=0 WORLD_SIZE=2 python -m "
            f"tunix_train.launch --nprocs=1 run_training.py") in outputs[0]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e for e in environ if e.startswith(b"RANK=")).split(b"=")[1])


def test_a_crashed_rank_stops_the_job_promptly_and_is_named(tmp_path):
    proc = launch([*ONE_STACK, "training.steps=100000", mesh_arg(4, 1), "logging.every_steps=1",
                   "training.global_batch_size=8"], tmp_path, devices_env(2))
    wait_for_first_logged_step(proc, tmp_path)
    children = _children(proc.pid)
    victim = next(pid for pid in children if _rank_of(pid) == 1)
    os.kill(victim, signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    # The launcher noticed the death itself and stopped rank 0 (rather than rank 0 waiting out
    # a collective or JAX's heartbeat).
    assert "rank 1 (pid" in output and "failed with signal SIGKILL; stopping the other" in output
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_a_process_stuck_before_a_start_up_check_ends_the_job_naming_the_check(tmp_path):
    """Process 1 stops before the checkpoint folder's check (tests/faults.py), alive: its
    heartbeat goes on, so JAX never declares it gone. Process 0, at the check's collective,
    says what it waits for, then gives up with code 5 after distributed.init_timeout_s, and the
    job ends. Before, process 0 waited there for ever, in silence."""
    env = {**devices_env(1), "TUNIX_TRAIN_TEST_FAULTS": json.dumps(
        {"hang_before_start_checks_in_process": 1})}
    proc = launch([*ONE_STACK, *STEPS, mesh_arg(2, 1), "distributed.init_timeout_s=8"],
                  tmp_path, env, script="tests/faulty_training.py")
    output, _ = proc.communicate(timeout=120)  # without the bound: a hang, this timeout
    assert "fault injection: hanging before the start-up checks" in output, output[-3000:]
    check = "the other processes of the job at the check that the checkpoint folder has room"
    assert f"waiting for {check} (5 s of 8)" in output, output[-3000:]
    assert (f"error: {check}: gave up after 8 s; a process of the job is stuck before it or "
            f"gone") in output, output[-3000:]
    # Once process 0 has gone, JAX aborts process 1 (its coordinator is gone): the launcher
    # names whichever of the two it sees end first.
    assert proc.returncode in (5, 128 + signal.SIGABRT), output[-3000:]


def by_hand(rank: int, port: int, args: list[str], cwd: Path, devices: int = 1,
            world: int = 2, wrapper: tuple[str, ...] = ()) -> subprocess.Popen:
    """`python run_training.py` started as a user starts one process of a job by hand (run by
    `wrapper`, a command that ends by running its arguments, where given)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RANK", "WORLD_SIZE")}
    env.update(devices_env(devices), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               RANK=str(rank), WORLD_SIZE=str(world), PYTHONUNBUFFERED="1")
    with_fast_compile(env)
    return subprocess.Popen([*wrapper, sys.executable, str(REPO / "run_training.py"), *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def read_until(proc: subprocess.Popen, text: str, lines: list[str]) -> float:
    """Reads `proc`'s output into `lines` until a line holds `text`; returns when (monotonic)."""
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return time.monotonic()
    raise AssertionError(f"{text!r} never came:\n{''.join(lines)[-3000:]}")


def test_processes_started_by_hand_seconds_apart_share_one_run_dir(tmp_path, reference):
    """Each process would read `${now:}` for itself; they agree on process 0's run dir."""
    port, args = free_port(), [*ONE_STACK, *STEPS, mesh_arg(4, 1)]
    first = by_hand(0, port, args, tmp_path, devices=2)
    time.sleep(3)
    second = by_hand(1, port, args, tmp_path, devices=2)
    outputs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    np.testing.assert_allclose(losses(only_run_dir(tmp_path)), reference[(4, 1)], rtol=1e-5)
    assert "(MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)" in outputs[0]
    assert "launcher" not in outputs[0]
    assert (f"continue: XLA_FLAGS=--xla_force_host_platform_device_count=2 "
            f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} RANK=0 WORLD_SIZE=2 python "
            f"run_training.py") in outputs[0]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_failing_in_one_process_ends_the_job_in_seconds_each_saying_why(tmp_path,
                                                                               async_save):
    """Process 1's checkpoint folder is a full disk (a 64 KiB tmpfs over it, in a mount
    namespace of its own), process 0's is not: the save of step 2 fails in process 1 alone.
    It says so (exit 6); process 0 ends once process 1 is gone (exit 5), naming another
    process: at once where the save is synchronous (its collectives fail), after JAX's
    heartbeat where it is written in the background (waiting at a barrier; whether that wait
    is long enough to be said depends on when process 0 got there: test_checkpoint.py says
    it). Both used to wait out Orbax's barrier timeout, 20 minutes, in silence. Nothing is
    committed."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    full_disk = ("unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                 f'mount -t tmpfs -o size=65536 tmpfs {run_dir / "checkpoints"} && exec "$@"',
                 "sh")
    port = free_port()
    args = [*ONE_STACK, *STEPS, mesh_arg(2, 1), "checkpoint.every_steps=2",
            f"checkpoint.async_save={str(async_save).lower()}",
            "distributed.heartbeat_timeout_s=15", f"hydra.run.dir={run_dir}"]
    procs = [by_hand(0, port, args, tmp_path),
             by_hand(1, port, args, tmp_path, wrapper=full_disk)]
    try:
        first, second = (p.communicate(timeout=300)[0] for p in procs)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[1].returncode == 6, second[-3000:]
    assert (f"error: could not save checkpoint step 2 in {run_dir / 'checkpoints'} (No space "
            f"left on device") in second
    named = " (process 1)" if async_save else ""  # JAX's heartbeat names it; Gloo does not
    ours = (f"error: could not save checkpoint step 2 in {run_dir / 'checkpoints'}: another "
            f"process of the job{named} did not finish its part")
    if async_save:
        # Process 0 learns that process 1 is gone twice at once, from one heartbeat: its
        # barrier fails (our sentence), and JAX aborts the process, saying so; the first ends it.
        assert ((procs[0].returncode == 5 and ours in first)
                or (procs[0].returncode == -signal.SIGABRT and "another task died" in first)), \
            first[-3000:]
    else:
        assert procs[0].returncode == 5 and ours in first, first[-3000:]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]


def test_a_lone_process_says_what_it_waits_for_then_gives_up(tmp_path):
    started, lines = time.monotonic(), []
    # 8 s: past the first "waiting for" line, which comes after 5 s (parallel/waiting.py).
    proc = by_hand(0, free_port(), [*ONE_STACK, "distributed.init_timeout_s=8"], tmp_path)
    said = read_until(proc, "waiting for 1 of 2 processes to join at port", lines)
    assert said - started < 20
    assert proc.wait(timeout=60) == 5
    assert time.monotonic() - started < 8 + 15  # the timeout, plus Python's start-up
    output = "".join(lines) + proc.stdout.read()
    assert "error: distributed.init_timeout_s=8 passed with 1 of WORLD_SIZE=2 processes joined" \
        in output


def test_a_program_one_process_compiles_33_s_later_still_runs_on_both(tmp_path):
    """XLA's CPU collectives (gloo) give the processes 30 s to meet at a program's first
    collective over a new group of devices: process 1 compiling 33 s longer (its trace sleeps,
    tests/first_run_worker.py) ended the job with `Gloo context initialization failed` (the
    worker's `bare` mode still does). distributed.first_run_together compiles first, then
    waits for the other process at the coordination service's barrier, saying so, and the
    program runs once compiled (one trace), with the sum of both processes' values."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(devices_env(2), PYTHONUNBUFFERED="1")
    port, worker = free_port(), REPO / "tests" / "first_run_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(rank), "33"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert all("sum 6.0 traces 1" in o for o in outputs), outputs
    assert ("waiting for the other processes of the job at the first run of the test's sum "
            "(5 s of 120)") in outputs[0], outputs[0][-3000:]


def test_sigterm_ends_a_process_waiting_for_its_peers_at_once(tmp_path):
    """Process 1 with no process 0: the handshake's port (MASTER_PORT + 1) is held bound and
    not listening, so that every connection to it is refused, whatever else runs."""
    lines, port = [], free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port + 1))
        proc = by_hand(1, port, [*ONE_STACK], tmp_path)
        read_until(proc, "waiting for process 0 (RANK=0) at 127.0.0.1:", lines)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 5
    assert time.monotonic() - signalled < 10
    assert "SIGTERM received while waiting for process 0 (RANK=0)" in proc.stdout.read()


def test_a_torchrun_process_stopped_while_it_imports_says_why(tmp_path):
    """torchrun stops a job's other processes at once when one fails; one still importing (the
    first seconds) ends with the sentence too, not silently. SIGTERM is sent as soon as the
    process catches it (its /proc status), seconds before any wait on its peers."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update(TORCHELASTIC_RUN_ID="test", RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(REPO / "run_training.py"), *ONE_STACK],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    sigterm_bit = 1 << (signal.SIGTERM - 1)
    while proc.poll() is None and not int(_status(proc.pid, "SigCgt"), 16) & sigterm_bit:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert output.strip() == ("error: SIGTERM received while starting; exiting: torchrun stops "
                              "every process of a job when one of them fails; that one's error "
                              "is above, and in torchrun's summary under Root Cause.")


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split()[1]
    raise KeyError(field)


def test_a_missing_node_launcher_is_a_clear_timeout(tmp_path):
    env = {**devices_env(1), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "WORLD_SIZE": "2"}
    proc = launch([*ONE_STACK, "distributed.init_timeout_s=3"], tmp_path, env, nprocs=1)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 5
    assert "passed with 1 of WORLD_SIZE=2 processes joined" in output


def test_sigterm_to_the_launcher_saves_one_checkpoint_and_every_process_exits_0(tmp_path):
    proc = launch([*ONE_STACK, "training.steps=100000", mesh_arg(4, 1), "logging.every_steps=1",
                   "training.global_batch_size=8"], tmp_path, devices_env(2))
    wait_for_first_logged_step(proc, tmp_path)
    children = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    steps = sorted(int(p.name) for p in (only_run_dir(tmp_path) / "checkpoints").iterdir()
                   if p.name.isdigit())
    assert len(steps) == 1, steps
    stopped = [line for line in output.splitlines() if "for preemption; checkpoint saved" in line]
    assert {line.split("]")[0] for line in stopped} == {"[rank 0", "[rank 1"}  # same step, both
    assert len({line.split("after step")[1] for line in stopped}) == 1
    assert all(not Path(f"/proc/{pid}").exists() for pid in children)


def torchrun(args: list[str], cwd: Path, torchrun_args: list[str],
             devices: int = 2) -> subprocess.Popen:
    """`torchrun … run_training.py …` as a user types it (PyTorch's launcher, its own store on
    MASTER_PORT)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(devices_env(devices), PYTHONUNBUFFERED="1")
    with_fast_compile(env)
    launcher = Path(sys.executable).with_name("torchrun")
    return subprocess.Popen([str(launcher), *torchrun_args, str(REPO / "run_training.py"), *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_two_torchrun_nodes_started_apart_reproduce_the_single_process_losses(tmp_path,
                                                                               reference):
    """`torchrun --nnodes=2` on each of two "machines", the second 5 s later: one job, one run
    dir, the losses of one process on the same 4 devices; torchrun's store on MASTER_PORT and
    ours (+1: run dir, +2: JAX's coordinator) do not collide."""
    port, args = free_port(), [*ONE_STACK, *STEPS, mesh_arg(4, 1)]
    nodes = []
    for node in (0, 1):
        nodes.append(torchrun(args, tmp_path, ["--nnodes=2", f"--node_rank={node}",
                                               "--nproc_per_node=1", "--master_addr=127.0.0.1",
                                               f"--master_port={port}"]))
        time.sleep(5 if node == 0 else 0)
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    run_dir = only_run_dir(tmp_path)
    np.testing.assert_allclose(losses(run_dir), reference[(4, 1)], rtol=1e-5)
    assert "(started by torchrun)" in outputs[0]
    # What to type to go on: the simulated devices the run had, and torchrun's own form.
    assert "continue: XLA_FLAGS=--xla_force_host_platform_device_count=2 torchrun " \
           "--nproc_per_node=1 --nnodes=2 --node_rank=<this node> run_training.py" in outputs[0]


def test_a_rank_killed_under_torchrun_ends_the_job_and_is_named(tmp_path):
    proc = torchrun([*ONE_STACK, "training.steps=100000", mesh_arg(4, 1), "logging.every_steps=1",
                     "training.global_batch_size=8"], tmp_path, ["--nproc_per_node=2"])
    wait_for_first_logged_step(proc, tmp_path)
    workers = [pid for agent in _children(proc.pid) for pid in [agent, *_children(agent)]
               if _has_rank(pid)]
    victim = next(pid for pid in workers if _rank_of(pid) == 1)
    # Near the end of a whole second: rank 0 may end on the lost peer in this second and
    # torchrun's agent see rank 1 gone in the next, which dates rank 1's failure (stop 64's CI).
    time.sleep((0.9 - time.time() % 1) % 1)
    os.kill(victim, signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    summary = output[output.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in summary and "SIGKILL" in summary
    assert all(not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
               for pid in workers)


def _has_rank(pid: int) -> bool:
    try:
        return b"\0RANK=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def test_a_taken_coordinator_port_under_torchrun_is_one_sentence_in_torchruns_summary(tmp_path):
    """JAX's coordinator crashes its process on a taken port (SIGSEGV); process 0 checks the
    port first and says which, and torchrun's summary shows that sentence as the root cause."""
    port = free_port()
    with socket.create_server(("", port + 2)):
        proc = torchrun([*ONE_STACK, mesh_arg(2, 1)], tmp_path,
                        ["--nproc_per_node=2", f"--master_port={port}"], devices=1)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    sentence = (f"error: process 0 cannot start JAX's coordinator on port {port + 2} of this "
                f"machine (Address already in use;")
    assert sentence in output
    root_cause = output[output.index("Root Cause"):]
    assert "exitcode  : 2" in root_cause and "give torchrun another --master_port" in root_cause
    assert "torchrun stops every process of a job when one of them fails" in output


@pytest.mark.parametrize("nprocs,world,message", [
    (0, None, "error: --nprocs=0 starts no process; give the number of processes to start on "
              "this machine, one per GPU (at least 1)."),
    (4, "2", "error: --nprocs=4 is more than WORLD_SIZE=2, the job's processes on all machines; "
             "raise WORLD_SIZE or lower --nprocs.")])
def test_a_launch_the_user_must_fix_is_one_sentence_and_exit_2(tmp_path, nprocs, world, message):
    proc = launch([], tmp_path, {"WORLD_SIZE": world} if world else {}, nprocs=nprocs)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and output.strip().splitlines() == [message]
