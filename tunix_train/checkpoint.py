"""Orbax checkpoints: save the train state, the data iterator's position and the config; restore
them into any mesh.

On disk (a plain Orbax `CheckpointManager` directory, readable without this package):

    <run dir>/checkpoints/<step>/state    StandardSave of {"step", "params", "opt_state"}
    <run dir>/checkpoints/<step>/data     JsonSave of the data iterator's `get_state()`
    <run dir>/checkpoints/<step>/config   JsonSave of the resolved config

A step directory exists under its final name only once Orbax has committed it (it writes to
`<step>.orbax-checkpoint-tmp` and renames), and older steps are deleted only after a newer one
committed. Restoring goes into the current run's abstract state *with its shardings*, so a
checkpoint saved on one mesh, ZeRO stage or process count loads on another.

What can go wrong at restore, and what happens:
- the saved state has another structure or shape than this run's (a changed model or optimizer
  setting), or LoRA adapters of another base: found from Orbax's metadata before any array is
  read (checkpoint_fit.py); one sentence names the keys and both values; nothing is moved;
- a step proven unreadable (a file missing or truncated: tensorstore's NOT_FOUND, OUT_OF_RANGE,
  DATA_LOSS, a truncated compressed stream): reported in one line, set aside, and the previous
  step is used instead (checkpoint_damage.py);
- a storage error (an `OSError`, or tensorstore's UNAVAILABLE, DEADLINE_EXCEEDED, …): retried,
  then a loud failure (`StorageError`, exit code 6) that moves nothing;
- anything else (a bad argument, a bug): raised at once, never retried, never called storage.

And at save: a folder that cannot hold one more checkpoint of this run is refused at start-up,
before the train step compiles (`check_room`); a save that fails for the storage's sake all
the same (the disk filled meanwhile) stops the run with one sentence (`StorageError`, exit
code 6) that names the step, the space and the newest committed step, which is intact (Orbax
commits by rename, and deletes older steps only after a newer one committed) and where the
same command goes on from. Its half-written step is removed when the run starts again. The
failure of a save written in the background is raised at the step after it; in a job of several
processes, by the process whose part failed, while the others, waiting for it at a barrier of
the save, say so, and end once it is gone (`PeerSaveError`, exit code 5).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store

from tunix_train import checkpoint_damage as damage, checkpoint_fit
from tunix_train import checkpoint_storage as storage
from tunix_train.config import CheckpointConfig, ConfigError

log = logging.getLogger("tunix_train")

ITEMS = ("state", "data", "config")
NOT_SAVED = ("frozen",)  # train state entries that come from their source at every start (LoRA's
# base: training/state.py)
SAY_WAIT_AFTER_S = 10.0  # a save still being written then is said, and again every minute
SAY_WAIT_EVERY_S = 60.0
WAIT_POLL_S = 0.1


# Each array is written by the devices of its first replica, on every backend, as Orbax does on
# GPUs. Its default elsewhere (replica-parallel saving: replicas split a replicated shard among
# themselves) slices every shard on each device eagerly: at a process's first save on 8 CPU
# devices, ~120 one-op compiles, ~3.5 s, too short for the persistent cache to keep.
# (The metadata store is the default handler's; Orbax names it only in a private module:
# tests/test_internals.py.)
def _first_replica_array_handler() -> None:
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # Orbax warns on stderr that it replaces its own handler
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(
                use_replica_parallel=False, array_metadata_store=array_metadata_store.Store()),
            override=True)
    finally:
        absl.setLevel(level)


_first_replica_array_handler()


class _OrbaxTracebacks(logging.Filter):
    """Orbax logs a failed save's traceback (from its background threads, and again where it
    is waited for), asyncio each of its writes' unretrieved failures, and then Orbax raises the
    error, which reaches `Checkpoints`: a storage failure is said there once, in one sentence;
    any other error is raised with its own traceback. asyncio says a write's failure when its
    future is collected, which may be after that sentence, and a tensorstore write's error may
    carry no frame of Orbax's: asyncio's records of a storage failure are dropped by kind."""

    def filter(self, record: logging.LogRecord) -> bool:
        error, trace = record.exc_info[1:] if record.exc_info else (None, None)
        if record.name == "asyncio" and error is not None and storage.is_storage(error):
            return False
        return not any("/orbax/" in frame.filename for frame in traceback.extract_tb(trace))


for _logger in ("absl", "asyncio"):
    logging.getLogger(_logger).addFilter(_OrbaxTracebacks())


def _late_write_callback(error: BaseException | None, trace: Any) -> bool:
    """Whether an unraisable error is a tensorstore write finishing after Orbax closed its event
    loop: a failed save cancels the rest of its writes and closes the loop, and each write
    that ends later calls the closed loop's `call_soon_threadsafe` from tensorstore's own
    thread, which raises there and reaches Python only as unraisable (a full disk printed 39
    such tracebacks, which nothing ordered before the failure's one sentence)."""
    frames = traceback.extract_tb(trace)
    return (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
            and bool(frames) and all(Path(f.filename).parent.name == "asyncio" for f in frames))


def _unraisable_hook(previous: Callable) -> Callable:
    """sys.unraisablehook that says nothing of a late write's callback, and hands every other
    unraisable error to `previous`."""
    def hook(unraisable: Any) -> None:
        if not _late_write_callback(unraisable.exc_value, unraisable.exc_traceback):
            previous(unraisable)
    return hook


sys.unraisablehook = _unraisable_hook(sys.unraisablehook)


class _Manager(ocp.CheckpointManager):
    write_error: BaseException | None = None  # this process's part of the last save failed

    def reached_preemption(self, step: int) -> bool:
        # The loop owns JAX's preemption sync point (preemption.py) and calls it once per step;
        # Orbax calling it too, from its finalize thread, could skew the agreed step.
        return False

    def _wait_for_checkpointers(self) -> None:
        # Where Orbax's finalize thread meets a failure of this process's writes; it then waits
        # at a barrier (`finally`) that the other processes never reach, so the error would
        # reach the main thread after Orbax's timeout, 20 minutes. Kept here, the main thread
        # sees it at once (`Checkpoints.raise_if_failed`). A private method of Orbax's:
        # tests/test_internals.py.
        try:
            super()._wait_for_checkpointers()
        except BaseException as error:
            self.write_error = error
            raise


class Checkpoints:
    """This run's checkpoints: every `checkpoint.every_steps`, on preemption and at the end."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig):
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,  # leftovers of a save that a crash interrupted
        )
        self.directory = run_dir / "checkpoints"
        self.manager = _Manager(self.directory, options=options, item_names=ITEMS)
        self._in_flight: int | None = None  # the step whose save may still be running
        self._failed = False

    def due(self, step: int) -> bool:
        return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0

    def save(self, step: int, state: Any, data_state: dict, config: dict) -> bool:
        """Starts saving `step` (in the background when async); False if it is already saved."""
        self._wait()  # the previous save's failure is that step's, not this one's
        if self.manager.latest_step() == step:
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(saved_part(state)),
                                  data=ocp.args.JsonSave(data_state),
                                  config=ocp.args.JsonSave(config))
        self._in_flight, self.manager.write_error = step, None
        with self._storage_errors(state):
            # Returns once the arrays are copied off the devices: the next step may donate them.
            self.manager.save(step, args=args, force=True)
        return True

    def raise_if_failed(self) -> None:
        """Raises the failure of a save still in flight whose writes on this process failed: at
        the step after it, not at the next save, so no step is trained that cannot be saved,
        and a multi-process job's peers, waiting for this process, learn it when it is gone."""
        if self._in_flight is not None and self.manager.write_error is not None:
            with self._storage_errors():
                raise self.manager.write_error

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def close(self) -> None:
        """Waits until every started save has committed (after a failed one: only lets go)."""
        if self._failed:
            if jax.process_count() == 1:  # with peers, Orbax's threads wait for them: left
                with contextlib.suppress(Exception):  # the failure has had its sentence
                    self.manager.close()
            return
        self._wait()
        self.manager.close()

    def _wait(self) -> None:
        """Waits until the save in flight has committed on every process.

        Polled, not joined: a process whose own writes failed says so at once (Orbax's
        thread would hold it back until a barrier that the other processes never reach timed
        out, 20 minutes later). A save still running after `SAY_WAIT_AFTER_S` is said, and
        again every `SAY_WAIT_EVERY_S`."""
        if self._in_flight is None:
            return
        start = time.monotonic()
        said = start + SAY_WAIT_AFTER_S
        while self.manager.is_saving_in_progress():
            self.raise_if_failed()
            if time.monotonic() >= said:
                log.info("waiting for the checkpoint of step %d to be written%s",
                         self._in_flight, _by_all(time.monotonic() - start))
                said += SAY_WAIT_EVERY_S
            time.sleep(WAIT_POLL_S)
        with self._storage_errors():
            self.manager.wait_until_finished()
        self._in_flight = None

    @contextlib.contextmanager
    def _storage_errors(self, state: Any = None) -> Iterator[None]:
        """A save that fails for the storage's sake (a full disk, a lost mount) becomes one
        sentence (exit code 6); any other error is raised as it is."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - sorted: storage or not
            if not (storage.is_storage(error) or storage.waited_for_peers(error)):
                raise
            self._failed = True
            needed = None if state is None else saved_bytes(state)
            raise storage.save_failed(error, self._in_flight, self.directory, needed) from error


def _by_all(waited_s: float) -> str:
    count = jax.process_count()
    return (f" by all {count} processes ({waited_s:.0f} s); one whose part failed says so in "
            f"its own lines" if count > 1 else f" ({waited_s:.0f} s)")


@dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    data_state: dict
    path: Path  # the step directory it came from


def with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)


def saved_part(state: dict) -> dict:
    """What of a train state (or of its layout) a checkpoint holds."""
    return {k: v for k, v in state.items() if k not in NOT_SAVED}


def saved_bytes(state: dict) -> int:
    """The bytes of the arrays a checkpoint of `state` (arrays or their shapes) holds,
    uncompressed: what one checkpoint takes on disk at most, but a few kilobytes of metadata."""
    return storage.array_bytes(saved_part(state))


def check_room(run_dir: Path, state: dict) -> None:
    """Refuses a run whose checkpoint folder cannot hold one checkpoint of `state` (its shapes
    suffice), before its first save fails after the compilation and the steps before it."""
    storage.check_room(run_dir / "checkpoints", saved_bytes(state))


def own_checkpoints(run_dir: Path) -> Path | None:
    """The run's own checkpoint directory if it holds a committed step (a restarted run)."""
    directory = run_dir / "checkpoints"
    return directory if directory.is_dir() and _steps(directory) else None


def restore(path: str | Path, abstract_state: Any, config: dict,
            set_aside_in: Path | None = None) -> Restored:
    """The newest readable step under `path` (a run dir, its checkpoints/ or one step dir).

    `config`: this run's resolved config, to name what differs if the saved state does not fit.
    Steps proven damaged are moved to `set_aside_in` (a run's own directory, so that it can save
    those step numbers again); other runs' directories are only read.
    """
    directory, steps = locate(path)
    manager = _reader(directory)

    def read(step: int) -> Restored:
        saved_tree, saved_config = _saved_shapes_and_config(manager, step)
        checkpoint_fit.check_structure(saved_tree, abstract_state, directory / str(step),
                                       saved_config, config)
        checkpoint_fit.check_lora_base(directory / str(step), saved_config, config)
        items = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return Restored(step, items.state, dict(items.data), directory / str(step))

    restored, damaged = damage.newest_readable(directory, steps, read)
    if set_aside_in is not None and damaged:
        damage.set_aside(directory, damaged, set_aside_in / "damaged_checkpoints")
    return restored


def load_params(path: str | Path, abstract_params: Any, shardings: Any,
                config: dict | None = None) -> Any:
    """Only the parameters of the newest readable step under `path`, in the given shardings.

    For fine-tuning (`checkpoint.init_params_from`), export and generation: the optimizer
    state is not read. `config`, if given, names what differs when the parameters do not fit.
    """
    directory, steps = locate(path)
    manager = _reader(directory)
    target = {"params": with_shardings(abstract_params, shardings)}
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), target)

    def read(step: int) -> Any:
        saved_tree, saved_config = _saved_shapes_and_config(manager, step)
        checkpoint_fit.check_structure(saved_tree, target, directory / str(step), saved_config,
                                       config, part="params")
        checkpointer = ocp.PyTreeCheckpointer()
        return checkpointer.restore(directory / str(step) / "state", args=ocp.args.PyTreeRestore(
            target, restore_args=restore_args, partial_restore=True))["params"]

    params, _ = damage.newest_readable(directory, steps, read)
    return params


