"""Never lose a run, through the real CLI in subprocesses: exact resume after SIGTERM (also onto
another mesh), SIGKILL mid-save and at random moments, a damaged latest step, a changed config,
NaN halt/skip, the hang watchdog, fine-tuning from another run, and checkpoints that plain Orbax
reads on another device count.

Faults are injected through tests/faulty_training.py (run_training.py with tests/faults.py's
hooks); run_training.py itself has no way to switch them on.

Every run is compared with one uninterrupted reference run (fp32, CPU, same global batch).
All 1-device runs compile the same programs, so the suite's persistent compilation cache
(tests/conftest.py) makes every run after the first cost only its start-up.
"""

import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from faults import ENV as FAULTS
from helpers import ONE_STACK, REPO, cli_env, mesh_arg, run_cli, sigterm_when_paused
from tunix_train import checkpoint

pytestmark = pytest.mark.slow
STEPS = 10
# One stack of Gemma 3 layers (helpers.ONE_STACK): these tests' subject is the run's state on
# disk and its restarts, not the layer kinds, and each of the file's ~28 commands traces and
# lowers one scanned body instead of TINY's three.
BASE = [*ONE_STACK, f"training.steps={STEPS}", "training.global_batch_size=8",
        "logging.every_steps=1", "data.eval_batches=1"]
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


FAULTY = "tests/faulty_training.py"


