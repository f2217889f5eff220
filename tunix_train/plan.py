"""`python -m tunix_train.plan <the overrides of run_training.py>`: will it fit, and what will it
communicate — answered on a laptop, from the compiled step itself.

No accelerator and no weights: the planner simulates the mesh's devices on the CPU (it
re-executes itself with `XLA_FLAGS=--xla_force_host_platform_device_count=<mesh size>` and
`JAX_PLATFORMS=cpu` when they are not already set), builds the train state from abstract shapes,
lowers and compiles the real train step, then prints per-device memory, FLOPs and collectives
with a verdict against `plan.device_memory_gb`, and writes `plan.json` into its run dir.

Model-state bytes (params, grads, optimizer) are exact: they follow from the shardings. XLA's
temporaries (activations) come from the CPU compiler's buffer assignment; a GPU compiler fuses
and schedules differently, so read them as an estimate.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from tunix_train import cli, gc_policy, trainers, validation
from tunix_train.config import Config, ConfigError, register_configs

log = logging.getLogger("tunix_train")
register_configs()

_REEXECUTED = "TUNIX_TRAIN_PLAN_REEXECUTED"
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
GB = 1e9


def num_devices(cfg: Config) -> int:
    """Devices to simulate: `plan.num_devices`, else the product of `model.mesh_shape`. Read
    without JAX, which this process imports only after it has re-run itself with them."""
    if cfg.plan.num_devices:
        return cfg.plan.num_devices
    sizes = [int(s) for s in cfg.model.mesh_shape[0]] if cfg.model.mesh_shape else [-1]
    if -1 in sizes:  # (None puts every device on fsdp: [-1, 1])
        raise ConfigError(
            f"model.mesh_shape {sizes} has a -1 the planner cannot fill without devices; give "
            f"every size, or set plan.num_devices."
        )
    return math.prod(sizes)


def ensure_cpu_devices(count: int, run_dir: str) -> None:
    """Re-executes this command with `count` simulated CPU devices unless it already has them.

    JAX reads XLA_FLAGS once, when its backend starts, so the flag cannot be set from inside a
    running process; the re-executed one reuses this run dir.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if f"{_DEVICE_FLAG}={count}" in flags.split() and os.environ.get("JAX_PLATFORMS") == "cpu":
        return
    if os.environ.get(_REEXECUTED):
        raise RuntimeError(f"XLA_FLAGS={flags!r} still lacks {_DEVICE_FLAG}={count}.")
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{_REEXECUTED: "1"})
    others = re.sub(_DEVICE_FLAG + r"=\d+", "", flags)
    env["XLA_FLAGS"] = f"{others} {_DEVICE_FLAG}={count}".strip()
    args = [a for a in sys.argv[1:] if not a.startswith("hydra.run.dir=")]
    os.execve(sys.executable, [sys.executable, "-m", "tunix_train.plan", *args,
                               f"hydra.run.dir={run_dir}"], env)


