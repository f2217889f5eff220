"""What one compiled train step costs per device: memory, FLOPs and communication.

Used at start-up by every run and by the planner (`python -m tunix_train.plan`), so both read
the same numbers off the same compiled program. The step is compiled from abstract shapes
(`jax.ShapeDtypeStruct`s carrying their shardings): nothing is allocated.

`total` is XLA's own figure for the step: arguments + outputs not aliased to them +
temporaries. Beside it, the model state follows the ZeRO paper's accounting from the shardings
themselves: fp32 parameters (4 bytes each), fp32 gradients (4) and Adam's two fp32 moments (8)
per parameter, each divided by the devices it is sharded over. Gradients are not part of the
train state: they live in XLA's temporaries during the step, with the activations, and with
`training.sync_gradients_every` > 1 with a whole unreduced gradient buffer (see fsdp.py).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from tunix_train.analysis import comm_report
from tunix_train.parallel import fsdp
from tunix_train.analysis import hlo
from tunix_train.analysis.comm_report import CommReport
from tunix_train.training.train_step import jit_train_step

if TYPE_CHECKING:
    from tunix_train.training.run import Setup

MB = 1e6
log = logging.getLogger("tunix_train")


@dataclass
class StepAnalysis:
    per_device_bytes: dict[str, int]  # params, grads, optimizer, grad_buffer, temp, total
    xla_memory: dict[str, int]  # compiled.memory_analysis(): arguments, outputs, aliased, temp
    flops_per_step: float  # all devices, as compiled (remat recomputation included)
    comm: CommReport
    module: hlo.Module  # the compiled program, parsed


def abstract_batch(setup: Setup, batch_sharding: NamedSharding) -> dict[str, Any]:
    """The shapes of one global batch (data/pipeline.py's GlobalBatches yields the same)."""
    b = setup.batch
    shape = (b.accum, b.rows, b.seq_len)
    return {
        "inputs": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding),
        "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding),
        "weights": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=batch_sharding),
        "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding),
        "positions": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding),
    }


def abstract_state(setup: Setup) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        setup.spec.abstract, setup.spec.shardings)


def compile_step(setup: Setup, batch_sharding: NamedSharding,
                 batch: dict[str, Any] | None = None) -> jax.stages.Compiled:
    """The real train step, lowered and compiled ahead of time from shapes alone."""
    step = jit_train_step(setup.spec, setup.optimizer, setup.schedule, setup.options,
                          batch_sharding)
    batch = batch if batch is not None else abstract_batch(setup, batch_sharding)
    return step.lower(abstract_state(setup), batch).compile()


def sharded_bytes(abstract: Any, shardings: Any, dtype: Any = None) -> int:
    """Bytes one device holds of a tree of shapes laid out by `shardings` (even shards)."""
    sizes = jax.tree.map(
        lambda a, s: math.prod(s.shard_shape(a.shape)) * jnp.dtype(dtype or a.dtype).itemsize,
        abstract, shardings)
    return sum(jax.tree.leaves(sizes))


def gradient_buffer_bytes(setup: Setup) -> int:
    """With reductions spaced out over several micro-steps (sync_every > 1): the whole local
    unreduced gradient (compute dtype) and its fp32 accumulator. None otherwise: each layer's
    gradient is reduced where the backward pass produces it."""
    plan, params = setup.options.gradients, setup.spec.abstract["params"]
    if plan.sync_every == 1:
        return 0
    return (fsdp.local_gradient_bytes(plan, params, setup.options.compute_dtype)
            + fsdp.local_gradient_bytes(plan, params, jnp.float32))


