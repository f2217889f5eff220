"""`run(cfg, run_dir)`: setup → restore or initialise → loop (loop.py) → evaluate → close."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from omegaconf import OmegaConf

from tunix_train import backend
from tunix_train import validation
from tunix_train.analysis import flops, profiling
from tunix_train.checkpoint import Checkpoints, check_room
from tunix_train.config import Config
from tunix_train.models import families
from tunix_train.parallel import distributed
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.parallel import stages
from tunix_train.parallel.rendezvous import PEERS_EXIT_CODE
from tunix_train.parallel.waiting import Waiting
from tunix_train.training import state as state_lib
from tunix_train.training.loop import Loop, StepHooks
from tunix_train.training.metrics import (MetricsWriter, Throughput, report_costs,
                                          setup_process_logging)
from tunix_train.training.setup import Setup
from tunix_train.training.trackers import Trackers
from tunix_train.training.train_step import LossFn, loss_sums
from tunix_train.training.watchdog import untimed

log = logging.getLogger("tunix_train")


class Task:
    """What a trainer adds to the one run below: its batches, its loss, its step and its
    evaluation. This class is the next-token task of pre-training and SFT (trainer=default);
    grpo/trainer.py and dpo/trainer.py subclass it. Everything else (set-up, restore,
    compilation, the cost report, profiling, the loop, checkpoints, metrics) is `run`'s, so
    every training.* and logging.* key means the same under every trainer."""

    mfu: bool = True  # the step's FLOPs are the model's forward and backward on its tokens

    @staticmethod
    def loss(cfg: Config) -> tuple[LossFn, dict[str, Any]]:
        """The train step's loss function ((graphdef, params, micro-batch, chunks) → sums) and
        the [accum, rows, seq_len] batch entries it reads besides the tokens, by dtype (the
        planner compiles the same step)."""
        return loss_sums, {}

    def __init__(self, setup: Setup):
        self.setup = setup
        self.data = setup.open_data()
        self.inputs = self.data.train  # what the loop draws batches from (get_state/set_state)

    def steps_done(self, state) -> int:
        return int(jax.device_get(state["step"]))

    def start(self, state, writer: MetricsWriter, first_step: int) -> None:
        """After the restore, before the first step: reference models, start-up lines."""

    def step(self, update: Callable) -> Callable:
        """The loop's step (state, batch) → (state, metrics) around the compiled `update`."""
        return update

    def evaluator(self) -> Callable[[Any], dict[str, float]] | None:
        """train state → held-out metrics ("loss" first); None: the task has no evaluation."""
        evaluate = self.setup.evaluator(self.data.eval_batches)
        return lambda state: {"loss": evaluate(state)}

    def close(self) -> None:
        self.data.close()


def run(cfg: Config, run_dir: Path, task: type[Task] = Task,
        hooks: StepHooks = StepHooks()) -> dict[str, Any]:
    """`task`: the trainer's part (Task, grpo's or dpo's); `hooks`: the tests' fault injection
    (tests/faulty_training.py); a run has none."""
    validation.validate(cfg)
    setup, work = _joined(cfg, run_dir, task)
    writer = checkpoints = None
    status = "failed"
    try:
        state = setup.initial_state(run_dir, work.inputs)
        first_step = work.steps_done(state)
        if first_step >= cfg.training.steps:
            return already_complete(first_step)
        _start_checks(cfg, run_dir, state, hooks)
        trackers = Trackers.open(cfg, run_dir) if jax.process_index() == 0 else None
        writer = MetricsWriter(run_dir, cfg.logging, cfg.training.steps, first_step, trackers)
        log_startup(setup, state, writer)
        work.start(state, writer, first_step)
        step, evaluate = _step_and_evaluation(setup, work, writer, run_dir)
        if first_step == 0 and evaluate is not None:
            _initial_evaluation(state, evaluate, writer)
        # Opened after the restore, which set any damaged steps aside.
        checkpoints = Checkpoints(run_dir, cfg.checkpoint)
        with writer.console():
            loop = _loop(setup, work, step, evaluate, writer, checkpoints, hooks, first_step,
                         setup.saved_config(state.get(state_lib.FROZEN)))
            state, summary = loop.run(state, first_step)
            with finishing(summary["final_step"]):
                if not summary["preempted"] and evaluate is not None:  # the grace period
                    _final_evaluation(state, summary, evaluate, writer)  # is for saving
                checkpoints.close()
            status = "preempted" if summary["preempted"] else "finished"
    finally:
        if checkpoints is not None:
            checkpoints.close()  # waits until the last save has committed
        work.close()
        if writer is not None:
            writer.close(status)
    return summary