def saved_config(path: str | Path) -> dict:
    """The resolved config saved with the newest committed step under `path`."""
    directory, steps = locate(path)
    items = _reader(directory).restore(
        steps[0], args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return dict(items.config)


def locate(path: str | Path) -> tuple[Path, list[int]]:
    """(checkpoint directory, candidate steps, newest first) for a run, checkpoints or step dir
    (a relative path means one under the current directory: Orbax takes absolute ones only)."""
    path = Path(path).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if path.name.isdigit() and int(path.name) in _steps(path.parent):
        return path.parent, [int(path.name)]
    steps = _steps(path)
    if not steps:
        raise ConfigError(f"{path} holds no committed checkpoint; point checkpoint.resume_from or "
                          f"checkpoint.init_params_from at a run directory or a step directory.")
    return path, sorted(steps, reverse=True)


def _saved_shapes_and_config(manager: _Manager, step: int) -> tuple[Any, Callable[[], dict]]:
    """The saved state's array metadata, and a reader of the saved config (read only when a
    check needs it)."""
    def saved_config() -> dict:
        return dict(manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore())).config)

    return dict(manager.item_metadata(step)["state"]), saved_config


def _reader(directory: Path) -> _Manager:
    # Never saves, so it writes nothing. (`read_only=True` would say the same in a warning line
    # on every start.) The handlers let it read each item's metadata without its arrays.
    options = ocp.CheckpointManagerOptions(create=False)
    handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler()}
    return _Manager(directory, options=options, item_handlers=handlers)


def _steps(directory: Path) -> list[int]:
    """Committed steps: Orbax lists neither temporary directories nor anything else."""
    return list(_reader(directory).all_steps()) if directory.is_dir() else []
