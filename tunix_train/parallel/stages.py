"""Pipeline plans: how a model's blocks split into pp stages (and a circular schedule's
chunks), how many pipeline micro-batches, the bubble they leave, and what the start-up log and
the planner print of it. parallel/pipeline.py runs the plan inside the train step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.models import families
from tunix_train.models.family import Stacking
from tunix_train.parallel.fsdp import GradientSync, local_gradient_bytes

log = logging.getLogger(__name__)
MAX_BUBBLE = 0.25  # the default number of pipeline micro-batches keeps the bubble at most this


@dataclass(frozen=True)
class Schedule:
    stages: int  # pp
    microbatches: int  # M: pipeline micro-batches per micro-batch
    repeats: int = 1  # v: rounds of the ring each micro-batch makes (circular when > 1)

    @property
    def iterations(self) -> int:
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of a step each stage idles: (pp - 1) / (v·M + pp - 1)."""
        return (self.stages - 1) / self.iterations

    @property
    def per_stage(self) -> int:
        """Micro-batches whose loss each stage computes (the last stage's outputs, spread)."""
        return math.ceil(self.microbatches / self.stages)


def check_layers(model: ModelConfig, pp: int, repeats: int = 1) -> None:
    """Pipeline stages are cut from whole blocks (models/family.py: the repeating unit of a
    model's layers), at least one per chunk (`repeats` chunks per stage)."""
    if pp == 1:
        if repeats > 1:
            raise ConfigError(
                f"training.pipeline_repeats={repeats} needs pipeline stages, and "
                f"model.mesh_shape={model.mesh_shape} has no pp axis; set "
                f"training.pipeline_repeats=1 or add a pp axis.")
        return
    stacking = families.stacking(model)
    if stacking.num_blocks < pp:
        fix = (f"use a pp of at most {stacking.num_blocks} or no pp axis"
               if stacking.num_blocks > 1 else "use no pp axis")
        raise ConfigError(
            f"model.num_layers={model.num_layers} has {stacking.num_blocks} block(s) of "
            f"{stacking.layers_per_block} layer(s), too few for pp={pp} pipeline stages of at "
            f"least one block each; {fix}.")
    if stacking.num_blocks < pp * repeats:
        raise ConfigError(
            f"training.pipeline_repeats={repeats} cuts the {stacking.num_blocks} block(s) of "
            f"model.num_layers={model.num_layers} into pp × {repeats} = {pp * repeats} chunks, "
            f"more than there are blocks; use training.pipeline_repeats of at most "
            f"{stacking.num_blocks // pp}.")


@dataclass(frozen=True)
class Stages:
    """How a model's blocks split into `stages` pipeline stages: each holds `repeats` chunks of
    `chunk` consecutive blocks (stage s's r-th chunk is the model's (r·pp + s)-th), and the
    `leftover` blocks that do not divide evenly run after the stages, with the trailing layers
    (every stage taking its share of the micro-batches, like the head)."""

    stages: int
    repeats: int
    chunk: int
    leftover: int
    stacking: Stacking

    @classmethod
    def of(cls, stacking: Stacking, pp: int, repeats: int = 1) -> "Stages":
        return cls(pp, repeats, *divmod(stacking.num_blocks, pp * repeats), stacking)

    @property
    def per_stage(self) -> int:
        """Blocks each stage holds, all its chunks together."""
        return self.chunk * self.repeats

    @property
    def stored_whole(self) -> bool:
        """Whether the stacks cannot be split over pp by consecutive rows (left-over blocks, or
        a stage's chunks apart from each other): then they are stored whole over pp."""
        return bool(self.leftover) or self.repeats > 1

    @property
    def layers_per_stage(self) -> int:
        return self.per_stage * self.stacking.layers_per_block

    @property
    def layers_per_chunk(self) -> int:
        return self.chunk * self.stacking.layers_per_block

    @property
    def layers_after(self) -> int:
        return self.leftover * self.stacking.layers_per_block + self.stacking.trailing_layers

    def rows(self, stack: str) -> int:
        """Rows of `stack` (one of the stacking's block stacks) each stage runs."""
        return self.per_stage * self.stacking.rows_per_block(stack)

    def row_order(self, stack: str) -> np.ndarray:
        """The rows of `stack` reordered so that each stage's are consecutive, its chunks in
        the order it runs them (stage 0's, stage 1's, …), the left-over blocks' last."""
        pp, chunk = self.stages, self.chunk
        blocks = [(r * pp + s) * chunk + j for s in range(pp) for r in range(self.repeats)
                  for j in range(chunk)]
        blocks += range(pp * self.per_stage, self.stacking.num_blocks)
        per_block = self.stacking.rows_per_block(stack)
        return np.array([b * per_block + i for b in blocks for i in range(per_block)])


