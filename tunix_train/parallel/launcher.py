"""`python -m tunix_train.launch --nprocs=N run_training.py [overrides]`: N processes of one job.

On one machine it picks MASTER_ADDR=127.0.0.1 and a free MASTER_PORT. Across machines, run it on
every node with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (total processes) and RANK = the
global rank of that node's first process. The launcher

  * computes the Hydra run dir once (node 0's launcher; other nodes fetch it over
    MASTER_PORT+1) and passes `hydra.run.dir` to every process, unless the user gave one;
  * prefixes every line a child prints with `[rank R]`;
  * forwards SIGTERM/SIGINT to the children, so a preempted job checkpoints and exits 0;
  * when a child dies or exits non-zero, stops the others and exits non-zero naming the rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tunix_train.parallel.rendezvous import PEERS_EXIT_CODE, PeersError, exchange_run_dir

LAUNCHER_ENV = "TUNIX_TRAIN_LAUNCHER"  # the launcher's pid, in each child's environment

log = logging.getLogger("tunix_train.launch")

POLL_S = 0.2
FAILURE_GRACE_S = 5  # survivors of a failed rank may be stuck in a collective: kill soon
PREEMPTION_GRACE_S = 600  # a forwarded SIGTERM gives children time to finish a step and save


@dataclass(frozen=True)
class NodeJob:
    nprocs: int  # processes on this node
    first_rank: int
    world_size: int
    master_addr: str
    master_port: int

    @property
    def is_multi_node(self) -> bool:
        return self.world_size > self.nprocs


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tunix_train.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, required=True, help="processes on this node")
    parser.add_argument("script", help="run_training.py (or another Hydra entry point)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides")
    return parser.parse_args(argv)


def _refuse(sentence: str) -> None:
    """A launch the user must fix: one sentence on stderr, exit code 2 (as for any config)."""
    print(f"error: {sentence}", file=sys.stderr)
    sys.exit(2)


def node_job(nprocs: int, env=os.environ) -> NodeJob:
    if nprocs < 1:
        _refuse(f"--nprocs={nprocs} starts no process; give the number of processes to start "
                f"on this machine, one per GPU (at least 1).")
    world = int(env.get("WORLD_SIZE", nprocs))
    if world < nprocs:
        _refuse(f"--nprocs={nprocs} is more than WORLD_SIZE={world}, the job's processes on "
                f"all machines; raise WORLD_SIZE or lower --nprocs.")
    if world > nprocs and "MASTER_PORT" not in env:
        _refuse(f"WORLD_SIZE={world} spans several nodes, so MASTER_ADDR and MASTER_PORT must "
                f"be set to the same values on every node.")
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else _free_port()
    return NodeJob(nprocs, int(env.get("RANK", 0)), world, env.get("MASTER_ADDR", "127.0.0.1"),
                   port)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_run_dir(overrides: list[str], job: NodeJob) -> str:
    """The user's hydra.run.dir, or the one node 0's launcher composes (once, for all nodes)."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    run_dir, timeout_s = _composed_run_dir([o for o in overrides if not o.startswith("hydra.")])
    run_dir = given[-1] if given else run_dir
    if job.is_multi_node and not given:
        run_dir = exchange_run_dir(job.master_addr, job.master_port + 1, job.first_rank,
                                   job.nprocs, job.world_size, run_dir, timeout_s)
    return str(Path(run_dir).absolute())


def _composed_run_dir(overrides: list[str]) -> tuple[str, int]:
    """Hydra's `hydra.run.dir` (with `${now:}` resolved here, once) and the init timeout."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tunix_train.config import CONFIG_DIR, register_configs

    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    return (OmegaConf.select(cfg, "hydra.run.dir"),
            int(OmegaConf.select(cfg, "distributed.init_timeout_s")))


def forward_output(child: subprocess.Popen, prefix: str) -> None:
    """Copies the child's stdout/stderr to ours, each line (or progress-bar redraw) prefixed."""
    for source, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
        threading.Thread(target=_copy_prefixed, args=(source, sink, prefix.encode()),
                         daemon=True).start()


