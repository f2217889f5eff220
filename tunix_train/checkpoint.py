"""Orbax checkpoints: save the train state, the data iterator's position and the config; restore
them into any mesh.

Layout (a plain Orbax `CheckpointManager` directory, readable without this package):

    <run dir>/checkpoints/<step>/state    StandardSave of {"step", "params", "opt_state"}
    <run dir>/checkpoints/<step>/data     JsonSave of the data iterator's `get_state()`
    <run dir>/checkpoints/<step>/config   JsonSave of the resolved config

A step directory exists under its final name only once Orbax has committed it (it writes to
`<step>.orbax-checkpoint-tmp` and renames), and older steps are deleted only after a newer one
committed. Restoring goes into the current run's abstract state *with its shardings*, so a
checkpoint saved on one mesh, ZeRO stage or process count loads on another. A committed step
that cannot be read (a file removed or truncated) is reported in one line and the previous step
is used instead.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from tunix_train.config import CheckpointConfig, ConfigError, ModelConfig

log = logging.getLogger("tunix_train")

ITEMS = ("state", "data", "config")
# Keys that decide parameter shapes: a checkpoint with other values cannot load.
SHAPE_KEYS = ("num_layers", "embed_dim", "hidden_dim", "num_heads", "num_kv_heads", "head_dim",
              "vocab_size")


class _Manager(ocp.CheckpointManager):
    def reached_preemption(self, step: int) -> bool:
        # The loop owns JAX's preemption sync point (preemption.py) and calls it once per step;
        # Orbax calling it too, from its finalize thread, could skew the agreed step.
        return False


class Checkpoints:
    """This run's checkpoints: every `checkpoint.every_steps`, on preemption and at the end."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig):
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,  # leftovers of a save that a crash interrupted
        )
        self.manager = _Manager(run_dir / "checkpoints", options=options, item_names=ITEMS)

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def save(self, step: int, state: Any, data_state: dict, config: dict) -> bool:
        """Starts saving `step` (in the background when async); False if it is already saved."""
        if self.manager.latest_step() == step:
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config))
        # Returns once the arrays are copied off the devices: the next step may donate them.
        self.manager.save(step, args=args, force=True)
        return True

    def close(self) -> None:
        """Waits until every started save has committed."""
        self.manager.close()


@dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    data_state: dict
    path: Path  # the step directory it came from


def with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)


def own_checkpoints(run_dir: Path) -> Path | None:
    """The run's own checkpoint directory if it holds a committed step (a restarted run)."""
    directory = run_dir / "checkpoints"
    return directory if directory.is_dir() and _steps(directory) else None


def restore(path: str | Path, abstract_state: Any, model: ModelConfig,
            set_aside_in: Path | None = None) -> Restored:
    """The newest readable step under `path` (a run dir, its checkpoints/ or one step dir).

    Steps found damaged are moved to `set_aside_in` (a run's own directory, so that it can save
    those step numbers again); other runs' directories are only read.
    """
    directory, steps = locate(path)
    manager = _reader(directory)

    def read(step: int) -> Restored:
        _check_model(manager, step, directory, model)
        items = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return Restored(step, items.state, dict(items.data), directory / str(step))

    restored, damaged = _newest_readable(directory, steps, read)
    if set_aside_in is not None and damaged:
        _set_aside(directory, damaged, set_aside_in / "damaged_checkpoints")
    return restored


def load_params(path: str | Path, abstract_params: Any, shardings: Any,
                model: ModelConfig | None = None) -> Any:
    """Only the parameters of the newest readable step under `path`, in the given shardings.

    For fine-tuning (`checkpoint.init_params_from`), export and generation: the optimizer
    state is not read. `model`, if given, is checked against the checkpoint's model config.
    """
    directory, steps = locate(path)
    manager = _reader(directory)
    target = {"params": with_shardings(abstract_params, shardings)}
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), target)

    def read(step: int) -> Any:
        if model is not None:
            _check_model(manager, step, directory, model)
        checkpointer = ocp.PyTreeCheckpointer()
        return checkpointer.restore(directory / str(step) / "state", args=ocp.args.PyTreeRestore(
            target, restore_args=restore_args, partial_restore=True))["params"]

    params, _ = _newest_readable(directory, steps, read)
    return params


def saved_config(path: str | Path) -> dict:
    """The resolved config saved with the newest committed step under `path`."""
    directory, steps = locate(path)
    items = _reader(directory).restore(
        steps[0], args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return dict(items.config)


def locate(path: str | Path) -> tuple[Path, list[int]]:
    """(checkpoint directory, candidate steps, newest first) for a run, checkpoints or step dir."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.name.isdigit() and int(path.name) in _steps(path.parent):
        return path.parent, [int(path.name)]
    steps = _steps(path)
    if not steps:
        raise ConfigError(f"{path} holds no committed checkpoint; point checkpoint.resume_from or "
                          f"checkpoint.init_params_from at a run directory or a step directory.")
    return path, sorted(steps, reverse=True)


def _reader(directory: Path) -> _Manager:
    # Never saves, so it writes nothing. (`read_only=True` would say the same in a warning line
    # on every start.)
    options = ocp.CheckpointManagerOptions(create=False)
    return _Manager(directory, options=options, item_names=ITEMS)


def _steps(directory: Path) -> list[int]:
    """Committed steps: Orbax lists neither temporary directories nor anything else."""
    return list(_reader(directory).all_steps()) if directory.is_dir() else []


def _newest_readable(directory: Path, steps: list[int],
                     read: Callable[[int], Any]) -> tuple[Any, list[int]]:
    """Tries `read` from the newest step down; every process must succeed on the same step."""
    damaged: list[int] = []
    for i, step in enumerate(steps):
        try:
            result, error = read(step), None
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to read means the step is unusable
            result, error = None, e
        if _everyone(error is None):
            return result, damaged
        damaged.append(step)
        fallback = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else "none left"
        reason = _first_line(error) if error else "another process could not read it"
        log.warning("checkpoint step %d in %s is damaged or incomplete (%s); %s", step,
                    directory, reason, fallback)
    raise ConfigError(f"no readable checkpoint in {directory} (steps {steps} are all damaged); "
                      f"move the directory aside to start afresh or point "
                      f"checkpoint.resume_from at a good one.")


def _check_model(manager: _Manager, step: int, directory: Path, model: ModelConfig) -> None:
    saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    saved_model = saved.config["model"]
    for key in SHAPE_KEYS:
        if saved_model[key] != getattr(model, key):
            raise ConfigError(
                f"checkpoint {directory / str(step)} has model.{key}={saved_model[key]} but this "
                f"run has model.{key}={getattr(model, key)}; use the same model settings.")


def _everyone(ok: bool) -> bool:
    """Whether `ok` holds on every process (they must agree on which step to restore)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def _set_aside(directory: Path, steps: list[int], destination: Path) -> None:
    if jax.process_index() == 0:
        destination.mkdir(parents=True, exist_ok=True)
        for step in steps:
            target, copy = destination / str(step), 1
            while target.exists():  # an earlier damaged copy of the same step number
                target, copy = destination / f"{step}.{copy}", copy + 1
            shutil.move(str(directory / str(step)), str(target))
            log.warning("moved damaged checkpoint step %d to %s", step, target)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("tunix_train:damaged checkpoints set aside")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:240] if text else ''}"
