"""Entry-point glue shared by run_training.py and the `python -m tunix_train.*` tools:
the command line checked before Hydra starts, DictConfig → typed Config with absolute paths,
and user mistakes → one sentence and the exit code of docs/monitoring.md's table."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from tunix_train import gc_policy
from tunix_train import overrides as overrides_lib
from tunix_train import paths, trainers
from tunix_train import validation
from tunix_train.config import Config, ConfigError
from tunix_train.data import sources
from tunix_train.paths import PeerSaveError, StorageError
from tunix_train.parallel import torchrun
from tunix_train.parallel.rendezvous import PeersError

log = logging.getLogger("tunix_train")

EXIT_CONFIG_ERROR = 2
EXIT_NON_FINITE = 3  # training.nan_policy=halt met a non-finite step (the watchdog exits 4)
EXIT_PLAN_DOES_NOT_FIT = 3  # python -m tunix_train.plan: the step does not fit the device
EXIT_PEERS = 5  # the job's processes did not join, or one died or hung
EXIT_STORAGE = 6  # a checkpoint could not be read (but for damage) or saved


def typed(cfg: DictConfig, overrides: Sequence[str] = (), base: Path | None = None) -> Config:
    """The typed config, every path in it absolute against `base` (the directory the command
    started in); with `model.init_from`, model dimensions come from that checkpoint."""
    from tunix_train.models import hf_config

    config = paths.resolve(OmegaConf.to_object(cfg), base or Path.cwd())
    config.model = hf_config.resolve(config.model, explicit_model_keys(overrides))
    return config


def explicit_model_keys(overrides: Sequence[str]) -> set[str]:
    """Model keys the user chose on the command line: `model.k=v`, or all of a `model=<name>`."""
    from tunix_train.models import hf_config

    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "model":
            keys.update(hf_config.CHECKPOINT_KEYS)
        elif key.startswith("model."):
            keys.add(key.split(".")[1])
    return keys


def given(overrides: Sequence[str], key: str) -> bool:
    """Whether the command line sets `key` itself."""
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides)


def compose(argv: Sequence[str]) -> Config:
    """Config of a `python -m tunix_train.<tool> overrides...` command (no Hydra run dir)."""
    chosen, note = overrides_lib.with_data_group(argv)
    if note:
        log.info(note)
    return typed(overrides_lib.compose_checked(chosen), chosen)


def before_hydra(argv: list[str]) -> None:
    """run_training.py and the planner, before `@hydra.main` runs: a mistake in the overrides
    is one sentence and exit code 2 (not Hydra's traceback-like report and exit 1), a
    `data.path` without its `data=` group gets its trainer's or its extension's, and processes
    started by hand agree on one run dir. Changes `argv` (sys.argv) in place."""
    tool_logging()
    with user_errors():
        args = overrides_lib.hydra_arguments(argv[1:])
        if args.help or args.hydra_help or args.info or args.shell_completion:
            return
        chosen, note = overrides_lib.with_data_group(args.overrides)
        if note:
            log.info(note)
            argv.append(chosen[0])
        overrides_lib.compose_checked(overrides_lib.single_values(chosen) if args.multirun
                                      else chosen)
        run_dir = None if args.multirun else agreed_run_dir(chosen)
        if run_dir:
            argv.append(f"hydra.run.dir={run_dir}")
        given = [o.split("=", 1)[1] for o in chosen if o.startswith("hydra.run.dir=")]
        if given and not args.multirun:  # else Hydra fails to make it with a traceback, exit 1
            paths.make_dir("hydra.run.dir", given[-1])


def agreed_run_dir(overrides: Sequence[str]) -> str | None:
    """For processes started by hand (MASTER_* or JAX_* variables, no launcher): the run dir
    process 0 composed, received over MASTER_PORT + 1, so that however far apart the processes
    started, `${now:}` is read once. Under SLURM or mpirun, unless hydra.run.dir is given:
    outputs/<experiment>/slurm-<job id> (the same for the job requeued) or mpi-<job id>.
    None for any other kind of start."""
    from tunix_train.parallel import job as job_lib, rendezvous

    job = job_lib.discover()
    if job.run_name and not any(o.startswith("hydra.run.dir=") for o in overrides):
        name = OmegaConf.select(overrides_lib.compose_checked(overrides), "experiment.name")
        return paths.absolute(f"outputs/{name}/{job.run_name}", Path.cwd())
    if job.source == "launcher" or not job.handshake:  # ours passes hydra.run.dir itself
        return None
    cfg = overrides_lib.compose_checked(overrides, return_hydra_config=True)
    own = paths.absolute(OmegaConf.select(cfg, "hydra.run.dir"), Path.cwd())
    host, port = job.handshake.rsplit(":", 1)
    return rendezvous.exchange_run_dir(host, int(port), job.process_id, 1,
                                       job.num_processes, own,
                                       int(OmegaConf.select(cfg, "distributed.init_timeout_s")))


class BelowError(logging.Filter):
    """Lets through what is not an error: the console on stdout leaves errors to stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


class JaxWarningsOnly(logging.Filter):
    """JAX's records below WARNING are not shown. A filter on our handlers, not a level on the
    "jax" logger: JAX, imported after logging is set up, takes a level set there as its
    `jax_logging_level`, and then prints each of its lines a second time, through a stderr
    handler of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or \
            record.name.partition(".")[0] not in ("jax", "jaxlib")


def tool_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(levelname)s] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(JaxWarningsOnly())
    logging.getLogger("absl").setLevel(logging.WARNING)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A ConfigError is the user's to fix, a halt on NaN the run's: one sentence, no traceback."""
    exits = ((ConfigError, EXIT_CONFIG_ERROR),
             (FloatingPointError, EXIT_NON_FINITE),  # the loop's NonFiniteLoss: the run failed
             (StorageError, EXIT_STORAGE), (PeersError, EXIT_PEERS), (PeerSaveError, EXIT_PEERS))
    try:
        yield
    except tuple(kind for kind, _ in exits) as error:
        log.error("error: %s", error)
        torchrun.record_error(str(error), consequence=isinstance(error, PeerSaveError))
        code = next(code for kind, code in exits if isinstance(error, kind))
        if isinstance(error, (StorageError, PeerSaveError)) and _joined_a_job():
            # A failed save may be this process's alone, and its peers wait for it (at a
            # barrier of the save): JAX's shutdown, and Orbax's threads, would wait for them.
            # Gone, it ends the job: they learn it from JAX (a missed heartbeat) or the launcher.
            _exit_now(code)
        sys.exit(code)
    except Exception as error:
        lost = lost_peer(error)
        if lost is None:
            raise
        sentence = (f"a collective failed because another process of the job is gone ({lost}); "
                    f"this process stops too. The process that failed first says why: its own "
                    f"lines, or torchrun's or srun's summary.")
        log.error("error: %s", sentence)
        torchrun.record_error(sentence, consequence=True)
        # Not sys.exit: JAX's shutdown would wait for the lost process (30 s under torchrun,
        # until its SIGKILL).
        _exit_now(EXIT_PEERS)


def _exit_now(code: int) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)


