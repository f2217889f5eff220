"""checkpoint.py on small hand-made states: resharding, damaged and uncommitted steps, params only.

The end-to-end behaviour through the CLI (resume, preemption, SIGKILL, NaN, watchdog) is in
test_resume.py; these are the same rules, cheap enough to check each edge case.
"""

import asyncio
import errno
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import compose_config
from tunix_train import checkpoint, checkpoint_damage
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.training import optim
from tunix_train import config as config_lib
from tunix_train import validation
from tunix_train.checkpoint import Checkpoints
from tunix_train.config import CheckpointConfig, ConfigError
from tunix_train.paths import StorageError
from tunix_train.training.preemption import PreemptionSignal

# A failed Orbax read leaves its other coroutines un-awaited; Python reports them whenever they
# are collected, during whichever test runs then.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
CONFIG = config_lib.to_dict(compose_config())


def make_mesh(fsdp: int, tp: int):
    return mesh_lib.create_mesh(mesh_lib.parse([[fsdp, tp], ["fsdp", "tp"]], 8), jax.devices())


def shardings(mesh):
    """A train-state-like tree: a matrix sharded over both axes, a vector, a scalar step."""
    return {"step": NamedSharding(mesh, P()),
            "params": {"w": NamedSharding(mesh, P("fsdp", "tp")), "b": NamedSharding(mesh, P())},
            "opt_state": {"mu": NamedSharding(mesh, P("fsdp", None))}}


def make_state(step: int, mesh) -> dict:
    # Random, so that array data (not metadata) makes up most of the bytes on disk.
    w = jnp.asarray(np.random.default_rng(step).normal(size=(256, 64)), jnp.float32)
    values = {"step": jnp.int32(step), "params": {"w": w, "b": jnp.full(16, step, jnp.float32)},
              "opt_state": {"mu": w + 1}}
    return jax.device_put(values, shardings(mesh))


def abstract(mesh) -> dict:
    shapes = jax.eval_shape(lambda: make_state(1, mesh))
    return checkpoint.with_shardings(shapes, shardings(mesh))


def save_steps(run_dir: Path, steps, mesh, keep: int = 3) -> None:
    checkpoints = Checkpoints(run_dir, CheckpointConfig(keep=keep))
    for step in steps:
        checkpoints.save(step, make_state(step, mesh), {"next_step": step}, CONFIG)
    checkpoints.close()


def assert_state_is(restored, step: int) -> None:
    expected = jax.device_get(make_state(step, make_mesh(8, 1)))
    for got, want in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want)


def test_saved_on_4x2_restores_on_8x1_in_the_new_shardings(tmp_path):
    save_steps(tmp_path, [2], make_mesh(4, 2))
    target = make_mesh(8, 1)
    restored = checkpoint.restore(tmp_path, abstract(target), CONFIG)
    assert restored.step == 2 and restored.data_state == {"next_step": 2}
    assert_state_is(restored.state, 2)
    assert restored.state["params"]["w"].sharding == shardings(target)["params"]["w"]


def test_a_save_still_being_written_is_said_then_committed(tmp_path, monkeypatch, caplog):
    """Checkpoints._wait says what it waits for while a save is written (slowed here to 0.5 s
    where Orbax's finalize thread waits for the writes, said after 0.1 s), then returns once the
    step committed."""
    real = checkpoint._Manager._wait_for_checkpointers

    def slow(self):
        time.sleep(0.5)
        real(self)

    monkeypatch.setattr(checkpoint._Manager, "_wait_for_checkpointers", slow)
    monkeypatch.setattr(checkpoint, "SAY_WAIT_AFTER_S", 0.1)
    with caplog.at_level(logging.INFO, logger="tunix_train"):
        save_steps(tmp_path, [2], make_mesh(8, 1))
    assert "waiting for the checkpoint of step 2 to be written (0 s)" in caplog.text
    assert_state_is(checkpoint.restore(tmp_path, abstract(make_mesh(8, 1)), CONFIG).state, 2)