def schedule(pp: int, rows: int, microbatches: int | None, repeats: int = 1) -> Schedule:
    """`training.pipeline_microbatches`, checked against a device's rows per micro-batch; None:
    the fewest that divide the rows and keep the bubble at most MAX_BUBBLE, else all rows. The
    circular schedule (`repeats` > 1) needs at least pp: a micro-batch back from the last stage
    must find stage 0 done with the micro-batches before it."""
    least = pp if repeats > 1 else 1
    if rows < least:
        raise ConfigError(
            f"training.pipeline_repeats={repeats} needs at least pp={pp} pipeline micro-batches "
            f"per micro-step, and each fsdp shard takes {rows} row(s) per micro-step; raise "
            f"training.micro_batch_size to {pp} or more, or set training.pipeline_repeats=1.")
    if microbatches is None:
        fitting = [m for m in range(least, rows + 1) if rows % m == 0 and
                   Schedule(pp, m, repeats).bubble <= MAX_BUBBLE]
        plan = Schedule(pp, fitting[0] if fitting else rows, repeats)
        if not fitting:
            enough = max(least, math.ceil(3 * (pp - 1) / repeats))
            log.warning("pipeline: %d row(s) per fsdp shard and micro-step allow at most %d "
                        "micro-batches: the bubble is %.0f%% of each step; raise "
                        "training.micro_batch_size to %d or more to bring it to %.0f%%.", rows,
                        rows, 100 * plan.bubble, enough, 100 * MAX_BUBBLE)
        return plan
    if rows % microbatches:
        raise ConfigError(
            f"training.pipeline_microbatches={microbatches} must divide the {rows} rows each "
            f"fsdp shard takes per micro-step (training.micro_batch_size); choose a divisor "
            f"of {rows}.")
    if microbatches < least:
        raise ConfigError(
            f"training.pipeline_microbatches={microbatches} is fewer than pp={pp}, which "
            f"training.pipeline_repeats={repeats} needs (a micro-batch back from the last stage "
            f"would find stage 0 still busy); use at least {pp}, or "
            f"training.pipeline_repeats=1.")
    return Schedule(pp, microbatches, repeats)


def describe(plan: Schedule | None, model: ModelConfig, rows: int) -> dict[str, Any] | None:
    """The schedule as the planner records it (`rows`: per fsdp shard and micro-step)."""
    if plan is None:
        return None
    split = Stages.of(families.stacking(model), plan.stages, plan.repeats)
    return {"stages": plan.stages, "microbatches": plan.microbatches,
            "rows_per_microbatch": rows // plan.microbatches, "repeats": plan.repeats,
            "layers_per_stage": split.layers_per_stage,
            "layers_per_chunk": split.layers_per_chunk,
            "layers_outside_stages": split.layers_after, "bubble": plan.bubble}


def line(record: dict[str, Any]) -> str:
    """One line for the start-up log and the planner, from `describe`'s record."""
    repeats = record.get("repeats", 1)
    circular = (f" in {repeats} chunks of {record['layers_per_chunk']}, circular"
                if repeats > 1 else "")
    formula = "(pp-1)/(M+pp-1)" if repeats == 1 else f"(pp-1)/({repeats}·M+pp-1)"
    return (f"pipeline: {record['stages']} stages of {record['layers_per_stage']} layers"
            f"{circular} (+ {record['layers_outside_stages']} layer(s) after the stages, the "
            f"head and the loss spread over the stages), {record['microbatches']} micro-batches "
            f"of {record['rows_per_microbatch']} row(s) per micro-step: bubble {formula} = "
            f"{record['bubble']:.1%}; memory figures are one stage's device")


def reduced_gradient_bytes(sync: GradientSync, params: Any, dtype: jnp.dtype,
                           split: Stages | None) -> int:
    """Per-device bytes one full gradient reduction carries (the planner's yardstick for
    counting reductions): `fsdp.local_gradient_bytes`, less the other stages' rows of block
    stacks stored whole over pp when their gradients are reduced in the backward pass (each
    stage reduces only its own rows and the leftover blocks'). `split`: None without pp."""
    total = local_gradient_bytes(sync, params, dtype)
    if split is None or not split.stored_whole or not sync.reduces_per_layer:
        return total
    others = 1 - (split.per_stage + split.leftover) / split.stacking.num_blocks
    return total - round(others * sum(
        local_gradient_bytes(dataclasses.replace(sync, grad_specs=sync.grad_specs[stack]),
                             params[stack], dtype) for stack in split.stacking.block_stacks))