def _joined_a_job() -> bool:
    return "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized()


def lost_peer(error: BaseException) -> str | None:
    """The first line of XLA's error when a collective of a multi-process job failed because a
    peer process is gone (Gloo on CPU: "Connection closed by peer"), else None."""
    if type(error).__name__ != "JaxRuntimeError" or "jax" not in sys.modules:
        return None
    import jax

    from tunix_train.checkpoint_storage import PEER_GONE

    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if jax.process_count() > 1 and any(words in first for words in PEER_GONE):
        return first
    return None


# What Hydra puts in a run dir before our code runs: a dir holding nothing else has no run in it.
_HYDRA_ONLY = {".hydra", "train.log"}


@contextlib.contextmanager
def refused_leaves_no_run_dir(run_dir: Path, cwd: Path) -> Iterator[None]:
    """A command refused for its configuration leaves no run dir behind (Hydra makes one, with
    its .hydra/ and a train.log holding the error, before any check can run): the dir goes if
    that is all it holds, and so do the date and experiment dirs above it under `cwd` that it
    leaves empty. A dir holding anything else (checkpoints, metrics, a user's files) stays."""
    try:
        yield
    except ConfigError:
        if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= _HYDRA_ONLY:
            shutil.rmtree(run_dir, ignore_errors=True)
            for parent in list(run_dir.parents)[:3]:  # <date>, <experiment>, outputs
                if not parent.resolve().is_relative_to(cwd.resolve()) or parent == cwd:
                    break
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only if empty
        raise


