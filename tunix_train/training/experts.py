"""What a mixture of experts asks of a run's setup: the router's loss weights, and the meshes
and schedules its routing cannot run on, refused by name before anything compiles."""

from __future__ import annotations

import importlib.metadata

import jax

from tunix_train import backend
from tunix_train.config import Config, ConfigError
from tunix_train.models import families, router_losses
from tunix_train.parallel import mesh as mesh_lib, stages


def check_mesh(cfg: Config, shape: mesh_lib.MeshShape) -> None:
    _check_kernel_on_tp(cfg, shape.tp)
    _check_tokamax_on_gpu(cfg)
    _check_expert_parallelism(cfg, shape)


def router_loss_weights(cfg: Config) -> router_losses.LossWeights:
    """How much of a mixture of experts' router losses the training loss adds (none for a dense
    model): training.moe_aux_loss_weight, by default the model's router_aux_loss_coef."""
    t = cfg.training
    if not families.stacking(cfg.model).routed:
        return router_losses.LossWeights()
    aux = cfg.model.router_aux_loss_coef if t.moe_aux_loss_weight is None else \
        t.moe_aux_loss_weight
    return router_losses.LossWeights(aux, t.router_z_loss_weight)


def _check_kernel_on_tp(cfg: Config, tp: int) -> None:
    kernels = cfg.model.moe_matmul
    if cfg.model.num_experts and kernels in ("tokamax", "pallas") and tp > 1:
        raise ConfigError(
            f"model.moe_matmul={kernels} with tp={tp} in model.mesh_shape: XLA cannot split "
            f"{kernels}'s kernels over tp and would gather the experts whole on every device; put "
            f"those devices on fsdp or ep, or set model.moe_matmul=tiles.")


# tokamax releases whose GPU kernels call what JAX 0.11 removed (bench/gpu_check.sh's
# `moe-tokamax` and bench/grouped_matmul.py on an H100 and an H200, docs/performance.md):
# the Mosaic GPU kernel Hopper gets passes plgpu.kernel an `out_shape` Mesh no longer takes,
# and the Triton one calls pl.dot.
_TOKAMAX_BROKEN_ON_JAX_0_11 = ("0.0.12",)


def _check_tokamax_on_gpu(cfg: Config) -> None:
    if not (cfg.model.num_experts and cfg.model.moe_matmul == "tokamax" and backend.is_gpu()):
        return
    try:
        version = importlib.metadata.version("tokamax")
    except importlib.metadata.PackageNotFoundError:
        return  # validation.py says so, by name
    jax_minor = tuple(int(part) for part in jax.__version__.split(".")[:2])
    if version in _TOKAMAX_BROKEN_ON_JAX_0_11 and jax_minor >= (0, 11):
        raise ConfigError(
            f"model.moe_matmul=tokamax on a GPU: tokamax {version}'s GPU kernels do not run on "
            f"jax {jax.__version__} (they call what jax 0.11 removed); set "
            f"model.moe_matmul=pallas (our kernels) or auto, or use a newer tokamax.")


def _check_expert_parallelism(cfg: Config, shape: mesh_lib.MeshShape) -> None:
    """ep splits a mixture's experts: a dense model has none."""
    if shape.ep == 1:
        return
    if not cfg.model.num_experts:
        raise ConfigError(
            f"model.mesh_shape has ep={shape.ep}, but {cfg.model.name} has no experts to split "
            f"(model.num_experts=0); put those devices on fsdp.")


def check_router_losses_on_pp(cfg: Config, weights: router_losses.LossWeights,
                               plan: stages.Schedule | None) -> None:
    """The pipeline's last layers run this stage's share of the M micro-batches, zeros past M
    included: their router statistics would count those (parallel/pipeline.py)."""
    if plan is None or not (weights.aux or weights.z) or plan.microbatches % plan.stages == 0:
        return
    raise ConfigError(
        f"training.pipeline_microbatches={plan.microbatches} on pp={plan.stages} with the "
        f"router's losses on (training.moe_aux_loss_weight={weights.aux}, "
        f"training.router_z_loss_weight={weights.z}): set training.pipeline_microbatches to a "
        f"multiple of {plan.stages}, or both weights to 0.")
