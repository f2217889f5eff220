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
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from tunix_train import backend
from tunix_train import checkpoint, checkpoint_fit
from tunix_train import config as config_lib
from tunix_train import starting_weights, trainers
from tunix_train.analysis import costs
from tunix_train.config import Config, ConfigError, TrainingConfig
from tunix_train.data import pipeline
from tunix_train.data.pipeline import BatchShape
from tunix_train.models import attention, families, quantization
from tunix_train.models.head import VocabChunks
from tunix_train.parallel import distributed, fsdp, sharding
from tunix_train.parallel import stages
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.parallel.layout import ParamLayout
from tunix_train.parallel.waiting import Waiting
from tunix_train.training import experts, offload, optim, reference
from tunix_train.training.state import FROZEN, HOST, StateLayout, TrainState
from tunix_train.training.train_step import (LossFn, StepOptions, jit_eval_step, jit_train_step,
                                             loss_sums)

log = logging.getLogger("tunix_train")


# A restore still running after this many seconds says so, then every 30 s.
RESTORE_SAID_AFTER_S, RESTORE_SAID_EVERY_S = 10.0, 30.0


def _restoring(source: str | Path) -> Waiting:
    """Around a restore: reading a large checkpoint takes minutes, and in a job of several
    processes each waits inside it (Orbax's barriers, checkpoint_damage's outcome gather) for
    the others to finish theirs; said, not bounded, since processes may legitimately reach
    or finish it minutes apart. Signals stay as they are (after joining, SIGTERM is JAX's
    preemption notifier's)."""
    together = "" if jax.process_count() == 1 else (
        ": each process reads its own shards, and the processes of the job finish it together")
    return Waiting(f"the restore from {source} to finish{together}", None, 0,
                   every_s=RESTORE_SAID_EVERY_S, first_s=RESTORE_SAID_AFTER_S, signals=False)


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
        experts.check_mesh(cfg, shape)
        offload.check_supported(cfg, shape.pp)
        mesh = mesh_lib.create_mesh(shape, devices, processes_per_node)
        params = ParamLayout.create(cfg.model, mesh, t.zero_stage, t.remat, t.mixed_precision,
                                    t.pipeline_repeats, cfg.lora)
        updates = trainers.optimizer_steps(cfg)
        # Parameters in host memory are updated a layer at a time: the clip is taken outside.
        optimizer = optim.adamw(cfg.optimizer, updates, clipped_outside=t.offload_params)
        batch = batch_shape(cfg.training, cfg.data.seq_len, shape.data_ranks,
                            " × ".join(mesh_lib.DATA_AXES[:1 if shape.ep == 1 else 2]))
        for key in ("offload_optimizer", "offload_params"):
            if getattr(t, key):
                _check_host_memory(devices, key)
        state = StateLayout.create(params, optimizer, t.offload_optimizer, t.offload_params)
        options = step_options(cfg, params, batch)
        if t.offload_params:
            options = replace(options, streamed=offload.StreamedUpdate(
                optimizer, cfg.optimizer.grad_clip, params.stacked))
        return cls(cfg, params, state, batch, optimizer,
                   optim.schedule(cfg.optimizer, updates), options)

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
                           extra: dict[str, jnp.dtype] | None = None,
                           compiler_options: dict[str, str] | None = None
                           ) -> jax.stages.Compiled:
        """The real train step, compiled ahead of time from shapes alone (nothing allocated).
        `extra`: more [accum, rows, seq_len] batch entries the loss reads, by dtype;
        `compiler_options`: XLA's, for this compile (the planner's). Says that it compiles and
        how long it took: seconds to minutes of silence otherwise."""
        start = time.perf_counter()
        log.info("compiling the train step (%s tokens per step on %s) …",
                 f"{self.tokens_per_step:,}", " × ".join(f"{k}={v}" for k, v in
                                                        self.mesh.shape.items()))
        def compile_() -> jax.stages.Compiled:  # a fresh trace each time
            return self.train_step(loss_fn).lower(
                self.state.with_shardings(), self.abstract_batch(extra)).compile(compiler_options)

        try:
            compiled = compile_()
        except Exception as error:  # noqa: BLE001 - only cuDNN's is handled, the rest re-raised
            if not attention.fall_back_from_cudnn(error, self.cfg.model.attention_impl):
                raise
            compiled = compile_()
        log.info("compiled the train step in %.1f s", time.perf_counter() - start)
        return compiled

    def runnable(self, compiled: jax.stages.Compiled, loss_fn: LossFn = loss_sums) -> Callable:
        """What the loop calls: `compiled`, except on the CPU with a 4-bit base (QLoRA's nf4).
        There XLA's client creates 4-bit arrays unpacked, while an executable compiled ahead
        of time asks for them packed and refuses them (jax 0.10); the jitted step, compiled
        again from the same function on its first call, takes them."""
        four_bit = any(quantization.itemsize(leaf.dtype) < 1
                       for leaf in jax.tree.leaves(self.state.abstract.get(FROZEN, {})))
        if four_bit and backend.is_cpu():
            return self.train_step(loss_fn)
        return compiled

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

    def evaluator(self, batches: list[pipeline.Batch]) -> Callable[[TrainState], float]:
        """train state → mean loss per token over the given (held-out) batches."""
        summed = self.eval_sums(batches)

        def evaluate(state: TrainState) -> float:
            sums = summed(state)
            return sums["loss"] / max(sums["tokens"], 1.0)

        return evaluate

    def eval_sums(self, batches: list[pipeline.Batch], loss_fn: LossFn = loss_sums
                  ) -> Callable[[TrainState], dict[str, float]]:
        """train state → `loss_fn`'s sums ("loss", "tokens", …) over the given batches."""
        eval_step = distributed.first_run_together(
            jit_eval_step(self.state, self.options, self.batch_sharding, loss_fn),
            "the evaluation step", self.cfg.distributed.init_timeout_s)

        def summed(state: TrainState) -> dict[str, float]:
            params = self.state.model_params(state)
            results = jax.device_get([eval_step(params, batch) for batch in batches])
            total: dict[str, float] = {}
            for loss, sums in results:
                for key, value in {"loss": loss, **sums}.items():
                    total[key] = total.get(key, 0.0) + float(value)
            return total

        return summed

    def open_data(self) -> pipeline.Data:
        cfg = self.cfg
        return pipeline.open_data(cfg.data, cfg.model, cfg.training.seed, self.batch,
                                  self.batch_sharding)

    def fresh_state(self) -> TrainState:
        """Step 0: `model.init_from`'s weights or a random initialisation, a fresh optimizer."""
        seed = self.cfg.training.seed
        if self.params.frozen is not None:
            return self.state.around(starting_weights.initial_adapters(self.params, seed),
                                     self.optimizer, self.base())
        return self.state.around(starting_weights.initial_params(self.params, seed),
                                 self.optimizer)

    def initial_state(self, run_dir: Path, data: pipeline.GlobalBatches) -> TrainState:
        """A restarted run's own checkpoints > checkpoint.resume_from > init_params_from >
        a fresh state. A restore also puts the data iterator where the checkpoint left it.
        With LoRA the base is rebuilt from its source first, and a checkpoint whose base was
        another is refused by name."""
        cfg = self.cfg.checkpoint
        own = checkpoint.own_checkpoints(run_dir)
        if own and cfg.resume_from:
            log.warning("%s has checkpoints: continuing this run; checkpoint.resume_from is "
                        "ignored", run_dir)
        frozen = self.base() if self.params.frozen is not None else None
        if own or cfg.resume_from:
            with _restoring(own or cfg.resume_from):
                restored = checkpoint.restore(own or cfg.resume_from,
                                              self.state.saved_target(),
                                              self.saved_config(frozen),
                                              set_aside_in=run_dir if own else None)
            data.set_state(restored.data_state)
            log.info("resuming from step %d (%s)", restored.step, restored.path)
            return restored.state if frozen is None else {**restored.state, FROZEN: frozen}
        if cfg.init_params_from and frozen is None:
            params = starting_weights.run_params(self.params, cfg.init_params_from,
                                                config_lib.to_dict(self.cfg))
            log.info("parameters from %s; step and optimizer state start afresh",
                     cfg.init_params_from)
            return self.state.around(params, self.optimizer)
        if frozen is not None:
            adapters = starting_weights.initial_adapters(self.params, self.cfg.training.seed)
            return self.state.around(adapters, self.optimizer, frozen)
        return self.fresh_state()

    def base(self) -> Any:
        """LoRA's frozen base, from its source (starting_weights.base), where the state keeps
        it (in host memory with training.offload_params)."""
        base = starting_weights.base(self.params, self.cfg.training.seed,
                                     self.cfg.checkpoint.init_params_from)
        return jax.device_put(base, self.state.shardings[FROZEN]) \
            if self.state.params_offloaded else base

    def saved_config(self, frozen: Any = None) -> dict:
        """The config a checkpoint records; with LoRA, also which base its adapters adapt
        (its source and a fingerprint of its values), which a restore must find again."""
        saved = config_lib.to_dict(self.cfg)
        if frozen is not None:
            c = self.cfg
            source = c.checkpoint.init_params_from or c.model.init_from or \
                f"random (training.seed={c.training.seed})"
            saved[checkpoint_fit.LORA_BASE] = {"source": source, "fingerprint": fingerprint(frozen)}
        return saved

    def lora_line(self) -> str:
        """LoRA's start-up line (training's and the planner's): the adapters, the base they sit
        on, and what the frozen base takes in all and on the busiest device, from the state's
        shapes and shardings (no arrays needed)."""
        lora, abstract = self.cfg.lora, self.state.abstract
        count = sum(x.size for x in jax.tree.leaves(abstract["params"]))
        base = sum(x.size for x in jax.tree.leaves(self.params.base_abstract()))
        frozen = abstract.get(FROZEN, {})
        total = sum(x.size * quantization.itemsize(x.dtype) for x in jax.tree.leaves(frozen))
        per_device = costs.sharded_bytes(frozen, self.state.shardings.get(FROZEN, {}))
        compute = jnp.dtype(self.options.compute_dtype).name
        storage = compute if lora.base_quantization == "none" else (
            f"{lora.base_quantization} (blocks of 64, projections; the rest {compute})")
        return (f"LoRA: rank {lora.rank}, alpha {lora.alpha:g} on "
                f"{', '.join(lora.target_names())}: {count:,} trainable parameters "
                f"({100 * count / base:.2f}% of the base's {base:,}); frozen base {storage} "
                f"{total / 1e6:.1f} MB, per device {per_device / 1e6:.1f} MB")

    def analyse(self, compiled: jax.stages.Compiled) -> costs.StepCosts:
        """What the compiled step costs per device: memory, FLOPs, communication."""
        shardings, abstract = self.state.shardings, self.state.abstract
        model_state = {
            "params": costs.sharded_bytes(abstract["params"], shardings["params"]),
            "frozen": costs.sharded_bytes(abstract.get(FROZEN, {}), shardings.get(FROZEN, {})),
            "grads": costs.sharded_bytes(abstract["params"], self.params.grad_shardings,
                                         jnp.float32),
            "optimizer": costs.sharded_bytes(abstract["opt_state"], shardings["opt_state"]),
            "optimizer_host": costs.sharded_bytes(abstract["opt_state"], shardings["opt_state"],
                                                  memory_kind=HOST),
            "params_host": costs.sharded_bytes(
                {"params": abstract["params"], "frozen": abstract.get(FROZEN, {})},
                {"params": shardings["params"], "frozen": shardings.get(FROZEN, {})},
                memory_kind=HOST),
        }
        plan = self.options.pipeline
        split = None if plan is None else stages.Stages.of(
            families.stacking(self.cfg.model), plan.stages, plan.repeats)
        found = costs.analyse(compiled, self.options.sync, abstract["params"], model_state, split)
        held, found.reference = reference.memory(self)
        found.per_device_bytes["reference"] = held
        found.per_device_bytes["total"] += held
        return found