def test_keep_deletes_the_oldest_only(tmp_path):
    save_steps(tmp_path, [2, 4, 6, 8], make_mesh(8, 1), keep=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6", "8"]


def largest_data_file(step_dir: Path) -> Path:
    """The biggest file of array data (OCDBT keeps it in `d/` directories)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_damaged_latest_step_falls_back_in_one_line_and_is_set_aside(tmp_path, caplog, damage):
    save_steps(tmp_path, [2, 4], make_mesh(8, 1))
    victim = largest_data_file(tmp_path / "checkpoints" / "4")
    if damage == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        victim.unlink()
    with caplog.at_level(logging.WARNING, logger="tunix_train"):
        restored = checkpoint.restore(tmp_path, abstract(make_mesh(8, 1)), CONFIG,
                                      set_aside_in=tmp_path)
    assert restored.step == 2
    assert_state_is(restored.state, 2)
    messages = [record.getMessage() for record in caplog.records]
    fallback = [m for m in messages if "falling back to step 2" in m]
    assert len(fallback) == 1 and "\n" not in fallback[0]
    assert checkpoint.own_checkpoints(tmp_path) and sorted(
        os.listdir(tmp_path / "checkpoints")) == ["2"]
    assert (tmp_path / "damaged_checkpoints" / "4" / "state").is_dir()  # moved, not deleted


def test_an_uncommitted_step_is_not_a_checkpoint(tmp_path):
    save_steps(tmp_path, [2], make_mesh(8, 1))
    # What a crash mid-save leaves: Orbax's temporary directory, never renamed to "4".
    partial = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp" / "state"
    partial.mkdir(parents=True)
    (partial / "_METADATA").write_text("{")
    assert checkpoint.restore(tmp_path, abstract(make_mesh(8, 1)), CONFIG).step == 2


def test_all_steps_damaged_is_a_config_error_and_nothing_moves(tmp_path):
    save_steps(tmp_path, [2], make_mesh(8, 1))
    os.truncate(largest_data_file(tmp_path / "checkpoints" / "2"), 10)
    with pytest.raises(ConfigError, match="no readable checkpoint"):
        checkpoint.restore(tmp_path, abstract(make_mesh(8, 1)), CONFIG, set_aside_in=tmp_path)
    assert (tmp_path / "checkpoints" / "2").is_dir()


def with_setting(section: str, key: str, value) -> dict:
    return {**CONFIG, section: {**CONFIG[section], key: value}}


def test_a_different_model_is_named_before_reading_arrays(tmp_path, monkeypatch):
    save_steps(tmp_path, [2], make_mesh(8, 1))
    narrower = abstract(make_mesh(8, 1))
    narrower["params"]["w"] = jax.ShapeDtypeStruct((256, 32), jnp.float32,
                                                   sharding=narrower["params"]["w"].sharding)
    read_arrays = []
    monkeypatch.setattr(ocp.args, "StandardRestore", lambda *a: read_arrays.append(a))
    with pytest.raises(ConfigError, match=r"\(model.embed_dim=128 there, 64 here\); nothing was "
                                          r"moved") as error:
        checkpoint.restore(tmp_path, narrower, with_setting("model", "embed_dim", 64),
                           set_aside_in=tmp_path)
    assert "init_params_from" not in str(error.value)  # the parameters do not fit either
    assert not read_arrays and sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]


def test_a_changed_optimizer_is_named_and_every_step_stays(tmp_path):
    """optimizer.grad_clip 1.0 -> 0 drops a leaf of the optimizer state: a changed config, not
    damage, so no step may be set aside."""
    save_steps(tmp_path, [2, 4], make_mesh(8, 1))
    target = abstract(make_mesh(8, 1))
    target["opt_state"]["nu"] = target["opt_state"]["mu"]
    with pytest.raises(ConfigError, match=r"\(optimizer.grad_clip=1.0 there, 0.0 here\); nothing "
                                          r"was moved.* checkpoint.init_params_from="):
        checkpoint.restore(tmp_path, target, with_setting("optimizer", "grad_clip", 0.0),
                           set_aside_in=tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    assert not (tmp_path / "damaged_checkpoints").exists()


def flaky_reads(monkeypatch, failures: int) -> list:
    """The first `failures` array reads fail as a storage hiccup would (EIO), not as damage."""
    calls, real = [], checkpoint._Manager.restore

    def restore(self, step, args=None):
        if "state" in args.keys():
            calls.append(step)
            if len(calls) <= failures:
                raise OSError(errno.EIO, "Input/output error")
        return real(self, step, args=args)

    monkeypatch.setattr(checkpoint._Manager, "restore", restore)
    monkeypatch.setattr(checkpoint_damage, "RETRY_PAUSE_S", 0.0)
    return calls


def test_a_transient_read_error_is_retried_and_moves_nothing(tmp_path, monkeypatch, caplog):
    save_steps(tmp_path, [2, 4], make_mesh(8, 1))
    calls = flaky_reads(monkeypatch, failures=1)
    with caplog.at_level(logging.WARNING, logger="tunix_train"):
        restored = checkpoint.restore(tmp_path, abstract(make_mesh(8, 1)), CONFIG,
                                      set_aside_in=tmp_path)
    assert restored.step == 4 and calls == [4, 4]
    assert_state_is(restored.state, 4)
    assert any("retrying" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]


def test_a_lasting_read_error_fails_loudly_and_moves_nothing(tmp_path, monkeypatch):
    save_steps(tmp_path, [2, 4], make_mesh(8, 1))
    calls = flaky_reads(monkeypatch, failures=100)
    with pytest.raises(StorageError, match=r"could not read checkpoint step 4 .* "
                                                      r"nothing was moved"):
        checkpoint.restore(tmp_path, abstract(make_mesh(8, 1)), CONFIG, set_aside_in=tmp_path)
    assert calls == [4] * checkpoint_damage.READ_ATTEMPTS  # never fell back to step 2
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    assert not (tmp_path / "damaged_checkpoints").exists()


def test_load_params_reads_only_params_from_a_step_dir(tmp_path):
    save_steps(tmp_path, [2, 4], make_mesh(4, 2))
    target = make_mesh(8, 1)
    state = abstract(target)
    params = checkpoint.load_params(tmp_path / "checkpoints" / "2", state["params"],
                                    shardings(target)["params"], CONFIG)
    assert set(params) == {"w", "b"}
    np.testing.assert_array_equal(params["w"], jax.device_get(make_state(2, target))["params"]["w"])
    assert params["w"].sharding == shardings(target)["params"]["w"]


def test_a_path_without_checkpoints_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="holds no committed checkpoint"):
        checkpoint.locate(tmp_path)


def test_non_finite_gradients_leave_params_and_moments_untouched():
    cfg = compose_config().optimizer
    optimizer = optim.adamw(cfg, total_steps=10)
    update = jax.jit(optimizer.update)  # one program, as in the train step, not op by op
    params = {"w": jnp.ones((4, 4)), "scale": jnp.ones(4)}
    opt_state = optimizer.init(params)
    good = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = update(good, opt_state, params)
    params = jax.tree.map(jnp.add, params, updates)
    bad = {"w": jnp.full((4, 4), jnp.nan), "scale": jnp.ones(4)}
    skipped_updates, skipped_state = update(bad, opt_state, params)
    assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(skipped_updates))
    assert int(optim.skipped_updates(skipped_state)) == 1
    before, after = opt_state.inner_state, skipped_state.inner_state
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_sigterm_is_a_stop_request_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionSignal() as preemption:
        assert not preemption.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.reached(2)
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("overrides,message", [
    (["checkpoint.resume_from=a", "checkpoint.init_params_from=b"], "are both set"),
    (["checkpoint.every_steps=-1"], "checkpoint.every_steps=-1 is out of range: it must be at least 0"),
    (["checkpoint.keep=0"], "checkpoint.keep=0 is out of range: it must be at least 1"),
])
def test_checkpoint_keys_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validation.validate(compose_config(*overrides))


def test_a_step_dir_means_that_step_and_a_temporary_dir_is_refused(tmp_path):
    save_steps(tmp_path, [2, 4], make_mesh(8, 1))
    assert checkpoint.locate(tmp_path / "checkpoints" / "2") == (tmp_path / "checkpoints", [2])
    assert checkpoint.locate(tmp_path) == (tmp_path / "checkpoints", [4, 2])
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp").mkdir()
    with pytest.raises(ConfigError, match="holds no committed checkpoint"):
        checkpoint.locate(tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp")


def test_an_error_that_is_not_storage_is_raised_at_once_and_never_called_storage(
        tmp_path, monkeypatch):
    """A bad argument (here Orbax's refusal of a relative path) is not a storage hiccup: no
    retries, no "check the storage" advice, nothing moved."""
    save_steps(tmp_path, [2, 4], make_mesh(8, 1))
    calls = []

    def restore(self, step, args=None):
        calls.append(step)
        raise ValueError("Checkpoint path should be absolute. Got outputs/run/checkpoints/4")

    monkeypatch.setattr(checkpoint._Manager, "restore", restore)
    with pytest.raises(ValueError, match="should be absolute"):
        checkpoint.restore(tmp_path, abstract(make_mesh(8, 1)), CONFIG, set_aside_in=tmp_path)
    assert calls == [4]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]


def test_a_write_future_failed_by_the_storage_says_nothing_when_collected(caplog):
    """A failed save is said in one sentence (test_resume's full disk); asyncio says each write
    future's unretrieved failure when the future is collected, which may be after that
    sentence: a storage failure's is not said, any other error's still is."""
    loop = asyncio.new_event_loop()
    failures = {"storage": ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0.0" in OCDBT '
                                      'database: No space left on device'),
                "other": KeyError("not the storage")}
    try:
        for error in failures.values():
            future = loop.create_future()
            future.set_exception(error)
            del future
            gc.collect()
    finally:
        loop.close()
    said = [r for r in caplog.records if r.name == "asyncio" and r.exc_info]
    assert [r.exc_info[1] for r in said] == [failures["other"]]
    assert "never retrieved" in said[0].getMessage()


def test_a_write_that_ends_after_its_failed_save_closed_the_loop_says_nothing():
    """A failed save closes Orbax's event loop with tensorstore writes still running; each that
    ends later calls the closed loop from tensorstore's thread, and Python prints that error
    as unraisable, in no order with the failure's one sentence (test_resume's full disk: 39
    tracebacks). With tunix_train.checkpoint imported it is not said; any other unraisable
    error still is. A process of its own: pytest swaps sys.unraisablehook around each test."""
    script = textwrap.dedent("""
        import asyncio, time
        import tensorstore as ts
        import tunix_train.checkpoint
        promise, write = ts.Promise.new()
        loop = asyncio.new_event_loop()
        async def start():
            async def wait():
                return await write
            return loop.create_task(wait())
        loop.run_until_complete(start())
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
        promise.set_result(1)  # tensorstore calls the closed loop
        time.sleep(0.2)
        class Noisy:
            def __del__(self):
                raise KeyError("not a late write")
        Noisy()
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Event loop is closed" not in result.stderr, result.stderr[-2000:]
    assert "KeyError: 'not a late write'" in result.stderr


def test_a_relative_checkpoint_path_means_one_under_the_current_directory(tmp_path,
                                                                          monkeypatch):
    save_steps(tmp_path / "outputs" / "run", [2], make_mesh(8, 1))
    monkeypatch.chdir(tmp_path)
    restored = checkpoint.restore("outputs/run", abstract(make_mesh(8, 1)), CONFIG)
    assert restored.step == 2 and restored.path == tmp_path / "outputs/run/checkpoints/2"


def test_a_restore_still_running_is_said(tmp_path, monkeypatch, caplog):
    """A run's restore (Setup.initial_state) says what it waits on while it lasts (slowed here to
    0.5 s, said after 0.1 s): reading a large checkpoint takes minutes, and in a job of several
    processes each waits inside it for the others."""
    from tunix_train.training import setup as setup_lib

    restored = checkpoint.Restored(2, {"params": "restored"}, {"next_step": 2}, tmp_path / "2")
    monkeypatch.setattr(setup_lib.checkpoint, "own_checkpoints", lambda run_dir: tmp_path)
    monkeypatch.setattr(setup_lib.checkpoint, "restore",
                        lambda *args, **kwargs: time.sleep(0.5) or restored)
    monkeypatch.setattr(setup_lib, "RESTORE_SAID_AFTER_S", 0.1)
    positions = []
    data = type("Data", (), {"set_state": lambda self, state: positions.append(state)})()
    setup = setup_lib.Setup.create(compose_config(), jax.devices()[:1])
    with caplog.at_level(logging.WARNING, logger="tunix_train"):
        assert setup.initial_state(tmp_path, data) == restored.state
    assert f"waiting for the restore from {tmp_path} to finish (0 s)" in caplog.text
    assert positions == [{"next_step": 2}]


def test_what_the_watchdog_does_not_time_it_says(caplog):
    """The first step's compilation and a named pause (an evaluation) are not timed by
    distributed.step_timeout_s, but said every say_every_s (0.2 s here) while they last, so a
    hang there is not silent; a beat or the pause's end stops the lines, and nothing trips."""
    from tunix_train.training.watchdog import Watchdog

    def said(pause_s: float) -> list[str]:
        caplog.clear()
        time.sleep(pause_s)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]

    with caplog.at_level(logging.WARNING, logger="tunix_train"), Watchdog(5, 3, 0.2) as dog:
        lines = said(0.5)
        assert lines and all(line.startswith(
            "waiting for step 3's batch and compilation, not timed by distributed.step_timeout_s"
            " (") for line in lines)
        dog.beat(3)
        assert said(0.5) == []
        with dog.paused("the evaluation at step 3 to finish"):
            assert said(0.5)[0].startswith("waiting for the evaluation at step 3 to finish, not")
        with dog.paused():  # a save: it says its own waits
            assert said(0.5) == []
        assert said(0.5) == []
