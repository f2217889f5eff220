"""`run(cfg, run_dir)`: setup → initialise → loop (step, log, evaluate) → close. Top-down."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from tunix_train import config as config_lib
from tunix_train import distributed, optim, sharding
from tunix_train import mesh as mesh_lib
from tunix_train import state as state_lib
from tunix_train.config import Config, ConfigError
from tunix_train.data.pipeline import BatchShape, GlobalBatches, load_windows
from tunix_train.metrics import MetricsWriter, Throughput, format_line, setup_process_logging
from tunix_train.train_step import StepOptions, jit_eval_step, jit_train_step

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
    setup = build_setup(cfg, processes_per_node=job.local_world_size)
    train_data, eval_data = _data(setup)
    writer = MetricsWriter(run_dir, cfg.logging, cfg.training.steps)
    _log_startup(setup, writer)
    state = state_lib.init(cfg, setup.spec, setup.optimizer)
    _log_param_bytes(state)
    batch_sharding = sharding.batch_sharding(setup.mesh, dict(setup.plan.params), leading=1)
    train_step = jit_train_step(setup.spec, setup.optimizer, setup.schedule, setup.options,
                                batch_sharding)
    evaluate = _evaluator(setup, eval_data, batch_sharding)
    if int(jax.device_get(state["step"])) == 0:
        # The reference for "did it learn": the same validation batches before any update.
        initial = evaluate(state["params"])
        writer.scalars(0, {"loss": initial}, group="eval")
        log.info("validation loss before training %.4f", initial)
    try:
        with writer.console():
            state, summary = _loop(setup, state, train_step, train_data, evaluate, writer)
            summary["eval_loss"] = evaluate(state["params"])
            writer.scalars(summary["final_step"], {"loss": summary["eval_loss"]}, group="eval")
            log.info("final validation loss %.4f (step %d)", summary["eval_loss"],
                     summary["final_step"])
    finally:
        writer.close()
    return summary


def build_setup(cfg: Config, devices: list[jax.Device] | None = None,
                processes_per_node: int = 1) -> Setup:
    """`devices` defaults to all of them; tests pass a subset to compare meshes in one process."""
    devices = devices if devices is not None else jax.devices()
    shape = mesh_lib.parse(cfg.model.mesh_shape, len(devices))
    mesh = mesh_lib.build(shape, devices, processes_per_node)
    plan = sharding.plan(cfg.model, mesh, cfg.training.zero_stage)
    batch = batch_shape(cfg, shape.fsdp)
    options = StepOptions(
        compute_dtype=compute_dtype(cfg.training.mixed_precision),
        accumulation_steps=batch.accum, mesh=mesh, rules=plan.params,
    )
    optimizer = optim.build(cfg.optimizer, cfg.training.steps)
    schedule = optim.schedule(cfg.optimizer, cfg.training.steps)
    spec = state_lib.spec(cfg, mesh, plan, optimizer)
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


def compute_dtype(mixed_precision: str) -> jnp.dtype:
    if mixed_precision == "auto":
        # bf16 pays off on accelerators; on CPUs it is 10-25% slower than fp32.
        mixed_precision = "fp32" if jax.default_backend() == "cpu" else "bf16"
    return jnp.bfloat16 if mixed_precision == "bf16" else jnp.float32


def _data(setup: Setup) -> tuple[GlobalBatches, GlobalBatches]:
    cfg = setup.cfg
    train_windows, eval_windows = load_windows(cfg.data, cfg.model)
    batch_sharding = sharding.batch_sharding(setup.mesh, dict(setup.plan.params), leading=1)
    train = GlobalBatches(train_windows, setup.batch, batch_sharding, cfg.training.seed)
    eval_shape = BatchShape(accum=1, rows=setup.batch.rows, seq_len=setup.batch.seq_len)
    evaluation = GlobalBatches(eval_windows, eval_shape, batch_sharding, seed=0, shuffle=False)
    return train, evaluation


def _evaluator(setup: Setup, data: GlobalBatches, batch_sharding) -> Callable[[Any], float]:
    eval_step = jit_eval_step(setup.spec, setup.options, batch_sharding)

    def evaluate(params) -> float:
        batches = range(setup.cfg.data.eval_batches)
        sums = jax.device_get([eval_step(params, data.batch(i)) for i in batches])
        loss, tokens = (sum(float(pair[k]) for pair in sums) for k in (0, 1))
        return loss / max(tokens, 1.0)

    return evaluate


def _loop(setup: Setup, state, train_step, data: GlobalBatches, evaluate, writer: MetricsWriter):
    """Dispatches step s+1 before fetching step s's metrics, so the host never idles the device."""
    cfg = setup.cfg
    total, every = cfg.training.steps, cfg.logging.every_steps
    first_step = int(jax.device_get(state["step"]))
    throughput, pending, summary = Throughput(first_step), None, {}
    for step in range(first_step, total):
        state, metrics = train_step(state, next(data))
        if pending is not None:
            _report(pending, setup, throughput, writer, summary)
        done = step + 1
        pending = (done, metrics) if done % every == 0 or done == total else None
        if cfg.training.eval_every_steps and done % cfg.training.eval_every_steps == 0 \
                and done != total:
            eval_loss = evaluate(state["params"])
            writer.scalars(done, {"loss": eval_loss}, group="eval")
            log.info("step %d | validation loss %.4f", done, eval_loss)
    if pending is not None:
        _report(pending, setup, throughput, writer, summary)
    summary["final_step"] = total
    return state, summary


def _report(pending, setup: Setup, throughput: Throughput, writer: MetricsWriter,
            summary: dict) -> None:
    step, metrics = pending
    values = {k: float(v) for k, v in jax.device_get(metrics).items() if k != "tokens"}
    if not math.isfinite(values["loss"]):
        raise FloatingPointError(f"loss is {values['loss']} at step {step}.")
    values.update(throughput.interval(step, setup.tokens_per_step))
    summary.setdefault("first_loss", values["loss"])
    summary["last_loss"] = values["loss"]
    writer.scalars(step, values)
    writer.progress(step, values)
    log.info(format_line(step, setup.cfg.training.steps, values))


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
