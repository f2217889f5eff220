"""`python run_training.py` as a user runs it, in a subprocess."""

import json

import pytest

from helpers import TINY, mesh_arg, run_cli

pytestmark = pytest.mark.slow
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def test_a_short_run_leaves_log_metrics_config_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli([*TINY, "training.steps=4", "logging.every_steps=2",
                      f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (run_dir / "train.log").read_text()
    assert "micro_batch 8 × fsdp 1 × accumulation 1 = 8 sequences" in log
    assert "final validation loss" in log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(train[0])
    assert any("eval_loss" in r for r in records)
    assert (run_dir / ".hydra" / "config.yaml").exists()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [2, 4]
    assert losses[0].value == pytest.approx(train[0]["loss"], rel=1e-6)


def test_default_run_dir_is_outputs_experiment_date_time(tmp_path):
    result = run_cli([*TINY, "training.steps=1", "experiment.name=smoke"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dirs = list((tmp_path / "outputs" / "smoke").glob("*-*-*/*-*-*"))
    assert len(run_dirs) == 1 and (run_dirs[0] / "train.log").exists()


@pytest.mark.parametrize("overrides,message", [
    ([mesh_arg(4, 1)], "needs 4 × 1 = 4 devices but 8 are available"),
    ([mesh_arg(2, 4), "model.num_heads=6", "model.num_kv_heads=1"],
     "model.num_heads=6 is not divisible by tp=4"),
    ([mesh_arg(8, 1), "training.global_batch_size=12"],
     "training.global_batch_size=12 does not divide over fsdp=8"),
    (["data.seq_len=0"], "data.seq_len must be positive"),
])
def test_bad_input_is_one_sentence_and_a_nonzero_exit(tmp_path, overrides, message):
    result = run_cli([*TINY, *overrides, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path,
                     env_extra=EIGHT_DEVICES)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert message in output
    assert "Traceback" not in output


def test_unknown_model_name_fails_with_the_available_ones(tmp_path):
    result = run_cli(["model=gemma3_2b", f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path)
    assert result.returncode != 0
    assert "Could not find 'model/gemma3_2b'" in result.stderr
    assert "gemma3_1b" in result.stderr  # Hydra lists the available options
