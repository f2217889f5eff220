"""A training run's latest checkpoint, read back for export and generation.

`<run dir>/checkpoints/` is an Orbax CheckpointManager directory whose steps hold the items
`state` ({"step", "params", "opt_state"}), `data` and `config` (the resolved config as JSON).
Only the parameters are restored, each straight into its sharding on the current mesh.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

import jax
import orbax.checkpoint as ocp

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.models import hf_config

# Model keys that belong to the command at hand, not to the saved weights.
_RUNTIME_KEYS = ("mesh_shape", "sharding_rules", "attention_impl")


def _manager(run_dir: str | Path) -> tuple[ocp.CheckpointManager, int]:
    directory = Path(run_dir).expanduser().resolve() / "checkpoints"
    manager = ocp.CheckpointManager(directory, item_names=("state", "config")) \
        if directory.is_dir() else None
    step = manager.latest_step() if manager is not None else None
    if step is None:
        raise ConfigError(
            f"checkpoint.resume_from={run_dir}: no checkpoint under {directory}; point it at a "
            f"run directory that saved one."
        )
    return manager, step


def model_config(run_dir: str | Path, current: ModelConfig, explicit: Iterable[str]) -> ModelConfig:
    """The saved run's model, placed on the current command's mesh."""
    manager, step = _manager(run_dir)
    saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - set(_RUNTIME_KEYS)
    model = {k: v for k, v in saved["config"]["model"].items() if k in fields}
    # `init_from` stays as a record of where the weights first came from (export copies that
    # checkpoint's tokenizer); the weights themselves are read from this run.
    return hf_config.adopt(current, model, explicit, f"the checkpoint of {run_dir}")


def load_params(run_dir: str | Path, abstract_params: Any, shardings: Any) -> Any:
    """The parameters of the latest step, restored directly into `shardings`."""
    manager, step = _manager(run_dir)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract_params, shardings)
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item={"params": target}, partial_restore=True,
        restore_args=jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding),
                                  {"params": target}),
    )))
    return restored["state"]["params"]
