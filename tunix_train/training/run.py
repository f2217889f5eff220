"""`run(cfg, run_dir)`: setup → restore or initialise → loop (loop.py) → evaluate → close."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from omegaconf import OmegaConf

from tunix_train import config as config_lib
from tunix_train.analysis import flops, profiling
from tunix_train.checkpoint import Checkpoints
from tunix_train.config import Config
from tunix_train.parallel import distributed
from tunix_train.parallel import stages
from tunix_train.training import state as state_lib
from tunix_train.training.loop import Loop, StepHooks
from tunix_train.training.metrics import (MetricsWriter, Throughput, report_costs,
                                          setup_process_logging)
from tunix_train.training.setup import Setup

log = logging.getLogger("tunix_train")


def run(cfg: Config, run_dir: Path, hooks: StepHooks = StepHooks()) -> dict[str, Any]:
    """`hooks`: the tests' fault injection (tests/faulty_training.py); a run has none."""
    config_lib.validate(cfg)
    job = distributed.initialize(cfg.distributed)
    setup_process_logging(jax.process_index())
    setup = Setup.create(cfg, processes_per_node=job.local_world_size)
    data = setup.open_data()
    state = setup.initial_state(run_dir, data.train)
    first_step = int(jax.device_get(state["step"]))
    writer = MetricsWriter(run_dir, cfg.logging, cfg.training.steps, first_step)
    log_startup(setup, state, writer)
    train_step = _compiled_train_step(setup, writer, run_dir)
    evaluate = setup.evaluator(data.eval_batches)
    if first_step == 0:
        _initial_evaluation(state, evaluate, writer)
    checkpoints = Checkpoints(run_dir, cfg.checkpoint)  # after a restore set damaged steps aside
    try:
        with writer.console():
            loop = _loop(setup, train_step, data.train, evaluate, writer, checkpoints, hooks,
                         first_step)
            state, summary = loop.run(state, first_step)
            if not summary["preempted"]:  # the grace period is for saving, not evaluating
                _final_evaluation(state, summary, evaluate, writer)
    finally:
        checkpoints.close()  # waits until the last save has committed
        data.close()
        writer.close()
    return summary


def _compiled_train_step(setup: Setup, writer: MetricsWriter, run_dir: Path) -> Callable:
    """Compiled ahead of time, so memory and communication are known before the first step."""
    compiled = setup.compile_train_step()
    report_costs(setup.analyse(compiled), writer, run_dir)
    if setup.cfg.training.profile_communication:
        return profiling.traced(compiled, run_dir / "tensorboard", setup.cfg.training.steps)
    return compiled


def _loop(setup: Setup, train_step, data, evaluate, writer, checkpoints, hooks: StepHooks,
          first_step: int) -> Loop:
    cfg = setup.cfg
    mfu_factor = flops.mfu_per_token_per_s(cfg.model, cfg.data.seq_len, cfg.logging,
                                           jax.devices())
    return Loop(train_step, data, evaluate, writer, checkpoints, hooks, cfg.training,
                cfg.logging, cfg.distributed.step_timeout_s,
                Throughput(first_step, setup.tokens_per_step, mfu_factor),
                config_lib.to_dict(cfg))


def _initial_evaluation(state, evaluate, writer: MetricsWriter) -> None:
    """The reference for "did it learn": the same validation batches before any update."""
    initial = evaluate(state["params"])
    writer.scalars(0, {"loss": initial}, group="eval")
    log.info("validation loss before training %.4f", initial)


def _final_evaluation(state, summary: dict, evaluate, writer: MetricsWriter) -> None:
    summary["eval_loss"] = evaluate(state["params"])
    writer.scalars(summary["final_step"], {"loss": summary["eval_loss"]}, group="eval")
    log.info("final validation loss %.4f (step %d)", summary["eval_loss"], summary["final_step"])


def log_startup(setup: Setup, state, writer: MetricsWriter) -> None:
    cfg, mesh, b = setup.cfg, setup.mesh, setup.batch
    devices = jax.devices()
    fsdp = setup.options.sync.fsdp
    count = sum(x.size for x in jax.tree.leaves(state["params"]))
    total, per_device = state_lib.param_bytes(state["params"])
    lines = [
        f"devices: {len(devices)} × {devices[0].device_kind} over {jax.process_count()} "
        f"process(es); this is process {jax.process_index()}",
        f"mesh: {' × '.join(f'{k}={v}' for k, v in mesh.shape.items())}",
        f"batch: micro_batch {b.rows // fsdp} × fsdp {fsdp} × accumulation {b.accum} = "
        f"{b.sequences} sequences × {b.seq_len} tokens = {b.sequences * b.seq_len:,} tokens "
        f"per step",
        f"precision: compute {jnp.dtype(setup.options.compute_dtype).name}, "
        f"master weights and optimizer state float32; zero_stage {cfg.training.zero_stage}",
    ]
    pipeline = stages.describe(setup.options.pipeline, cfg.model, b.rows // fsdp)
    if pipeline:
        lines.append(stages.line(pipeline))
    for line in lines:
        log.info(line)
    log.info("parameters: %s (%.1f MB fp32); per device %.1f MB", f"{count:,}", total / 1e6,
             per_device / 1e6)
    writer.text("mesh", "\n".join(lines))
    writer.text("config", OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # text, not parsing