def _start_checks(cfg: Config, run_dir: Path, state, hooks: StepHooks) -> None:
    """What the processes check together before the step compiles: that the checkpoint folder
    has room (its first save would fail), each waiting for the others at most
    distributed.init_timeout_s (`distributed.together`)."""
    hooks.before_start_checks()
    with distributed.together("the check that the checkpoint folder has room",
                              cfg.distributed.init_timeout_s):
        check_room(run_dir, state)


def _joined(cfg: Config, run_dir: Path, task: type[Task]) -> tuple[Setup, Task]:
    """This process in its job (every process on one run dir), the run built on the job's
    devices, and the trainer's part of it."""
    job = distributed.initialize(cfg.distributed)
    distributed.check_same_run_dir(run_dir, cfg.distributed.init_timeout_s)
    setup_process_logging(jax.process_index())
    setup = Setup.create(cfg, processes_per_node=job.local_world_size)
    return setup, task(setup)


def _step_and_evaluation(setup: Setup, work: Task, writer: MetricsWriter, run_dir: Path
                         ) -> tuple[Callable, Callable | None]:
    """The trainer's step around the compiled train step (traced for the communication profile
    when asked), and its evaluation (None: it has none)."""
    step = work.step(_compiled_train_step(setup, work, writer, run_dir))
    if setup.cfg.training.profile_communication:
        step = profiling.traced(step, run_dir / "tensorboard", setup.cfg.training.steps)
    return step, work.evaluator()


def already_complete(step: int) -> dict[str, Any]:
    """The summary of a run whose restored checkpoint reaches `training.steps`: found after
    the restore (which refuses a changed config and sets a damaged step aside) and before any
    compilation, evaluation or record."""
    return {"final_step": step, "preempted": False, "complete": True}


def finishing(step: int) -> contextlib.AbstractContextManager:
    """After the last step of a multi-process job, the final evaluation and the last commit
    wait on every process: said every 30 s, and SIGTERM/SIGINT end the wait (JAX's
    preemption notifier, which would swallow them, has nothing left to do)."""
    if jax.process_count() == 1:
        return contextlib.nullcontext()
    return Waiting(f"the other processes to finish (final evaluation, checkpoint of step {step})",
                   None, PEERS_EXIT_CODE, every_s=30)


def _compiled_train_step(setup: Setup, work: Task, writer: MetricsWriter,
                         run_dir: Path) -> Callable:
    """Compiled ahead of time, so memory and communication are known before the first step."""
    loss_fn, extra = work.loss(setup.cfg)
    compiled = setup.compile_train_step(loss_fn, extra)
    report_startup_costs(setup, compiled, writer, run_dir)
    return distributed.first_run_together(setup.runnable(compiled, loss_fn), "the train step",
                                          setup.cfg.distributed.init_timeout_s)


