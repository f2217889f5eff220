"""What a mixture of experts asks of a run's setup: the router's loss weights, and the meshes
and schedules its routing cannot run on, refused by name before anything compiles."""

from __future__ import annotations

from tunix_train.config import Config, ConfigError
from tunix_train.models import families, router_losses
from tunix_train.parallel import mesh as mesh_lib, stages


def check_mesh(cfg: Config, shape: mesh_lib.MeshShape) -> None:
    _check_kernel_on_tp(cfg, shape.tp)
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
            f"those devices on fsdp or ep, or set model.moe_matmul=blocks.")


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