def _copy_prefixed(source, sink, prefix: bytes) -> None:
    at_line_start = True
    for chunk in iter(lambda: source.read1(65536), b""):
        out = bytearray()
        for piece in re.split(rb"(?<=[\r\n])", chunk):  # \r: a redrawn progress bar
            if piece:
                out += prefix + piece if at_line_start else piece
                at_line_start = piece[-1:] in (b"\n", b"\r")
        sink.buffer.write(bytes(out))
        sink.flush()


def child_env(job: NodeJob, local_rank: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(MASTER_ADDR=job.master_addr, MASTER_PORT=str(job.master_port),
               WORLD_SIZE=str(job.world_size), RANK=str(job.first_rank + local_rank),
               LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(job.nprocs),
               PYTHONUNBUFFERED="1")
    # The child dies with this launcher, even a SIGKILLed one (distributed.die_with_launcher).
    env[LAUNCHER_ENV] = str(os.getpid())
    return env


def start(script: str, overrides: list[str], run_dir: str, job: NodeJob) -> list[subprocess.Popen]:
    args = [a for a in overrides if not a.startswith("hydra.run.dir=")]
    command = [sys.executable, script, *args, f"hydra.run.dir={run_dir}"]
    children = []
    for local_rank in range(job.nprocs):
        # A session of its own: a Ctrl-C in the terminal reaches the launcher, which forwards
        # it once. (No preexec_fn: unsafe while the output-relay threads run.)
        child = subprocess.Popen(command, env=child_env(job, local_rank), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True)
        forward_output(child, f"[rank {job.first_rank + local_rank}] ")
        children.append(child)
    return children


class Supervisor:
    """Waits for the children; turns the first failure into a prompt stop of all of them."""

    def __init__(self, children: list[subprocess.Popen], first_rank: int):
        self.children, self.first_rank = children, first_rank
        self.deadline: float | None = None
        self.exit_code = 0

    def forward(self, signum: int, _frame=None) -> None:
        if self.deadline is not None and signum == signal.SIGINT:
            self._kill_all()  # a second Ctrl-C: stop now
            return
        log.warning("launcher: %s received, forwarding to %d processes",
                    signal.Signals(signum).name, len(self.children))
        self._signal_all(signum)
        self.deadline = time.monotonic() + PREEMPTION_GRACE_S

    def wait(self) -> int:
        while any(c.poll() is None for c in self.children):
            self._check_failures()
            if self.deadline is not None and time.monotonic() > self.deadline:
                log.error("launcher: processes still running after the grace period; killing")
                self._kill_all()
                self.exit_code = self.exit_code or 1
            time.sleep(POLL_S)
        self._check_failures()
        return self.exit_code

    def _check_failures(self) -> None:
        failed = [(rank, child) for rank, child in enumerate(self.children)
                  if child.poll() not in (None, 0)]
        # A process that ended because a peer is gone (exit code 5) is named only if no other
        # failed: the one it lost is the cause.
        failed.sort(key=lambda failure: failure[1].poll() == PEERS_EXIT_CODE)
        for local_rank, child in failed[:1]:
            code = child.poll()
            if self.exit_code:
                continue
            cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            log.error("launcher: rank %d (pid %d) failed with %s; stopping the other processes",
                      self.first_rank + local_rank, child.pid, cause)
            self.exit_code = code if code > 0 else 128 - code
            self._signal_all(signal.SIGTERM)
            self.deadline = time.monotonic() + FAILURE_GRACE_S

    def _signal_all(self, signum: int) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def _kill_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    job = node_job(args.nprocs)
    try:
        run_dir = resolve_run_dir(args.overrides, job)
    except PeersError as error:
        log.error("error: %s", error)
        return PEERS_EXIT_CODE
    log.info("launcher: %d processes (ranks %d-%d of %d), coordinator %s:%d, run dir %s",
             job.nprocs, job.first_rank, job.first_rank + job.nprocs - 1, job.world_size,
             job.master_addr, job.master_port, run_dir)
    supervisor = Supervisor(start(args.script, args.overrides, run_dir, job), job.first_rank)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, supervisor.forward)
    code = supervisor.wait()
    # Every node's closing line (the run's own closing lines come from process 0 alone).
    log.info("launcher: ranks %d-%d ended%s; run dir %s", job.first_rank,
             job.first_rank + job.nprocs - 1, " normally" if code == 0 else
             f" with exit code {code}", run_dir)
    return code


if __name__ == "__main__":
    sys.exit(main())
