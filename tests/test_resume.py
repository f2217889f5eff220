"""Never lose a run, through the real CLI in subprocesses: exact resume after SIGTERM (also onto
another mesh), SIGKILL mid-save, a damaged latest step, NaN halt/skip, the hang watchdog,
fine-tuning from another run, and checkpoints that plain Orbax reads.

Every run is compared with one uninterrupted reference run (fp32, CPU, same global batch).
All 1-device runs compile the same programs, so a shared persistent compilation cache makes
every run after the first cost only its start-up.
"""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import TINY, mesh_arg, run_cli, start_cli
from tunix_train.training.faults import ENV as FAULTS

pytestmark = pytest.mark.slow
STEPS = 10
BASE = [*TINY, f"training.steps={STEPS}", "training.global_batch_size=8", "logging.every_steps=1",
        "data.eval_batches=1"]
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict:
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache"))}


def train(run_dir: Path, *overrides: str, env: dict, expect: int = 0) -> str:
    result = run_cli([*BASE, *overrides, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent,
                     env_extra=env)
    output = result.stdout + result.stderr
    assert result.returncode == expect, output[-4000:]
    return output


def preempt(run_dir: Path, after_step: int, *overrides: str, env: dict) -> str:
    """Starts a run and sends it SIGTERM once `after_step` is logged; it must exit 0."""
    slow = {**env, FAULTS: json.dumps({"step_delay_s": 0.3})}  # time for the signal to land
    process = start_cli([*BASE, *overrides, f"hydra.run.dir={run_dir}"], run_dir.parent, slow)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if f"step {after_step}/{STEPS} |" in line:
            process.send_signal(signal.SIGTERM)
    output = "".join(lines)
    assert process.wait(timeout=60) == 0, output[-4000:]
    return output


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


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> Path:
    """The uninterrupted run: 10 steps, checkpoints every 2 (all kept)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    train(run_dir, "checkpoint.every_steps=2", "checkpoint.keep=5", env=cache)
    assert committed(run_dir) == [2, 4, 6, 8, 10]
    return run_dir


def assert_bitwise(run_dir: Path, reference: Path, steps) -> None:
    got, want = losses(run_dir), losses(reference)
    assert [got[s] for s in steps] == [want[s] for s in steps]


def test_sigterm_then_restart_gives_the_uninterrupted_losses_bitwise(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    output = preempt(run_dir, 4, env=cache)
    stopped = max(losses(run_dir))
    assert "SIGTERM received" in output and 5 <= stopped < STEPS
    assert committed(run_dir) == [stopped]  # saved on the way out, and only then
    output = train(run_dir, env=cache)
    assert f"resuming from step {stopped}" in output
    assert_bitwise(run_dir, reference, range(5, STEPS + 1))


def test_saved_on_4x2_resumed_on_8x1_with_another_zero_stage(reference, cache, tmp_path):
    run_dir, env = tmp_path / "run", {**cache, **EIGHT_DEVICES}
    preempt(run_dir, 4, mesh_arg(4, 2), env=env)
    stopped = max(losses(run_dir))
    output = train(run_dir, mesh_arg(8, 1), "training.zero_stage=1", env=env)
    assert f"resuming from step {stopped}" in output and "mesh: fsdp=8 × tp=1" in output
    got, want = losses(run_dir), losses(reference)
    steps = range(5, STEPS + 1)
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=1e-5)


def test_sigkill_during_a_save_resumes_from_the_previous_complete_step(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    # keep=1: had Orbax deleted step 2 before step 4 committed, nothing would be left.
    args = ("checkpoint.every_steps=2", "checkpoint.keep=1")
    kill = {**cache, FAULTS: json.dumps({"kill_in_save_at_step": 4})}
    train(run_dir, *args, env=kill, expect=-signal.SIGKILL)
    assert committed(run_dir) == [2]
    assert list((run_dir / "checkpoints").glob("4.*")), "step 4's save was not in flight"
    output = train(run_dir, *args, env=cache)
    assert "resuming from step 2" in output
    assert_bitwise(run_dir, reference, range(3, STEPS + 1))
    assert committed(run_dir) == [STEPS]


def test_a_damaged_latest_step_falls_back_with_one_warning(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "metrics.jsonl").unlink()  # so every loss below comes from the resumed run
    victim = largest_data_file(run_dir / "checkpoints" / "10")
    os.truncate(victim, victim.stat().st_size // 2)
    output = train(run_dir, "checkpoint.every_steps=2", env=cache)
    warnings = [line for line in output.splitlines() if "falling back to step 8" in line]
    assert len(warnings) == 1 and "checkpoint step 10" in warnings[0]
    assert "resuming from step 8" in output
    assert_bitwise(run_dir, reference, [9, 10])
    assert (run_dir / "damaged_checkpoints" / "10").is_dir()


def test_nan_halt_exits_nonzero_naming_the_step_and_keeps_good_checkpoints(reference, cache,
                                                                           tmp_path):
    run_dir = tmp_path / "run"
    poisoned = {**cache, FAULTS: json.dumps({"nan_at_step": 6})}
    output = train(run_dir, "checkpoint.every_steps=2", env=poisoned, expect=3)
    assert "non-finite loss or gradients at step 6" in output and "Traceback" not in output
    assert committed(run_dir) == [2, 4]  # step 6's checkpoint was refused
    # Intact: step 4 is, array for array, the uninterrupted run's step 4.
    saved, clean = (plain_orbax_state(d / "checkpoints" / "4") for d in (run_dir, reference))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(clean), strict=True):
        np.testing.assert_array_equal(a, b)


def test_nan_skip_finishes_and_counts_the_skipped_step(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    poisoned = {**cache, FAULTS: json.dumps({"nan_at_step": 6})}
    output = train(run_dir, "training.nan_policy=skip", env=poisoned)
    assert "step 6: non-finite loss or gradients, update skipped (1 skipped so far)" in output
    skipped = records(run_dir, "skipped_steps")
    assert [skipped[s] for s in range(1, STEPS + 1)] == [0] * 5 + [1] * 5
    got = losses(run_dir)
    assert np.isnan(got[6]) and all(np.isfinite(got[s]) for s in range(7, STEPS + 1))
    assert_bitwise(run_dir, reference, range(1, 6))


def test_a_hung_step_trips_the_watchdog_with_every_threads_stack(cache, tmp_path):
    run_dir, timeout_s = tmp_path / "run", 3
    hang = {**cache, FAULTS: json.dumps({"hang_at_step": 3})}
    process = start_cli([*BASE, f"distributed.step_timeout_s={timeout_s}",
                         f"hydra.run.dir={run_dir}"], tmp_path, hang)
    lines, hung_at = [], None
    for line in process.stdout:
        lines.append(line)
        if "fault injection: hanging after step 3" in line:
            hung_at = time.monotonic()
    assert process.wait(timeout=60) == 4, "".join(lines)[-4000:]
    assert hung_at is not None and time.monotonic() - hung_at < timeout_s + 5
    log = (run_dir / "train.log").read_text()
    assert "step 4 has not finished after" in log and "distributed.step_timeout_s=3" in log
    assert 'Thread "MainThread"' in log and "in _hang" in log


def test_plain_orbax_restores_the_parameter_tree(reference):
    state = plain_orbax_state(reference / "checkpoints" / "10")
    assert int(state["step"]) == 10
    assert state["params"]["embedder"]["embedding"].shape == (512, 64)
    assert {"local_layers", "global_layers", "final_norm"} <= set(state["params"])


def test_init_params_from_fine_tunes_from_the_parameters_only(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    output = train(run_dir, f"checkpoint.init_params_from={reference}", env=cache)
    assert f"parameters from {reference}" in output
    # Before its first update the fine-tune evaluates exactly the reference's final parameters.
    assert records(run_dir, "eval_loss")[0] == records(reference, "eval_loss")[STEPS]
    assert min(losses(run_dir)) == 1  # step and optimizer state started afresh


def test_resume_from_a_step_dir_of_another_run(reference, cache, tmp_path):
    run_dir = tmp_path / "run"
    output = train(run_dir, f"checkpoint.resume_from={reference}/checkpoints/6", env=cache)
    assert "resuming from step 6" in output
    assert sorted(losses(run_dir)) == list(range(7, STEPS + 1))
    assert_bitwise(run_dir, reference, range(7, STEPS + 1))
