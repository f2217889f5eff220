"""`Setup`: every piece of a training run, built from the config before any array exists.

    Setup.create(cfg)      mesh → rules → parameter and state layouts → batch → optimizer → step
    setup.train_step()     the jitted step;  setup.compile_train_step(): compiled from shapes alone
    setup.initial_state()  own checkpoints > checkpoint.resume_from > checkpoint.init_params_from
                           > model.init_from > random: the one place that knows this order

`training/run.py` uses it to train, `python -m tunix_train.plan` to compile a step for a mesh it
does not have, and the benchmarks and tests to build exactly what a run builds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from tunix_train import checkpoint
from tunix_train import config as config_lib
from tunix_train.analysis import costs
from tunix_train.config import Config, ConfigError, TrainingConfig
from tunix_train.data import pipeline
from tunix_train.data.pipeline import BatchShape
from tunix_train.models import families
from tunix_train.models.head import VocabChunks
from tunix_train.parallel import fsdp, sharding
from tunix_train.parallel import stages
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.parallel.layout import ParamLayout
from tunix_train.training import optim
from tunix_train.training.state import HOST, StateLayout, TrainState
from tunix_train.training.train_step import (LossFn, StepOptions, jit_eval_step, jit_train_step,
                                             loss_sums)

log = logging.getLogger("tunix_train")


@dataclass(frozen=True)
class Setup:
    cfg: Config
    params: ParamLayout
    state: StateLayout
    batch: BatchShape
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    options: StepOptions

    @classmethod
    def create(cls, cfg: Config, devices: list[jax.Device] | None = None,
               processes_per_node: int = 1) -> Setup:
        """`devices` defaults to all of them; tests pass a subset to compare meshes."""
        devices = devices if devices is not None else jax.devices()
        shape = mesh_lib.parse(cfg.model.mesh_shape, len(devices))
        t = cfg.training
        stages.check_layers(cfg.model, shape.pp, t.pipeline_repeats)
        mesh = mesh_lib.create_mesh(shape, devices, processes_per_node)
        params = ParamLayout.create(cfg.model, mesh, t.zero_stage, t.remat, t.mixed_precision,
                                    t.pipeline_repeats)
        updates = config_lib.optimizer_steps(cfg)
        optimizer = optim.adamw(cfg.optimizer, updates)
        batch = batch_shape(cfg.training, cfg.data.seq_len, shape.fsdp)
        if t.offload_optimizer:
            _check_host_memory(devices)
        state = StateLayout.create(params, optimizer, t.offload_optimizer)
        return cls(cfg, params, state, batch, optimizer,
                   optim.schedule(cfg.optimizer, updates), step_options(cfg, params, batch))

    @property
    def mesh(self) -> Mesh:
        return self.params.mesh

    @property
    def batch_sharding(self) -> NamedSharding:
        """[accumulation, rows, seq_len] batches: rows over the data axis."""
        return sharding.batch_sharding(self.mesh, dict(self.params.rules.params), leading=1)

    @property
    def tokens_per_step(self) -> int:
        return self.batch.sequences * self.batch.seq_len

    def train_step(self, loss_fn: LossFn = loss_sums) -> Callable:
        return jit_train_step(self.state, self.optimizer, self.schedule, self.options,
                              self.batch_sharding, loss_fn)

    def compile_train_step(self, loss_fn: LossFn = loss_sums,
                           extra: dict[str, jnp.dtype] | None = None) -> jax.stages.Compiled:
        """The real train step, compiled ahead of time from shapes alone (nothing allocated).
        `extra`: more [accum, rows, seq_len] batch entries the loss reads, by dtype."""
        return self.train_step(loss_fn).lower(self.state.with_shardings(),
                                              self.abstract_batch(extra)).compile()

    def abstract_batch(self, extra: dict[str, jnp.dtype] | None = None
                       ) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes of one global batch (data/pipeline.py's GlobalBatches yields the same)."""
        shape = (self.batch.accum, self.batch.rows, self.batch.seq_len)
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32,
                  "segment_ids": jnp.int32, "positions": jnp.int32, **(extra or {})}
        return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
                for name, dtype in dtypes.items()}

    def random_batch(self, seed: int = 0) -> pipeline.Batch:
        """One global batch of random tokens, unpacked (benchmarks without the data pipeline)."""
        shape = (self.batch.accum, self.batch.rows, self.batch.seq_len + 1)
        tokens = np.random.default_rng(seed).integers(3, self.cfg.model.vocab_size, shape,
                                                      np.int32)
        return jax.device_put({"inputs": tokens[..., :-1], "targets": tokens[..., 1:],
                               "weights": np.ones(tokens[..., 1:].shape, np.float32)},
                              self.batch_sharding)

    def evaluator(self, batches: list[pipeline.Batch]) -> Callable[[Any], float]:
        """params → mean loss per token over the given (held-out) batches."""
        eval_step = jit_eval_step(self.state, self.options, self.batch_sharding)

        def evaluate(params) -> float:
            sums = jax.device_get([eval_step(params, batch) for batch in batches])
            loss, tokens = (sum(float(pair[k]) for pair in sums) for k in (0, 1))
            return loss / max(tokens, 1.0)

        return evaluate

    def open_data(self) -> pipeline.Data:
        cfg = self.cfg
        return pipeline.open_data(cfg.data, cfg.model, cfg.training.seed, self.batch,
                                  self.batch_sharding)

    def fresh_state(self) -> TrainState:
        """Step 0: `model.init_from`'s weights or a random initialisation, a fresh optimizer."""
        return self.state.around(self.params.initial_params(self.cfg.training.seed),
                                 self.optimizer)

    def initial_state(self, run_dir: Path, data: pipeline.GlobalBatches) -> TrainState:
        """A restarted run's own checkpoints > checkpoint.resume_from > init_params_from >
        a fresh state. A restore also puts the data iterator where the checkpoint left it."""
        cfg = self.cfg.checkpoint
        own = checkpoint.own_checkpoints(run_dir)
        if own and cfg.resume_from:
            log.warning("%s has checkpoints: continuing this run; checkpoint.resume_from is "
                        "ignored", run_dir)
        if own or cfg.resume_from:
            restored = checkpoint.restore(own or cfg.resume_from, self.state.with_shardings(),
                                          config_lib.to_dict(self.cfg),
                                          set_aside_in=run_dir if own else None)
            data.set_state(restored.data_state)
            log.info("resuming from step %d (%s)", restored.step, restored.path)
            return restored.state
        if cfg.init_params_from:
            params = checkpoint.load_params(cfg.init_params_from, self.params.abstract,
                                            self.params.shardings,
                                            config_lib.to_dict(self.cfg))
            log.info("parameters from %s; step and optimizer state start afresh",
                     cfg.init_params_from)
            return self.state.around(params, self.optimizer)
        return self.fresh_state()

    def analyse(self, compiled: jax.stages.Compiled) -> costs.StepCosts:
        """What the compiled step costs per device: memory, FLOPs, communication."""
        shardings, abstract = self.state.shardings, self.state.abstract
        model_state = {
            "params": costs.sharded_bytes(abstract["params"], shardings["params"]),
            "grads": costs.sharded_bytes(abstract["params"], self.params.grad_shardings,
                                         jnp.float32),
            "optimizer": costs.sharded_bytes(abstract["opt_state"], shardings["opt_state"]),
            "optimizer_host": costs.sharded_bytes(abstract["opt_state"], shardings["opt_state"],
                                                  memory_kind=HOST),
        }
        plan = self.options.pipeline
        split = None if plan is None else stages.Stages.of(
            families.layout(self.cfg.model), plan.stages, plan.repeats)
        return costs.analyse(compiled, self.options.sync, abstract["params"], model_state, split)