def report_startup_costs(setup: Setup, compiled, writer: MetricsWriter, run_dir: Path) -> None:
    """Memory, FLOPs and collectives of the compiled step, read from XLA's memory analysis and
    HLO text, whose forms change between releases: a failure here is a warning, never the end
    of a run (the planner, whose job the analysis is, lets it fail)."""
    try:
        report_costs(setup.analyse(compiled), writer, run_dir)
    except Exception as error:  # noqa: BLE001 - any failure of the report leaves training as is
        log.warning("the start-up cost report failed (%s: %s); training goes on without it",
                    type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")


def _loop(setup: Setup, work: Task, step, evaluate, writer, checkpoints, hooks: StepHooks,
          first_step: int, saved_config: dict) -> Loop:
    cfg = setup.cfg
    mfu_factor = flops.mfu_per_token_per_s(cfg.model, cfg.data.seq_len, cfg.logging,
                                           jax.devices()) if work.mfu else None
    return Loop(step, work.inputs, evaluate, writer, checkpoints, hooks, cfg.training,
                cfg.logging, cfg.distributed.step_timeout_s,
                Throughput(first_step, setup.tokens_per_step, mfu_factor), saved_config)


def _initial_evaluation(state, evaluate, writer: MetricsWriter) -> None:
    """The reference for "did it learn": the same validation batches before any update; said
    while it runs (compiling it included), as what the watchdog does not time is."""
    with untimed("the evaluation before training to finish, its compilation included"):
        initial = evaluate(state)
    writer.scalars(0, initial, group="eval")
    log.info("validation loss before training %.4f%s", initial["loss"], others(initial))


def _final_evaluation(state, summary: dict, evaluate, writer: MetricsWriter) -> None:
    values = evaluate(state)
    summary["eval_loss"] = values["loss"]
    summary["eval"] = values
    writer.scalars(summary["final_step"], values, group="eval")
    writer.summary({f"final/eval_{name}": value for name, value in values.items()})
    log.info("final validation loss %.4f%s (step %d)", values["loss"], others(values),
             summary["final_step"])


def others(values: dict[str, float]) -> str:
    """The held-out metrics besides the loss, for a log line."""
    return "".join(f", {k} {v:.4f}" for k, v in values.items() if k != "loss")


def log_startup(setup: Setup, state, writer: MetricsWriter) -> None:
    """The start-up facts (docs/monitoring.md), logged and written to TensorBoard."""
    lines = _startup_lines(setup) + [_parameters_line(setup.cfg, state["params"])]
    for line in lines:
        log.info(line)
    if backend.is_cpu() and mesh_lib.nvidia_gpus_present():
        log.warning("this machine has NVIDIA GPUs but JAX runs on the CPU: install JAX's CUDA "
                    "wheels with pip install -c constraints.txt -e '.[cuda]' (README)")
    writer.text("mesh", "\n".join(lines))
    writer.text("config", OmegaConf.to_yaml(OmegaConf.structured(setup.cfg)))  # text, not parsing


def _startup_lines(setup: Setup) -> list[str]:
    """The model, devices, mesh, batch and precision; LoRA, the pipeline and the experts where
    the run has them."""
    cfg, mesh, b, m = setup.cfg, setup.mesh, setup.batch, setup.cfg.model
    devices = jax.devices()
    ranks = setup.options.sync.data_ranks
    data = " × ".join(f"{a} {mesh.shape[a]}" for a in mesh_lib.DATA_AXES if a in mesh.shape)
    lines = [
        f"model: {m.name} ({families.of(m).display}: {m.num_layers} layers, d {m.embed_dim}, "
        f"{m.num_heads} heads ({m.num_kv_heads} KV) of {m.head_dim}, vocab {m.vocab_size}, "
        f"{'tied' if m.tie_embeddings else 'own'} output head)",
        f"devices: {len(devices)} × {devices[0].device_kind} ({backend.name()}) over "
        f"{jax.process_count()} process(es); this is process {jax.process_index()}",
        f"mesh: {' × '.join(f'{k}={v}' for k, v in mesh.shape.items())}",
        f"batch: micro_batch {b.rows // ranks} × {data} × accumulation {b.accum} = "
        f"{b.sequences} sequences × {b.seq_len} tokens = {b.sequences * b.seq_len:,} tokens "
        f"per step",
        f"precision: compute {jnp.dtype(setup.options.compute_dtype).name}, "
        f"master weights and optimizer state float32; zero_stage {cfg.training.zero_stage}",
    ]
    pipeline = stages.describe(setup.options.pipeline, m, b.rows // ranks)
    optional = [setup.lora_line() if cfg.lora.on else None,
                stages.line(pipeline) if pipeline else None,
                families.experts_line(setup.params.model, mesh.shape.get(mesh_lib.EP, 1))]
    return lines + [line for line in optional if line]


def _parameters_line(cfg: Config, params: Any) -> str:
    count = sum(x.size for x in jax.tree.leaves(params))
    total, per_device = state_lib.param_bytes(params)
    active = families.active_params(cfg.model)
    return (f"parameters: {count:,} ({total / 1e6:.1f} MB fp32); per device "
            f"{per_device / 1e6:.1f} MB"
            + (f"; {active:,} active per token" if active != families.count_params(cfg.model)
               else ""))
