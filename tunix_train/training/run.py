"""`run(cfg, run_dir)`: setup → restore or initialise → loop (loop.py) → evaluate → close."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from tunix_train import checkpoint
from tunix_train.parallel import distributed
from tunix_train.training import optim
from tunix_train.analysis import profiling
from tunix_train.parallel import sharding
from tunix_train.analysis import costs
from tunix_train import config as config_lib
from tunix_train.training import faults as faults_lib
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.training import state as state_lib
from tunix_train.checkpoint import Checkpoints
from tunix_train.config import Config, ConfigError
from tunix_train.data import pipeline
from tunix_train.data.pipeline import BatchShape, GlobalBatches
from tunix_train.parallel.fsdp import GradientPlan
from tunix_train.training.loop import Loop
from tunix_train.models.head import VocabChunks
from tunix_train.training.metrics import MetricsWriter, setup_process_logging
from tunix_train.training.train_step import StepOptions, jit_eval_step

log = logging.getLogger("tunix_train")


@dataclass(frozen=True)
class Setup:
    """Everything derived from the config before any array is allocated."""

    cfg: Config
    mesh: Mesh
    plan: sharding.ShardingPlan
    batch: BatchShape
    options: StepOptions
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    spec: state_lib.StateSpec

    @property
    def tokens_per_step(self) -> int:
        return self.batch.sequences * self.batch.seq_len


def run(cfg: Config, run_dir: Path) -> dict[str, Any]:
    config_lib.validate(cfg)
    job = distributed.initialize(cfg.distributed)
    setup_process_logging(jax.process_index())
    faults = faults_lib.load()
    setup = build_setup(cfg, processes_per_node=job.local_world_size)
    data = _data(setup)
    state = _initial_state(setup, run_dir, data.train)
    first_step = int(jax.device_get(state["step"]))
    writer = MetricsWriter(run_dir, cfg.logging, cfg.training.steps, first_step)
    _log_startup(setup, writer)
    _log_param_bytes(state)
    train_step, evaluate = _compiled_steps(setup, data.eval_batches, writer, run_dir)
    if first_step == 0:
        _initial_evaluation(state, evaluate, writer)
    checkpoints = Checkpoints(run_dir, cfg.checkpoint)  # after a restore set damaged steps aside
    try:
        with writer.console():
            loop = Loop(setup, train_step, data.train, evaluate, writer, checkpoints, faults)
            state, summary = loop.run(state)
            if not summary["preempted"]:  # the grace period is for saving, not evaluating
                _final_evaluation(state, summary, evaluate, writer)
    finally:
        checkpoints.close()  # waits until the last save has committed
        data.close()
        writer.close()
    return summary


def _compiled_steps(setup: Setup, eval_batches: list[pipeline.Batch], writer: MetricsWriter,
                    run_dir: Path) -> tuple[Callable, Callable]:
    batch_sharding = sharding.batch_sharding(setup.mesh, dict(setup.plan.params), leading=1)
    train_step = _compiled_train_step(setup, batch_sharding, writer, run_dir)
    return train_step, _evaluator(setup, eval_batches, batch_sharding)


def _initial_state(setup: Setup, run_dir: Path, data: GlobalBatches) -> state_lib.TrainState:
    """Own checkpoints (a restarted run) > checkpoint.resume_from > init_params_from > fresh."""
    cfg, spec = setup.cfg.checkpoint, setup.spec
    own = checkpoint.own_checkpoints(run_dir)
    if own and cfg.resume_from:
        log.warning("%s has checkpoints: continuing this run; checkpoint.resume_from is ignored",
                    run_dir)
    if own or cfg.resume_from:
        abstract = checkpoint.with_shardings(spec.abstract, spec.shardings)
        restored = checkpoint.restore(own or cfg.resume_from, abstract, setup.cfg.model,
                                      set_aside_in=run_dir if own else None)
        data.set_state(restored.data_state)
        log.info("resuming from step %d (%s)", restored.step, restored.path)
        return restored.state
    if cfg.init_params_from:
        params = checkpoint.load_params(cfg.init_params_from, spec.abstract["params"],
                                        spec.shardings["params"], setup.cfg.model)
        log.info("parameters from %s; step and optimizer state start afresh",
                 cfg.init_params_from)
        return state_lib.with_params(params, spec, setup.optimizer)
    return state_lib.init(setup.cfg, spec, setup.optimizer)


def _initial_evaluation(state, evaluate, writer: MetricsWriter) -> None:
    """The reference for "did it learn": the same validation batches before any update."""
    initial = evaluate(state["params"])
    writer.scalars(0, {"loss": initial}, group="eval")
    log.info("validation loss before training %.4f", initial)


def _final_evaluation(state, summary: dict, evaluate, writer: MetricsWriter) -> None:
    summary["eval_loss"] = evaluate(state["params"])
    writer.scalars(summary["final_step"], {"loss": summary["eval_loss"]}, group="eval")
    log.info("final validation loss %.4f (step %d)", summary["eval_loss"], summary["final_step"])


def _compiled_train_step(setup: Setup, batch_sharding, writer: MetricsWriter, run_dir: Path):
    """Compiled ahead of time, so memory and communication are known before the first step."""
    compiled = costs.compile_step(setup, batch_sharding)
    costs.report(setup, costs.analyse(setup, compiled), writer, run_dir)
    if setup.cfg.training.profile_communication:
        return profiling.traced(compiled, run_dir / "tensorboard", setup.cfg.training.steps)
    return compiled


def build_setup(cfg: Config, devices: list[jax.Device] | None = None,
                processes_per_node: int = 1) -> Setup:
    """`devices` defaults to all of them; tests pass a subset to compare meshes in one process."""
    devices = devices if devices is not None else jax.devices()
    shape = mesh_lib.parse(cfg.model.mesh_shape, len(devices))
    mesh = mesh_lib.build(shape, devices, processes_per_node)
    plan = sharding.plan(cfg.model, mesh, cfg.training.zero_stage)
    batch = batch_shape(cfg, shape.fsdp)
    optimizer = optim.build(cfg.optimizer, cfg.training.steps)
    schedule = optim.schedule(cfg.optimizer, cfg.training.steps)
    spec = state_lib.spec(cfg, mesh, plan, optimizer)
    dtype = compute_dtype(cfg.training.mixed_precision)
    specs = lambda shardings: jax.tree.map(lambda s: s.spec, shardings)  # noqa: E731
    grads = GradientPlan(
        mesh=mesh, param_specs=specs(spec.shardings["params"]),
        grad_specs=specs(spec.grad_shardings), stacked=spec.stacked,
        accumulation_steps=batch.accum, sync_every=cfg.training.sync_gradients_every,
        compute_dtype=dtype, reduce_dtype=reduce_dtype(cfg.training.grad_reduce_dtype, dtype),
    )
    shards = sharding.vocab_shards(plan.params, mesh)
    chunks = VocabChunks(sharding.vocab_chunks(cfg.model.vocab_size, shards,
                                               cfg.training.loss_vocab_chunk), shards)
    options = StepOptions(compute_dtype=dtype, gradients=grads, mesh=mesh, rules=plan.params,
                          vocab_chunks=chunks)
    return Setup(cfg, mesh, plan, batch, options, optimizer, schedule, spec)


def batch_shape(cfg: Config, fsdp: int) -> BatchShape:
    """micro_batch_size × fsdp × accumulation = global batch (sequences per optimizer step)."""
    t = cfg.training
    accum, micro = t.gradient_accumulation_steps, t.micro_batch_size
    if t.global_batch_size is not None:
        if t.global_batch_size % (fsdp * accum):
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} does not divide over "
                f"fsdp={fsdp} × gradient_accumulation_steps={accum}; use a multiple of "
                f"{fsdp * accum}."
            )
        micro = t.global_batch_size // (fsdp * accum)
    return BatchShape(accum=accum, rows=micro * fsdp, seq_len=cfg.data.seq_len)


def reduce_dtype(grad_reduce_dtype: str, compute: jnp.dtype) -> jnp.dtype:
    """`training.grad_reduce_dtype`: auto = the compute dtype (bf16 under mixed precision)."""
    return compute if grad_reduce_dtype == "auto" else jnp.float32


def compute_dtype(mixed_precision: str) -> jnp.dtype:
    if mixed_precision == "auto":
        # bf16 pays off on accelerators; on CPUs it is 10-25% slower than fp32.
        mixed_precision = "fp32" if jax.default_backend() == "cpu" else "bf16"
    return jnp.bfloat16 if mixed_precision == "bf16" else jnp.float32


def _data(setup: Setup) -> pipeline.Data:
    cfg = setup.cfg
    batch_sharding = sharding.batch_sharding(setup.mesh, dict(setup.plan.params), leading=1)
    return pipeline.build(cfg.data, cfg.model, cfg.training.seed, setup.batch, batch_sharding)


def _evaluator(setup: Setup, batches: list[pipeline.Batch],
               batch_sharding) -> Callable[[Any], float]:
    eval_step = jit_eval_step(setup.spec, setup.options, batch_sharding)

    def evaluate(params) -> float:
        sums = jax.device_get([eval_step(params, batch) for batch in batches])
        loss, tokens = (sum(float(pair[k]) for pair in sums) for k in (0, 1))
        return loss / max(tokens, 1.0)

    return evaluate


def _log_startup(setup: Setup, writer: MetricsWriter) -> None:
    cfg, mesh, b = setup.cfg, setup.mesh, setup.batch
    devices = jax.devices()
    fsdp = mesh.shape[mesh_lib.FSDP]
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
    for line in lines:
        log.info(line)
    writer.text("mesh", "\n".join(lines))
    from omegaconf import OmegaConf  # config text for TensorBoard, not parsing

    writer.text("config", OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def _log_param_bytes(state) -> None:
    count = sum(x.size for x in jax.tree.leaves(state["params"]))
    total, per_device = state_lib.param_bytes(state["params"])
    log.info("parameters: %s (%.1f MB fp32); per device %.1f MB", f"{count:,}", total / 1e6,
             per_device / 1e6)