def _check_host_memory(devices: list[jax.Device]) -> None:
    lacking = [d for d in devices if HOST not in {m.kind for m in d.addressable_memories()}]
    if lacking:
        raise ConfigError(
            f"training.offload_optimizer=true needs pinned host memory, which {lacking[0]} "
            f"({lacking[0].platform}) does not offer; set training.offload_optimizer=false.")


def step_options(cfg: Config, params: ParamLayout, batch: BatchShape) -> StepOptions:
    """The train step's static choices: dtypes, the gradient sync, the head's vocabulary chunks."""
    dtype = params.compute_dtype
    specs = lambda shardings: jax.tree.map(lambda s: s.spec, shardings)  # noqa: E731
    sync = fsdp.GradientSync(
        mesh=params.mesh, param_specs=specs(params.shardings),
        grad_specs=specs(params.grad_shardings), stacked=params.stacked,
        accumulation_steps=batch.accum, sync_every=cfg.training.sync_gradients_every,
        compute_dtype=dtype, reduce_dtype=reduce_dtype(cfg.training.grad_reduce_dtype, dtype),
    )
    shards = sharding.vocab_shards(params.rules.params, params.mesh)
    chunks = VocabChunks(sharding.vocab_chunks(cfg.model.vocab_size, shards,
                                               cfg.training.loss_vocab_chunk), shards)
    pp = sync.pp
    plan = None if pp == 1 else stages.schedule(pp, batch.rows // sync.fsdp,
                                                cfg.training.pipeline_microbatches,
                                                cfg.training.pipeline_repeats)
    return StepOptions(compute_dtype=dtype, sync=sync, mesh=params.mesh,
                       rules=params.rules.params, vocab_chunks=chunks, pipeline=plan)


def batch_shape(training: TrainingConfig, seq_len: int, fsdp_size: int) -> BatchShape:
    """micro_batch_size × fsdp × accumulation = global batch (sequences per optimizer step)."""
    accum, micro, total = (training.gradient_accumulation_steps, training.micro_batch_size,
                           training.global_batch_size)
    if total is None:
        micro = micro or config_lib.DEFAULT_MICRO_BATCH_SIZE
    elif micro is not None and micro * fsdp_size * accum != total:
        raise ConfigError(
            f"training.global_batch_size={total} but training.micro_batch_size={micro} × fsdp="
            f"{fsdp_size} × gradient_accumulation_steps={accum} = {micro * fsdp_size * accum}; "
            f"set only one of the two batch keys.")
    elif total % (fsdp_size * accum):
        raise ConfigError(
            f"training.global_batch_size={total} does not divide over fsdp={fsdp_size} × "
            f"gradient_accumulation_steps={accum}; use a multiple of {fsdp_size * accum}.")
    else:
        micro = total // (fsdp_size * accum)
    return BatchShape(accum=accum, rows=micro * fsdp_size, seq_len=seq_len)


def reduce_dtype(grad_reduce_dtype: str, compute: jnp.dtype) -> jnp.dtype:
    """`training.grad_reduce_dtype`: auto = the compute dtype (bf16 under mixed precision)."""
    return compute if grad_reduce_dtype == "auto" else jnp.float32
