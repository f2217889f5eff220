"""What one compiled train step costs per device: memory, FLOPs and communication.

Every run reads it off its own compiled step at start-up, and the planner
(`python -m tunix_train.plan`) off a step compiled for simulated devices: the same numbers from
the same program. This module only reads; compiling is the run's setup (training/setup.py) and
writing the report the metrics module's (training/metrics.py).

`total` is XLA's own figure for the step: arguments + outputs not aliased to them +
temporaries. Beside it, the model state follows the ZeRO paper's accounting from the shardings
themselves: fp32 parameters (4 bytes each), fp32 gradients (4) and Adam's two fp32 moments (8)
per parameter, each divided by the devices it is sharded over. Gradients are not part of the
train state: they live in XLA's temporaries during the step, with the activations, and with
`training.sync_gradients_every` > 1 with a whole unreduced gradient buffer (parallel/fsdp.py).

With `training.offload_optimizer` the moments (with `training.offload_params` the parameters) are
in host memory: `host` is what XLA's compiled program keeps there (its entry layout's host
memory space), and `total` is device memory only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from tunix_train.analysis import comm_report, hlo
from tunix_train.analysis.comm_report import CommReport
from tunix_train.models import quantization
from tunix_train.parallel import fsdp, stages
from tunix_train.parallel.mesh import EP

UNITS = {"MB": 1e6, "GB": 1e9}


@dataclass
class StepCosts:
    per_device_bytes: dict[str, int]  # params(_host), frozen (LoRA's base), grads,
    # optimizer(_host), grad_buffer, temp, total (device memory), host (host memory)
    xla_memory: dict[str, int]  # compiled.memory_analysis(): arguments, outputs, aliased, temp
    flops_per_step: float  # all devices, as compiled (remat recomputation included)
    comm: CommReport
    module: hlo.Module  # the compiled program, parsed
    sync: fsdp.GradientSync
    reference: str = ""  # post-training's reference model: what it holds (training/reference.py)

    def memory_lines(self, unit: str = "MB") -> list[str]:
        f = {k: f"{v / UNITS[unit]:,.{1 if unit == 'MB' else 2}f} {unit}"
             for k, v in {**self.xla_memory, **self.per_device_bytes}.items()}
        buffer = (f"; also there: a {f['grad_buffer']} unreduced gradient buffer"
                  if self.per_device_bytes["grad_buffer"] else "")
        host = self.per_device_bytes["host"]
        frozen = (f", frozen base {f['frozen']} (LoRA: the adapters are the params)"
                  if self.per_device_bytes.get("frozen") else "")
        lines = [
            f"memory per device (compiled step), from XLA: arguments {f['arguments']} + outputs "
            f"{f['outputs']} - donated {f['aliased']} + temporaries {f['temp']}"
            + (f" + reference model {f['reference']}" if self.per_device_bytes.get("reference")
               else "") + f" = {f['total']}"
            + (f" on the device, {f['host']} in host memory" if host else ""),
            f"  model state: params {f['params']} and optimizer {f['optimizer']}{frozen} "
            f"(arguments{', where not offloaded' if host else ''}), grads {f['grads']} "
            f"(temporaries, with the activations{buffer})",
        ]
        if self.reference:
            lines.append(f"  {self.reference}")
        if self.per_device_bytes.get("params_host"):
            lines.append(f"  offloaded: {f['params_host']} of parameters live in pinned host "
                         f"memory, each layer copied to the device when reached, updated a layer "
                         f"at a time")
        if self.per_device_bytes["optimizer_host"]:
            lines.append(f"  offloaded: {f['optimizer_host']} of the optimizer state lives in "
                         f"pinned host memory and streams through the update")
        return lines

    def sync_line(self) -> str:
        sync = self.sync
        if sync.data_ranks * sync.cp == 1:
            return "gradient sync: none (fsdp=1: every device sees the whole batch)"
        over = " × ".join(sync.data_group)  # fsdp, or fsdp × cp: the devices with other tokens
        if sync.ep > 1:  # an expert's gradient has no copy on the other ep devices
            over += " (the experts' over " + " × ".join(a for a in sync.data_group
                                                          if a != EP) + ")"
        kind = "reduce-scatter" if sync.scatters else "all-reduce"
        dtype = jnp.dtype(sync.reduce_dtype).name
        measured = self.comm.gradient_reductions_per_step
        if sync.sync_every == 1 and sync.pp > 1:
            done = {"reduce-scatter": "reduce-scattered", "all-reduce": "all-reduced"}[kind]
            return (f"gradient sync: a pipeline stage's layers are {done} once per micro-step "
                    f"after the pipeline's backward pass over fsdp, the layers every stage uses "
                    f"layer by layer over fsdp and pp, in {dtype} = "
                    f"{sync.reductions_per_step} full reduction(s) per step (measured: "
                    f"{measured:g})")
        if sync.sync_every == 1:
            return (f"gradient sync: each layer's gradient {kind} over {over} inside the backward "
                    f"pass, in {dtype}, every micro-step = {sync.reductions_per_step} full "
                    f"reduction(s) per step (measured: {measured:g})")
        return (
            f"gradient sync: every {sync.sync_every} micro-step(s) = {sync.reductions_per_step} "
            f"{kind}(s) over {over} per step, in {dtype} (measured: {measured:g}); fewer "
            f"reductions cost a local unreduced gradient buffer: "
            f"{self.per_device_bytes['grad_buffer'] / UNITS['MB']:,.1f} MB per device incl. its fp32 "
            f"accumulator"
        )


def analyse(compiled: jax.stages.Compiled, sync: fsdp.GradientSync, abstract_params: Any,
            model_state: dict[str, int], split: stages.Stages | None = None) -> StepCosts:
    """`model_state`: per-device bytes of params, grads and optimizer (see `sharded_bytes`);
    `split`: how the blocks split into pipeline stages (None without pp)."""
    text = compiled.as_text()
    xla = _device_and_host(compiled.memory_analysis(), text)
    per_device = {
        **model_state,
        "grad_buffer": gradient_buffer_bytes(sync, abstract_params),
        "temp": xla["temp"],
        "total": xla["arguments"] + xla["outputs"] - xla["aliased"] + xla["temp"],
        "host": xla["host_arguments"] + xla["host_outputs"] - xla["host_aliased"],
    }
    module = hlo.parse(text)
    reduction = stages.reduced_gradient_bytes(sync, abstract_params, sync.reduce_dtype, split)
    comm = comm_report.from_hlo(module, sync.mesh, gradient_bytes=reduction)
    return StepCosts(per_device, xla, hlo.flops(module) * sync.mesh.devices.size, comm, module,
                     sync)


def _device_and_host(memory: Any, hlo_text: str) -> dict[str, int]:
    """memory_analysis() split into device and host memory. Backends with host memory spaces
    report it apart; a CPU backend counts both as one, so the host part is read off the
    program's entry layout and taken out (donated host arguments alias their outputs)."""
    xla = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
           "aliased": memory.alias_size_in_bytes, "temp": memory.temp_size_in_bytes,
           "host_arguments": memory.host_argument_size_in_bytes,
           "host_outputs": memory.host_output_size_in_bytes,
           "host_aliased": memory.host_alias_size_in_bytes}
    if xla["host_arguments"] or xla["host_outputs"]:
        return xla
    arguments, outputs = (int(b) for b in hlo.host_bytes(hlo_text))
    aliased = min(arguments, outputs)
    xla.update(host_arguments=arguments, host_outputs=outputs, host_aliased=aliased,
               arguments=xla["arguments"] - arguments, outputs=xla["outputs"] - outputs,
               aliased=xla["aliased"] - aliased)
    return xla


def sharded_bytes(abstract: Any, shardings: Any, dtype: Any = None,
                  memory_kind: str | None = None) -> int:
    """Bytes one device holds of a tree of shapes laid out by `shardings` (even shards); only
    those in `memory_kind` if given."""
    sizes = jax.tree.map(
        lambda a, s: math.prod(s.shard_shape(a.shape)) * quantization.itemsize(dtype or a.dtype)
        if memory_kind in (None, s.memory_kind) else 0, abstract, shardings)
    return int(sum(jax.tree.leaves(sizes)))


def gradient_buffer_bytes(sync: fsdp.GradientSync, abstract_params: Any) -> int:
    """With reductions spaced out over several micro-steps (sync_every > 1): the whole local
    unreduced gradient (compute dtype) and its fp32 accumulator. None otherwise: each layer's
    gradient is reduced where the backward pass produces it."""
    if sync.reduces_per_layer:
        return 0
    return (fsdp.local_gradient_bytes(sync, abstract_params, sync.compute_dtype)
            + fsdp.local_gradient_bytes(sync, abstract_params, jnp.float32))