def analyse(setup: Setup, compiled: jax.stages.Compiled) -> StepAnalysis:
    spec, plan = setup.spec, setup.options.gradients
    memory = compiled.memory_analysis()
    xla = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
           "aliased": memory.alias_size_in_bytes, "temp": memory.temp_size_in_bytes}
    per_device = {
        "params": sharded_bytes(spec.abstract["params"], spec.shardings["params"]),
        "grads": sharded_bytes(spec.abstract["params"], spec.grad_shardings, jnp.float32),
        "optimizer": sharded_bytes(spec.abstract["opt_state"], spec.shardings["opt_state"]),
        "grad_buffer": gradient_buffer_bytes(setup),
        "temp": xla["temp"],
        "total": xla["arguments"] + xla["outputs"] - xla["aliased"] + xla["temp"],
    }
    module = hlo.parse(compiled.as_text())
    reduction = fsdp.local_gradient_bytes(plan, spec.abstract["params"], plan.reduce_dtype)
    comm = comm_report.build(module, setup.mesh, gradient_bytes=reduction)
    return StepAnalysis(per_device, xla, hlo.flops(module) * setup.mesh.devices.size, comm,
                        module)


def memory_lines(analysis: StepAnalysis) -> list[str]:
    b = {k: v / MB for k, v in analysis.per_device_bytes.items()}
    x = {k: v / MB for k, v in analysis.xla_memory.items()}
    buffer = (f"; also there: a {b['grad_buffer']:,.1f} MB unreduced gradient buffer"
              if b["grad_buffer"] else "")
    return [
        f"memory per device (compiled step), from XLA: arguments {x['arguments']:,.1f} MB + outputs "
        f"{x['outputs']:,.1f} MB - donated {x['aliased']:,.1f} MB + temporaries "
        f"{x['temp']:,.1f} MB = {b['total']:,.1f} MB",
        f"  model state: params {b['params']:,.1f} MB and optimizer {b['optimizer']:,.1f} MB "
        f"(arguments), grads {b['grads']:,.1f} MB (temporaries, with the activations{buffer})",
    ]


def _warn_if_too_big(needed: int) -> None:
    """Before the first step: the compiled step against what JAX may allocate (GPUs report it)."""
    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit and needed > limit:
        log.warning(
            "the step needs %.1f GB per device but JAX may use %.1f GB of this %s: expect an "
            "out-of-memory error; lower training.micro_batch_size, set training.remat=full, add "
            "fsdp devices, or raise XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's default is 0.75).",
            needed / 1e9, limit / 1e9, device.device_kind)


def sync_line(setup: Setup, analysis: StepAnalysis) -> str:
    plan = setup.options.gradients
    if plan.fsdp == 1:
        return "gradient sync: none (fsdp=1: every device sees the whole batch)"
    kind = "reduce-scatter" if setup.cfg.training.zero_stage >= 2 else "all-reduce"
    dtype = jnp.dtype(plan.reduce_dtype).name
    measured = analysis.comm.gradient_reductions_per_step
    if plan.sync_every == 1:
        return (f"gradient sync: each layer's gradient {kind} over fsdp inside the backward pass, "
                f"in {dtype}, every micro-step = {plan.reductions_per_step} full reduction(s) "
                f"per step (measured: {measured:g})")
    return (
        f"gradient sync: every {plan.sync_every} micro-step(s) = {plan.reductions_per_step} "
        f"{kind}(s) over fsdp per step, in {dtype} (measured: {measured:g}); fewer reductions "
        f"cost a local unreduced gradient buffer: "
        f"{analysis.per_device_bytes['grad_buffer'] / MB:,.1f} MB per device incl. its fp32 "
        f"accumulator"
    )


def report(setup: Setup, analysis: StepAnalysis, writer: Any, run_dir: Path) -> None:
    """Start-up log lines, `comm_report.json` and TensorBoard text (process 0 writes files)."""
    memory = memory_lines(analysis)
    lines = [*memory, sync_line(setup, analysis),
             f"FLOPs per step (all devices, as compiled): {analysis.flops_per_step:.3e}",
             "communication per step, per device:", *analysis.comm.table().splitlines()]
    for line in lines:
        log.info(line)
    _warn_if_too_big(analysis.per_device_bytes["total"])
    writer.text("memory", "\n".join(memory))
    writer.text("communication", "\n".join(lines[len(memory):]))
    if jax.process_index() == 0:
        record = {"mesh": {k: int(v) for k, v in setup.mesh.shape.items()},
                  **analysis.comm.to_json()}
        (run_dir / "comm_report.json").write_text(json.dumps(record, indent=1))