def fingerprint(frozen: Any) -> str:
    """A short digest of a base's values: the sum of their magnitudes, to 6 digits (summed in
    another order on another mesh, it reads the same)."""
    total = jax.jit(lambda tree: sum(jnp.sum(jnp.abs(sharding.to_device(x).astype(jnp.float32)))
                                     for x in jax.tree.leaves(tree)))(frozen)
    return f"{float(total):.6g}"


def _check_host_memory(devices: list[jax.Device], key: str = "offload_optimizer") -> None:
    lacking = [d for d in devices if HOST not in {m.kind for m in d.addressable_memories()}]
    if lacking:
        raise ConfigError(
            f"training.{key}=true needs pinned host memory, which {lacking[0]} "
            f"({lacking[0].platform}) does not offer; set training.{key}=false.")


def step_options(cfg: Config, params: ParamLayout, batch: BatchShape) -> StepOptions:
    """The train step's static choices: dtypes, the gradient sync, the head's vocabulary chunks."""
    dtype = params.compute_dtype
    specs = lambda shardings: jax.tree.map(lambda s: s.spec, shardings)  # noqa: E731
    frozen = params.frozen
    sync = fsdp.GradientSync(
        mesh=params.mesh, param_specs=specs(params.shardings),
        grad_specs=specs(params.grad_shardings), stacked=params.stacked,
        accumulation_steps=batch.accum, sync_every=cfg.training.sync_gradients_every,
        compute_dtype=dtype, reduce_dtype=reduce_dtype(cfg.training.grad_reduce_dtype, dtype),
        frozen_specs=None if frozen is None else specs(frozen.shardings),
        frozen_stacked=None if frozen is None else frozen.stacked,
    )
    shards = sharding.vocab_shards(params.rules.params, params.mesh)
    chunks = VocabChunks(sharding.vocab_chunks(cfg.model.vocab_size, shards,
                                               cfg.training.loss_vocab_chunk), shards)
    pp = sync.pp
    plan = None if pp == 1 else stages.schedule(pp, batch.rows // sync.data_ranks,
                                                cfg.training.pipeline_microbatches,
                                                cfg.training.pipeline_repeats)
    lora, t, router = cfg.lora, cfg.training, experts.router_loss_weights(cfg)
    experts.check_router_losses_on_pp(cfg, router, plan)
    return StepOptions(compute_dtype=dtype, sync=sync, mesh=params.mesh,
                       rules=params.rules.params, vocab_chunks=chunks, pipeline=plan,
                       dropout_seed=t.seed if lora.on and lora.dropout else None,
                       router=router)