def train(run_dir: Path, *overrides: str, env: dict | None = None, expect: int = 0,
          faults: dict | None = None, with_stderr: bool = False) -> str:
    """A run of run_training.py, or with `faults` of tests/faulty_training.py."""
    env = {**(env or {}), **({FAULTS: json.dumps(faults)} if faults else {})}
    result = run_cli([*BASE, *overrides, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                     env_extra=env, script=FAULTY if faults else "run_training.py")
    output = result.stdout + result.stderr
    assert result.returncode == expect, output[-4000:]
    return result.stderr if with_stderr else output


def preempt(run_dir: Path, at_step: int, *overrides: str, env: dict | None = None) -> str:
    """A run paused after step `at_step` gets SIGTERM, then goes on: helpers.sigterm_when_paused."""
    return sigterm_when_paused([*BASE, *overrides, f"hydra.run.dir={run_dir}"], run_dir.parent,
                               at_step, env, timeout=120)


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss by step; a later record of the same step wins."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def records(run_dir: Path, key: str) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}


def committed(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def plain_orbax_state(step_dir: Path) -> dict:
    import orbax.checkpoint as ocp  # Orbax alone: no tunix_train code reads these checkpoints

    return ocp.StandardCheckpointer().restore(step_dir / "state")


def read_with_plain_orbax_on_one_device(step_dir: Path) -> None:
    """docs/checkpointing.md's recipe, run as shown in a 1-device process on a checkpoint saved
    by 8 devices, reads exactly what Orbax reads on the saving topology."""
    page = (REPO / "docs" / "checkpointing.md").read_text()
    [recipe] = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "metadata" in b]
    recipe = re.sub(r'path = .*', f'path = "{step_dir / "state"}"', recipe)
    recipe += "\nimport numpy as np\nnp.save('params.npy', np.asarray(jax.device_get(" \
              "state['params']['embedder']['embedding'])))\nprint(len(jax.devices()))\n"
    result = subprocess.run([sys.executable, "-c", recipe], cwd=step_dir.parent.parent,
                            env=cli_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["1"]
    want = plain_orbax_state(step_dir)  # this process has the 8 devices that saved it
    np.testing.assert_array_equal(np.load(step_dir.parent.parent / "params.npy"),
                                  want["params"]["embedder"]["embedding"])


# What a stray variable in a user's shell could try: run_training.py must ignore all of it.
STRAY = {FAULTS: json.dumps({"nan_at_step": 3, "kill_at_step": 5}),
         "TUNIX_TRAIN_FAULTS": json.dumps({"nan_at_step": 3, "kill_in_save_at_step": 4})}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run: 10 steps, checkpoints every 2 (all kept), with fault variables in
    its environment that run_training.py must not read."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    output = train(run_dir, "checkpoint.every_steps=2", "checkpoint.keep=5",
                   env=STRAY)
    assert committed(run_dir) == [2, 4, 6, 8, 10]
    assert "fault injection" not in output
    assert all(np.isfinite(list(losses(run_dir).values())))
    return run_dir


def test_fault_variables_have_no_effect_on_run_training(reference):
    assert sorted(losses(reference)) == list(range(1, STEPS + 1))  # no kill, no NaN, no skip
    assert records(reference, "skipped_steps")[STEPS] == 0


def assert_bitwise(run_dir: Path, reference: Path, steps) -> None:
    got, want = losses(run_dir), losses(reference)
    assert [got[s] for s in steps] == [want[s] for s in steps]


def test_sigterm_then_restart_gives_the_uninterrupted_losses_bitwise(reference, tmp_path):
    run_dir = tmp_path / "run"
    # Step 4 is also an evaluation step: the grace period is for saving, not evaluating.
    output = preempt(run_dir, 4, "training.eval_every_steps=4")
    assert "SIGTERM received" in output and max(losses(run_dir)) == 4
    assert "validation loss" not in output.split("SIGTERM received")[1]
    assert committed(run_dir) == [4]  # saved on the way out, and only then
    # Said as typed from where it started (the run dir's parent): the step and how to resume.
    assert f"stopped after step 4 of {STEPS}; checkpoint: run/checkpoints/4" in output
    [resume] = [line for line in output.splitlines() if "resume:   " in line]
    assert resume.endswith(f"training.steps={STEPS} hydra.run.dir=run")
    output = train(run_dir)
    assert "resuming from step 4" in output
    assert_bitwise(run_dir, reference, range(5, STEPS + 1))


def test_offloaded_parameters_and_moments_sigterm_then_restart_bitwise(reference, tmp_path):
    """Parameters and moments in pinned host memory: saved from there on SIGTERM and restored
    there, the resumed run gives the uninterrupted offloaded run's losses bitwise, and both the
    losses of the run with everything on the device (1e-6)."""
    offloaded = ["training.offload_params=true", "training.offload_optimizer=true"]
    whole, run_dir = tmp_path / "whole", tmp_path / "run"
    train(whole, *offloaded)
    preempt(run_dir, 4, *offloaded)
    assert committed(run_dir) == [4]
    assert "resuming from step 4" in train(run_dir, *offloaded)
    assert_bitwise(run_dir, whole, range(1, STEPS + 1))
    got, want = losses(run_dir), losses(reference)
    np.testing.assert_allclose([got[s] for s in range(1, STEPS + 1)],
                               [want[s] for s in range(1, STEPS + 1)], rtol=1e-6)


@pytest.mark.parametrize("saved,resumed,mesh", [
    (mesh_arg(4, 2), mesh_arg(8, 1), "fsdp=8 × tp=1"),
    # State sharded over fsdp × cp (ZeRO over both), resumed with sequences split 4 ways.
    ('model.mesh_shape=[[2,2,2],["fsdp","cp","tp"]]',
     'model.mesh_shape=[[1,4,2],["fsdp","cp","tp"]]', "fsdp=1 × cp=4 × tp=2"),
], ids=["fsdp4_tp2_to_fsdp8", "cp2_to_cp4"])
def test_saved_on_one_mesh_resumed_on_another_with_another_zero_stage(saved, resumed, mesh,
                                                                      reference,
                                                                      tmp_path):
    run_dir, env = tmp_path / "run", EIGHT_DEVICES
    preempt(run_dir, 4, saved, env=env)
    read_with_plain_orbax_on_one_device(run_dir / "checkpoints" / "4")
    output = train(run_dir, resumed, "training.zero_stage=1", env=env)
    assert "resuming from step 4" in output and f"mesh: {mesh}" in output
    got, want = losses(run_dir), losses(reference)
    steps = range(5, STEPS + 1)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


def test_sigkill_during_a_save_resumes_from_the_previous_complete_step(reference, tmp_path):
    run_dir = tmp_path / "run"
    # keep=1: had Orbax deleted step 2 before step 4 committed, nothing would be left.
    args = ("checkpoint.every_steps=2", "checkpoint.keep=1")
    faults = {"kill_in_save_at_step": 4, "save_dir": str(run_dir / "checkpoints")}
    train(run_dir, *args, faults=faults, expect=-signal.SIGKILL)
    assert committed(run_dir) == [2]
    assert list((run_dir / "checkpoints").glob("4.*")), "step 4's save was not in flight"
    output = train(run_dir, *args)
    assert "resuming from step 2" in output
    assert_bitwise(run_dir, reference, range(3, STEPS + 1))
    assert committed(run_dir) == [STEPS]


def test_a_damaged_latest_step_falls_back_with_one_warning(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "metrics.jsonl").unlink()  # so every loss below comes from the resumed run
    victim = largest_data_file(run_dir / "checkpoints" / "10")
    os.truncate(victim, victim.stat().st_size // 2)
    output = train(run_dir, "checkpoint.every_steps=2")
    warnings = [line for line in output.splitlines() if "falling back to step 8" in line]
    assert len(warnings) == 1 and "checkpoint step 10" in warnings[0]
    assert "resuming from step 8" in output
    assert_bitwise(run_dir, reference, [9, 10])
    assert (run_dir / "damaged_checkpoints" / "10").is_dir()


def on_a_small_disk(tmp_path: Path, size: int, *overrides: str) -> tuple[int, str, Path]:
    """run_training.py with its run dir on a disk of `size` bytes (a tmpfs mounted in a mount
    namespace of its own: no root needed, nothing left mounted), which it may fill. Returns
    the exit code, stderr and the run dir as it was left (copied off that disk)."""
    disk, run_dir = tmp_path / "disk", tmp_path / "run"
    disk.mkdir()
    command = shlex.join([sys.executable, str(REPO / "run_training.py"), *BASE, *overrides,
                          f"hydra.run.dir={disk / 'run'}"])
    script = (f"mount -t tmpfs -o size={size} tmpfs {disk} || exit 90; {command}; rc=$?; "
              f"cp -a {disk / 'run'} {run_dir}; exit $rc")
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                             script], cwd=tmp_path, env=cli_env(), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 90, result.stderr[-2000:]
    return result.returncode, result.stderr, run_dir


def one_checkpoint(reference: Path) -> tuple[int, int]:
    """(bytes of a checkpoint's arrays, uncompressed; bytes one takes on disk)."""
    step_dir = reference / "checkpoints" / "2"
    on_disk = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    return checkpoint.saved_bytes(plain_orbax_state(step_dir)), on_disk


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def test_a_disk_too_small_for_one_checkpoint_is_refused_before_compiling(reference, tmp_path):
    arrays, _ = one_checkpoint(reference)
    code, stderr, run_dir = on_a_small_disk(tmp_path, arrays // 2)
    [sentence] = error_lines(stderr)
    assert code == 6 and "Traceback" not in stderr, stderr[-3000:]
    assert f"{tmp_path / 'disk' / 'run' / 'checkpoints'} has " in sentence
    assert f"takes up to {arrays / 1e9:.3g} GB" in sentence and "hydra.run.dir" in sentence
    assert "compil" not in stderr and not (run_dir / "metrics.jsonl").exists()


def test_a_disk_that_fills_stops_with_the_last_step_intact_and_the_run_goes_on(reference,
                                                                               tmp_path):
    """Room for the first checkpoint (every 2 steps, none deleted) and half the second: step
    4's save fails on a full disk; the run stops (exit 6) with one sentence, and step 2 is
    whole: given room, the same command goes on from it to the uninterrupted run's losses."""
    arrays, on_disk = one_checkpoint(reference)
    args = ("checkpoint.every_steps=2", "checkpoint.keep=5")
    code, stderr, run_dir = on_a_small_disk(tmp_path, max(arrays, on_disk) + on_disk // 2,
                                            *args)
    [sentence] = error_lines(stderr)
    assert code == 6 and stderr.strip().splitlines()[-1] == sentence, stderr[-3000:]
    # Neither Orbax's logged tracebacks nor Hydra's, nor tensorstore's writes calling the event
    # loop Orbax closed on the first failed write (test_checkpoint).
    assert "Traceback" not in stderr and "raised an exception" not in stderr, stderr[-3000:]
    assert "Error executing job" not in stderr
    assert "could not save checkpoint step 4 in " in sentence and "No space left" in sentence
    assert "the newest saved step, 2, is intact" in sentence
    assert committed(run_dir) == [2]
    output = train(run_dir, *args)
    assert "resuming from step 2" in output
    assert_bitwise(run_dir, reference, range(3, STEPS + 1))
    assert not list((run_dir / "checkpoints").glob("*tmp*"))  # the half-written step is gone


def test_nan_halt_exits_nonzero_naming_the_step_and_keeps_good_checkpoints(reference,
                                                                           tmp_path):
    run_dir = tmp_path / "run"
    output = train(run_dir, "checkpoint.every_steps=2", faults={"nan_at_step": 6},
                   expect=3)
    assert "non-finite loss or gradients at step 6" in output and "Traceback" not in output
    assert committed(run_dir) == [2, 4]  # step 6's checkpoint was refused
    # Intact: step 4 is, array for array, the uninterrupted run's step 4.
    saved, clean = (plain_orbax_state(d / "checkpoints" / "4") for d in (run_dir, reference))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(clean), strict=True):
        np.testing.assert_array_equal(a, b)


def test_nan_halt_stops_within_one_step_between_logging_steps(tmp_path):
    run_dir = tmp_path / "run"
    output = train(run_dir, "logging.every_steps=50",
                   faults={"nan_at_step": 6, "log_steps": True}, expect=3)
    assert "non-finite loss or gradients at step 6" in output
    dispatched = [int(m) for m in re.findall(r"fault injection: step (\d+) dispatched", output)]
    assert 6 <= max(dispatched) <= 7
    assert not (run_dir / "checkpoints").exists() or committed(run_dir) == []


def test_a_changed_optimizer_setting_is_named_and_no_checkpoint_moves(reference,
                                                                      tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    stderr = train(run_dir, "optimizer.grad_clip=0", expect=2, with_stderr=True)
    assert "optimizer.grad_clip=1.0 there, 0.0 here" in stderr and "nothing was moved" in stderr
    assert "Traceback" not in stderr and "damaged" not in stderr
    assert committed(run_dir) == [2, 4, 6, 8, 10]
    assert not (run_dir / "damaged_checkpoints").exists()


def test_nan_skip_finishes_and_counts_the_skipped_step(reference, tmp_path):
    run_dir = tmp_path / "run"
    output = train(run_dir, "training.nan_policy=skip", faults={"nan_at_step": 6})
    assert "step 6: non-finite loss or gradients, update skipped (1 skipped so far)" in output
    skipped = records(run_dir, "skipped_steps")
    assert [skipped[s] for s in range(1, STEPS + 1)] == [0] * 5 + [1] * 5
    got = losses(run_dir)
    assert np.isnan(got[6]) and all(np.isfinite(got[s]) for s in range(7, STEPS + 1))
    assert_bitwise(run_dir, reference, range(1, 6))


def test_a_hung_step_trips_the_watchdog_with_every_threads_stack(tmp_path):
    run_dir, timeout_s = tmp_path / "run", 3
    output = train(run_dir, f"distributed.step_timeout_s={timeout_s}",
                   faults={"hang_at_step": 3}, expect=4)
    assert "fault injection: hanging after step 3" in output
    log = (run_dir / "train.log").read_text()
    assert "step 4 has not finished after" in log and "distributed.step_timeout_s=3" in log
    assert 'Thread "MainThread"' in log and "in _hang" in log


def test_plain_orbax_restores_the_parameter_tree(reference):
    state = plain_orbax_state(reference / "checkpoints" / "10")
    assert int(state["step"]) == 10
    assert state["params"]["embedder"]["embedding"].shape == (512, 64)
    assert {"trailing_layers", "final_norm"} <= set(state["params"])
    assert state["params"]["trailing_layers"]["mlp"]["up"].shape[0] == 4  # the stack's layers


def test_init_params_from_fine_tunes_from_the_parameters_only(reference, tmp_path):
    run_dir = tmp_path / "run"
    output = train(run_dir, f"checkpoint.init_params_from={reference}")
    assert f"parameters from {reference}" in output
    # Before its first update the fine-tune evaluates exactly the reference's final parameters.
    assert records(run_dir, "eval_loss")[0] == records(reference, "eval_loss")[STEPS]
    assert min(losses(run_dir)) == 1  # step and optimizer state started afresh


def test_resume_from_a_step_dir_of_another_run(reference, tmp_path):
    run_dir = tmp_path / "run"
    output = train(run_dir, f"checkpoint.resume_from={reference}/checkpoints/6")
    assert "resuming from step 6" in output
    assert sorted(losses(run_dir)) == list(range(7, STEPS + 1))
    assert_bitwise(run_dir, reference, range(7, STEPS + 1))


def test_crash_soak_sigkill_at_five_random_moments_then_bitwise_the_uninterrupted_run(
        reference, tmp_path):
    """SIGKILL while a step runs or while a save is in flight, at 5 moments drawn at random (at
    increasing steps, so that every restart gets there); each restart must resume from the last
    committed step, and the finished run must equal the uninterrupted one bit for bit."""
    rng = random.Random(7)
    run_dir, args = tmp_path / "run", ("checkpoint.every_steps=2", "checkpoint.keep=5")
    steps = sorted(rng.sample(range(1, STEPS + 1), 5))
    kills = [{"kill_in_save_at_step": s} if s % 2 == 0 and rng.random() < 0.5 else
             {"kill_at_step": s} for s in steps]
    assert {k for kill in kills for k in kill} == {"kill_at_step", "kill_in_save_at_step"}
    for kill in [*kills, None]:
        last = max(committed(run_dir)) if (run_dir / "checkpoints").is_dir() and committed(
            run_dir) else None
        output = train(run_dir, *args, faults=kill,
                       expect=-signal.SIGKILL if kill else 0)
        resumed = re.findall(r"resuming from step (\d+)", output)
        assert resumed == ([str(last)] if last else []), (kill, last, resumed)
    assert committed(run_dir)[-1] == STEPS
    assert_bitwise(run_dir, reference, range(1, STEPS + 1))
    final, clean = (plain_orbax_state(d / "checkpoints" / str(STEPS)) for d in (run_dir, reference))
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(clean), strict=True):
        np.testing.assert_array_equal(a, b)
