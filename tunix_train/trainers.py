"""The trainers `trainer.name` chooses, in one registry read by the command line, the
validator, the planner and the trainer core: a new trainer is an entry here and a package of
its own (grpo/, dpo/).

Each trainer's code is named here, not imported: the registry sits with the config, below the
trainers' packages (tests/test_architecture.py), and a refused value is told before JAX loads.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from tunix_train.config import Config

NO_REFERENCE = "no reference model"


@dataclass(frozen=True)
class Trainer:
    task: str  # "module:class" of its part of the run (training/run.py's Task)
    data: str | None = None  # its own data= group; None: text or SFT data
    updates_per_step: Callable[[Config], int] = lambda cfg: 1  # optimizer updates
    # Why a run of it holds no frozen reference model beside the policy; None: it holds one
    # (training/reference.py).
    no_reference: Callable[[Config], str | None] = lambda cfg: NO_REFERENCE
    # Whether its step runs through pipeline stages (which compute the next-token loss only)
    # and with parameters in host memory (which its own work, a reference or rollouts, would
    # need on the device).
    pipeline: bool = False
    offload_params: bool = False


TRAINERS = {
    "default": Trainer("tunix_train.training.run:Task", pipeline=True, offload_params=True),
    "grpo": Trainer("tunix_train.grpo.trainer:GrpoTask", "prompts",
                    updates_per_step=lambda cfg: cfg.grpo.num_iterations,
                    no_reference=lambda cfg: NO_REFERENCE if cfg.grpo.beta == 0 else None),
    "dpo": Trainer("tunix_train.dpo.trainer:DpoTask", "preferences",
                   no_reference=lambda cfg: (
                       "reference model: none held (dpo.precompute_reference=true: its "
                       "log-probs are computed before the first step)")
                   if cfg.dpo.precompute_reference else None),
}


def task_of(name: str) -> type:
    """trainer.name → its part of the run, imported now (its module imports JAX)."""
    module, _, attr = TRAINERS[name].task.partition(":")
    return getattr(importlib.import_module(module), attr)


def optimizer_steps(cfg: Config) -> int:
    """Optimizer updates in the whole run (GRPO makes grpo.num_iterations a step)."""
    return cfg.training.steps * TRAINERS[cfg.trainer.name].updates_per_step(cfg)