def run_training(cfg: DictConfig, run_dir: str, hooks=None) -> None:
    """`hooks`: tests/faulty_training.py's fault injection; run_training.py passes none."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    with user_errors(), refused_leaves_no_run_dir(Path(run_dir), Path(hydra.runtime.cwd)):
        config = typed(cfg, hydra.overrides.task, Path(hydra.runtime.cwd))
        validation.validate(config)
        sources.check_records(config.data)  # parses JSON lines files (first lines if large)
        # Only now: a refused value is told before the training code (Orbax, Flax) is imported.
        from tunix_train.training import run as run_lib

        gc_policy.collect_less_often()  # what those imports made, frozen as the entry's were
        nexts = NextCommands.of(hydra.overrides.task, Path(run_dir), Path(hydra.runtime.cwd))
        summary = run_lib.run(config, Path(run_dir), trainers.task_of(config.trainer.name),
                              hooks or run_lib.StepHooks())
    nexts.report(summary["final_step"], config.training.steps, preempted=summary["preempted"],
                 complete=summary.get("complete", False))
    from tunix_train.parallel import distributed

    distributed.leave()


def _scheduler_start(job) -> str | None:
    """How a scheduler's (or torchrun's) job started run_training.py, for the closing lines'
    commands."""
    if job.source == "mpi":
        return f"mpirun -n {job.num_processes} python run_training.py"
    if job.source == "torchrun":  # one node; across nodes, each node's own torchrun line
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))
        across = f" --nnodes={nodes} --node_rank=<this node>" if nodes > 1 else ""
        return f"torchrun --nproc_per_node={job.local_world_size}{across} run_training.py"
    if job.source == "submitit":  # its local executor: so many processes on this machine
        return f"python -m tunix_train.launch --nprocs={job.num_processes} run_training.py"
    if job.source == "slurm":
        return (f"srun --kill-on-bad-exit=1 --nodes={os.environ.get('SLURM_STEP_NUM_NODES', 1)} "
                f"--ntasks={job.num_processes} python run_training.py")
    return None


def _environment(job) -> list[str]:
    """The variables the run needed that a command typed again needs too: the simulated CPU
    device count, and the job's MASTER_*, RANK and WORLD_SIZE where the user set them (by hand,
    or for a node's launcher; RANK: the first of this node's processes)."""
    from tunix_train.parallel.launcher import LAUNCHER_ENV

    words = []  # (no JAX call here: it runs before jax.distributed.initialize)
    count = re.search(r"--xla_force_host_platform_device_count=\d+",
                      os.environ.get("XLA_FLAGS", ""))
    if count:  # it only counts CPU devices, so it was set for a CPU
        words.append(f"XLA_FLAGS={count.group(0)}")
    env = os.environ
    across = int(env.get("WORLD_SIZE", 1)) > int(env.get("LOCAL_WORLD_SIZE", 1))
    if job.source == "env" or (env.get(LAUNCHER_ENV) and across):
        first = int(env["RANK"]) - (int(env.get("LOCAL_RANK", 0)) if env.get(LAUNCHER_ENV) else 0)
        words += [f"MASTER_ADDR={env['MASTER_ADDR']}", f"MASTER_PORT={env['MASTER_PORT']}",
                  f"RANK={first}", f"WORLD_SIZE={env['WORLD_SIZE']}"]
    return words


class NextCommands:
    """What to type next, said at the end of every run: where it is and how to go on."""

    def __init__(self, overrides: Sequence[str], run_dir: str, start: str):
        self.overrides, self.run_dir, self.start = list(overrides), run_dir, start

    @classmethod
    def of(cls, overrides: Sequence[str], run_dir: Path, cwd: Path) -> "NextCommands":
        from tunix_train.parallel import job as job_lib
        from tunix_train.parallel.launcher import LAUNCHER_ENV

        shown = os.path.relpath(run_dir, cwd) if run_dir.resolve().is_relative_to(
            cwd.resolve()) else str(run_dir)
        kept = [o for o in overrides if not o.startswith(("hydra.run.dir=", "training.steps="))]
        start, job = "python run_training.py", job_lib.discover()
        if os.environ.get(LAUNCHER_ENV):
            start = (f"python -m tunix_train.launch --nprocs="
                     f"{os.environ.get('LOCAL_WORLD_SIZE', 1)} run_training.py")
        else:
            start = _scheduler_start(job) or start
        if job.source not in job_lib.SCHEDULED:  # a job's script holds its environment
            start = " ".join([*_environment(job), start])
        return cls([shlex.quote(o) for o in kept], shown, start)

    def train(self, steps: int) -> str:
        return " ".join([self.start, *self.overrides, f"training.steps={steps}",
                         f"hydra.run.dir={shlex.quote(self.run_dir)}"])

    def generate(self) -> str:
        return (f"python -m tunix_train.generate checkpoint.resume_from="
                f"{shlex.quote(self.run_dir)} 'generate.prompt=\"...\"'")

    def report(self, step: int, steps: int, preempted: bool = False,
               complete: bool = False) -> None:
        if complete:
            log.info("%s is already complete: its checkpoint of step %d reaches training.steps="
                     "%d, so there is nothing to do.", self.run_dir, step, steps)
        elif preempted:
            log.info("stopped after step %d of %d; checkpoint: %s", step, steps,
                     os.path.join(self.run_dir, "checkpoints", str(step)))
            log.info("resume:   %s", self.train(steps))
            return
        else:
            log.info("finished step %d of %d; run dir: %s", step, steps, self.run_dir)
        log.info("generate: %s", self.generate())
        # Past the step reached: a run asked for fewer steps than its checkpoint holds (already
        # complete) continues from there, not to a step it has passed.
        log.info("continue: %s", self.train(2 * max(step, steps)))
