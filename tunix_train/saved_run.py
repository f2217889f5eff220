"""A training run's checkpoint, read back for export and generation: its model config, and its
parameters (through `checkpoint.load_params`, each array straight into its sharding)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

from tunix_train import checkpoint
from tunix_train.config import ModelConfig
from tunix_train.models import hf_config

# Model keys that belong to the command at hand, not to the saved weights.
_RUNTIME_KEYS = ("mesh_shape", "sharding_rules", "attention_impl")


def model_config(run_dir: str | Path, current: ModelConfig, explicit: Iterable[str]) -> ModelConfig:
    """The saved run's model (newest committed step), placed on the current command's mesh."""
    saved = checkpoint.saved_config(run_dir)
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - set(_RUNTIME_KEYS)
    model = {k: v for k, v in saved["model"].items() if k in fields}
    # `init_from` stays as a record of where the weights first came from (export copies that
    # checkpoint's tokenizer); the weights themselves are read from this run.
    return hf_config.adopt(current, model, explicit, f"the checkpoint of {run_dir}")


def load_params(run_dir: str | Path, abstract_params: Any, shardings: Any) -> Any:
    return checkpoint.load_params(run_dir, abstract_params, shardings)