def plan(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """Compiles the configuration's train step on the available (simulated) devices."""
    from tunix_train.training.setup import Setup

    validation.validate(cfg)
    _as_planned(cfg)
    setup = Setup.create(cfg)
    start = time.perf_counter()
    loss_fn, extra = trainers.task_of(cfg.trainer.name).loss(cfg)  # the trainer's own step
    costs = setup.analyse(setup.compile_train_step(loss_fn, extra, AS_ON_ACCELERATORS))
    return write(run_dir, setup, costs, time.perf_counter() - start)


# The CPU compiler has no bf16 matmul: it widens each bf16 dot's operands to fp32, and its
# loop-invariant code motion then hoists the widening of a whole stack of layer weights out of
# the layer loop, an fp32 copy of every bf16 weight (26 GB for Llama 3.1 8B's LoRA base) that an
# accelerator, which multiplies bf16 as it is, never makes. Without that pass an fp32 step,
# which has nothing to widen, plans the same memory (Llama 3.1 8B: equal to 0.01 GB; a tiny
# model: within 1%, small masks the pass would hoist), tests/test_plan.py.
AS_ON_ACCELERATORS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def _as_planned(cfg: Config) -> None:
    """What a CPU compiles in place of choices made for GPUs."""
    if cfg.training.mixed_precision == "auto":
        cfg.training.mixed_precision = "bf16"  # what "auto" picks on the accelerators planned for
    if cfg.model.attention_impl == "pallas":
        # A CPU would run the kernels through Pallas's interpreter, whose memory is not theirs.
        # The blockwise attention saves the same residuals (output, log-sum-exp) and its
        # backward pass keeps fp32 [B, N, L, H] sums the kernels do not: an upper bound.
        log.info("plan: model.attention_impl=pallas planned as blockwise (the same residuals; "
                 "an upper bound on the kernels' memory)")
        cfg.model.attention_impl = "blockwise"


def write(run_dir: Path, setup, costs, compile_s: float = 0.0) -> dict[str, Any]:
    """Prints the plan of an analysed step and writes it to `run_dir/plan.json`."""
    record = _record(setup, costs, compile_s)
    for line in _summary(record, costs):
        log.info(line)
    (run_dir / "plan.json").write_text(json.dumps(record, indent=1))
    log.info("wrote %s", run_dir / "plan.json")
    return record


def _record(setup, costs, compile_s: float) -> dict[str, Any]:
    import jax.numpy as jnp

    from tunix_train.models import families
    from tunix_train.parallel import mesh as mesh_lib, stages

    cfg, per_device = setup.cfg, costs.per_device_bytes
    return {
        "model": cfg.model.name,
        "mesh": {name: int(size) for name, size in setup.mesh.shape.items()},
        **_parameter_counts(setup),
        "lora": setup.lora_line() if cfg.lora.on else None,
        "experts": families.experts_line(setup.params.model, setup.mesh.shape.get(mesh_lib.EP, 1)),
        "zero_stage": cfg.training.zero_stage,
        "compute_dtype": jnp.dtype(setup.options.compute_dtype).name,
        "sequences_per_step": setup.batch.sequences,
        "tokens_per_step": setup.tokens_per_step,
        "gradient_accumulation_steps": setup.batch.accum,
        "sync_gradients_every": setup.options.sync.sync_every,
        "per_device_bytes": per_device,
        "xla_memory": costs.xla_memory,
        "reference": costs.reference,
        "flops_per_step": costs.flops_per_step,
        "collectives": [c.__dict__ for c in costs.comm.collectives],
        "gradient_reductions_per_step": costs.comm.gradient_reductions_per_step,
        "pipeline": stages.describe(setup.options.pipeline, cfg.model,
                                    setup.batch.rows // setup.options.sync.data_ranks),
        **_fits(cfg, per_device),
        "suggestions": suggestions(cfg, setup.batch.rows // setup.options.sync.data_ranks),
        "compile_seconds": round(compile_s, 1),
    }


def _parameter_counts(setup) -> dict[str, int]:
    """The model's parameters (under LoRA the trainable adapters are "lora_params") and those
    a token uses (fewer in a mixture of experts)."""
    import jax

    from tunix_train.models import families

    lora = setup.cfg.lora.on
    count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    return {"num_params": count(setup.params.base_abstract() if lora else setup.params.abstract),
            "lora_params": count(setup.params.abstract) if lora else 0,
            "active_params": families.active_params(setup.cfg.model)}


def _fits(cfg: Config, per_device: dict[str, int]) -> dict[str, Any]:
    on_device = per_device["total"] <= cfg.plan.device_memory_gb * GB
    on_host = per_device["host"] <= cfg.plan.host_memory_gb * GB
    return {"device_memory_gb": cfg.plan.device_memory_gb,
            "host_memory_gb": cfg.plan.host_memory_gb,
            "fits": on_device and on_host, "fits_device": on_device, "fits_host": on_host}


def suggestions(cfg: Config, micro_batch: int) -> list[str]:
    """What would lower per-device memory from this configuration (none it already has)."""
    from tunix_train.parallel import mesh as mesh_lib

    t = cfg.training
    found = ["put more devices on fsdp (model.mesh_shape)"]
    if t.zero_stage < 3:
        found.append(f"raise training.zero_stage from {t.zero_stage} to 3")
    if micro_batch > 1:
        found.append(f"lower training.micro_batch_size from {micro_batch} (with more "
                     f"training.gradient_accumulation_steps for the same batch)")
    if t.remat != "full":
        found.append(f"set training.remat=full (now {t.remat})")
    if not t.offload_optimizer:
        found.append("set training.offload_optimizer=true")
    sizes, names = cfg.model.mesh_shape
    if not t.offload_params and trainers.TRAINERS[cfg.trainer.name].offload_params and \
            dict(zip(names, sizes)).get(mesh_lib.PP, 1) == 1:
        found.append("set training.offload_params=true")
    return found


def _verdict(record: dict[str, Any]) -> str:
    """Device memory against plan.device_memory_gb and, where the step keeps anything there
    (training.offload_optimizer, offload_params), host memory against plan.host_memory_gb."""
    total, limit = record["per_device_bytes"]["total"] / GB, record["device_memory_gb"]
    host, host_limit = record["per_device_bytes"]["host"] / GB, record["host_memory_gb"]
    on_host = (f"; host {host:.2f} GB of {host_limit:g} GB per device" if host else "")
    if record["fits"]:
        return f"fits: {total:.2f} GB of {limit:g} GB per device{on_host}"
    if not record["fits_device"]:
        return (f"does NOT fit: {total:.2f} GB > {limit:g} GB per device{on_host}; "
                f"{', or '.join(record['suggestions'])}")
    offloaded = " and ".join(f"training.{key}=false" for key, part in (
        ("offload_optimizer", "optimizer_host"), ("offload_params", "params_host"))
        if record["per_device_bytes"].get(part))
    return (f"does NOT fit in host memory: {host:.2f} GB > {host_limit:g} GB per device "
            f"(plan.host_memory_gb, the machine's pinned memory over its devices), with "
            f"{total:.2f} GB of {limit:g} GB on the device; put more devices on fsdp "
            f"(model.mesh_shape), or set {offloaded}")


def _summary(record: dict[str, Any], costs) -> list[str]:
    from tunix_train.parallel import stages

    mesh = " × ".join(f"{k}={v}" for k, v in record["mesh"].items())
    return [
        f"plan: {record['model']} ({record['num_params']:,} parameters"
        + (f", {record['active_params']:,} active per token"
           if record["active_params"] != record["num_params"] else "")
        + f") on {mesh}, zero_stage "
        f"{record['zero_stage']}, compute {record['compute_dtype']}, "
        f"{record['tokens_per_step']:,} tokens per step (compiled in "
        f"{record['compile_seconds']} s)",
        *([record["lora"]] if record["lora"] else []),
        *([record["experts"]] if record["experts"] else []),
        *([stages.line(record["pipeline"])] if record["pipeline"] else []),
        *costs.memory_lines("GB"), costs.sync_line(),
        f"FLOPs per step (all devices, as compiled): {record['flops_per_step']:.3e}",
        "collectives per step, per device:", *costs.comm.table().splitlines(),
        f"verdict: {_verdict(record)}",
    ]


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir, cwd = hydra_cfg.runtime.output_dir, Path(hydra_cfg.runtime.cwd)
    with cli.user_errors(), cli.refused_leaves_no_run_dir(Path(run_dir), cwd):
        cfg = cli.typed(dict_cfg, hydra_cfg.overrides.task, cwd)
        validation.validate(cfg)  # told here, before JAX is imported and this command re-run
        ensure_cpu_devices(num_devices(cfg), run_dir)
        record = plan(cfg, Path(run_dir))
    if not record["fits"]:
        sys.exit(cli.EXIT_PLAN_DOES_NOT_FIT)  # a script can act on the verdict


if __name__ == "__main__":
    gc_policy.collect_less_often()
    if not os.environ.get(_REEXECUTED):  # the re-executed planner got checked arguments
        cli.before_hydra(sys.argv)
    main()