def batch_shape(training: TrainingConfig, seq_len: int, fsdp_size: int,
                data_axes: str = mesh_lib.FSDP) -> BatchShape:
    """micro_batch_size × fsdp × accumulation = global batch (sequences per optimizer step);
    `fsdp_size`: the devices with rows of their own (`data_axes`: fsdp, or fsdp × ep)."""
    accum, micro, total = (training.gradient_accumulation_steps, training.micro_batch_size,
                           training.global_batch_size)
    if total is None:
        micro = micro or config_lib.DEFAULT_MICRO_BATCH_SIZE
    elif micro is not None and micro * fsdp_size * accum != total:
        raise ConfigError(
            f"training.global_batch_size={total} but training.micro_batch_size={micro} × "
            f"{data_axes}={fsdp_size} × gradient_accumulation_steps={accum} = {micro * fsdp_size * accum}; "
            f"set only one of the two batch keys.")
    elif total % (fsdp_size * accum):
        raise ConfigError(
            f"training.global_batch_size={total} does not divide over {data_axes}={fsdp_size} × "
            f"gradient_accumulation_steps={accum}; use a multiple of {fsdp_size * accum}.")
    else:
        micro = total // (fsdp_size * accum)
    return BatchShape(accum=accum, rows=micro * fsdp_size, seq_len=seq_len)


def reduce_dtype(grad_reduce_dtype: str, compute: jnp.dtype) -> jnp.dtype:
    """`training.grad_reduce_dtype`: auto = the compute dtype (bf16 under mixed precision)."""
    return compute if grad_reduce_dtype == "auto" else jnp.float32
