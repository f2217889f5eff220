"""`python run_training.py` as a user runs it, in a subprocess."""

import json
import subprocess
import sys

import pytest

from helpers import ONE_STACK, cli_env, mesh_arg, run_cli

pytestmark = pytest.mark.slow
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
# The commands' subject is the command (its files, messages and exit codes), not Gemma's layer
# kinds: one stack of layers (helpers.ONE_STACK), whose step traces and compiles in half the time.


def test_a_short_run_leaves_log_metrics_config_and_tensorboard(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli([*ONE_STACK, "training.steps=4", "logging.every_steps=2",
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


def test_a_run_ends_by_saying_where_it_is_and_a_finished_run_is_not_redone(tmp_path):
    args = [*ONE_STACK, "training.steps=2", "logging.every_steps=1", "hydra.run.dir=run"]
    first = run_cli(args, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "finished step 2 of 2; run dir: run" in first.stdout
    assert ("generate: python -m tunix_train.generate checkpoint.resume_from=run "
            "'generate.prompt=\"...\"'") in first.stdout
    [resume] = [line for line in first.stdout.splitlines() if "continue: " in line]
    assert resume.split("continue: ")[1].startswith("python run_training.py model.num_layers=7")
    assert resume.endswith("training.steps=4 hydra.run.dir=run")
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = run_cli(args, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "run is already complete: its checkpoint of step 2 reaches training.steps=2" in \
        again.stdout
    assert "compiled" not in again.stdout and "devices:" not in again.stdout
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics  # no duplicate record
    # Asked for fewer steps than the checkpoint holds: going on means past step 2.
    fewer = run_cli([*args[:-2], "training.steps=1", "hydra.run.dir=run"], cwd=tmp_path)
    assert "its checkpoint of step 2 reaches training.steps=1" in fewer.stdout
    assert "training.steps=4 hydra.run.dir=run" in fewer.stdout.split("continue: ")[1]


def test_tensorboard_is_written_without_importing_what_tensorboardx_would_not_use(tmp_path):
    """metrics._summary_writer keeps torch, google.cloud.storage and boto3 out of a run's
    start-up (seconds of imports for torch tensors and gs:// or s3:// folders) and leaves
    them importable afterwards."""
    script = """if True:
        import json, sys
        from tunix_train.training import metrics
        writer = metrics._summary_writer()(sys.argv[1])
        writer.add_scalar("x", 1.0, 0)
        writer.close()
        # Imported, or still blocked (a None entry): neither may be left.
        print(json.dumps([n for n in metrics._UNUSED_BY_TENSORBOARDX if n in sys.modules]))"""
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "tb")],
                            env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_every_entry_point_collects_garbage_less_often_before_its_work(repo):
    """Each command starts with tunix_train/gc_policy.py's thresholds and its imports frozen
    out of full collections: run here as `__main__` with a bad argument, each exits before any
    work, the policy already set (CPython's defaults restored before each)."""
    script = """if True:
        import gc, json, runpy, sys
        seen = {}
        for entry, run in [("run_training.py", runpy.run_path),
                           ("tunix_train.plan", runpy.run_module),
                           ("tunix_train.generate", runpy.run_module),
                           ("tunix_train.export", runpy.run_module)]:
            gc.unfreeze()
            gc.set_threshold(700, 10, 10)
            sys.argv = [entry, "no_such_key=1"]
            try:
                run(entry, run_name="__main__")
            except SystemExit as exit:
                seen[entry] = [exit.code, gc.get_threshold(), gc.get_freeze_count() > 0]
        print(json.dumps(seen))"""
    result = subprocess.run([sys.executable, "-c", script], cwd=repo, env=cli_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    from tunix_train import gc_policy

    policy = [gc_policy.YOUNG, gc_policy.OLDER, gc_policy.OLDER]
    assert json.loads(result.stdout.splitlines()[-1]) == {
        entry: [2, policy, True] for entry in ("run_training.py", "tunix_train.plan",
                                                "tunix_train.generate", "tunix_train.export")}


def test_a_run_dir_that_cannot_be_made_is_one_sentence_and_exit_2(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    result = run_cli([*ONE_STACK, "hydra.run.dir=notes.txt/run"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"{result.stderr.split('error: ')[0]}error: hydra.run.dir=notes.txt/run cannot be created "
        f"(Not a directory at notes.txt/run); give a directory you can write to."]


def test_default_run_dir_is_outputs_experiment_date_time(tmp_path):
    result = run_cli([*ONE_STACK, "training.steps=1", "experiment.name=smoke"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dirs = list((tmp_path / "outputs" / "smoke").glob("*-*-*/*-*-*"))
    assert len(run_dirs) == 1 and (run_dirs[0] / "train.log").exists()


@pytest.mark.parametrize("overrides,message", [
    ([mesh_arg(4, 1)], "needs 4 × 1 = 4 devices but 8 are available"),
    ([mesh_arg(2, 4), "model.num_heads=6", "model.num_kv_heads=1"],
     "model.num_heads=6 is not divisible by tp=4"),
    ([mesh_arg(8, 1), "training.global_batch_size=12"],
     "training.global_batch_size=12 does not divide over fsdp=8"),
    (["data.seq_len=0"], "data.seq_len=0 is out of range: it must be at least 1."),
])
def test_bad_input_is_one_sentence_and_a_nonzero_exit(tmp_path, overrides, message):
    result = run_cli([*ONE_STACK, *overrides, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path,
                     env_extra=EIGHT_DEVICES)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert message in result.stderr  # where `python run_training.py > log` still shows it
    assert "Traceback" not in output


# Mistakes Hydra itself catches, and ones it let through (a `+`-added typo, a data.path that
# the bundled corpus ignores, two batch keys that disagree, a path that is not there): each is
# one sentence on stderr and exit code 2, before any work.
HYDRA_MISTAKES = {
    "training.setps=3": "training.setps is not a config key (did you mean training.steps?)",
    "+training.setps=3": "training.setps is not a config key (did you mean training.steps?), "
                         "with or without a '+' in front",
    "trainin.steps=3": "trainin.steps is not a config key (did you mean training.steps?)",
    "model=gemma3_2b": "model=gemma3_2b is not a known option; did you mean model=gemma3_",
    "model.mesh_shape=[[4,1],[fsdp,tp]": "'model.mesh_shape=[[4,1],[fsdp,tp]' is not a valid "
                                         "override",
    "training.steps=abc": "training.steps=abc does not fit training.steps: Value 'abc'",
    "generate.prompt=f(x)=2x": "check its brackets and quotes, e.g. text in double quotes "
                               "inside single ones: 'generate.prompt=\"f(x)=2x\"'.",
    "lora.targets=all": "lora.targets=all: lora.targets is a list; write lora.targets=[all]",
    "data.path=corpus.csv": "data.path=corpus.csv needs a data= group",
    "checkpoint.init_params_from=outputs/nope": "checkpoint.init_params_from=outputs/nope does "
                                                "not exist",
    "model.mesh_shape=[[1,2,1],[fsdp,cp,tp]] data.seq_len=33":
        "data.seq_len=33 does not split into 4 (2 × cp=2) equal chunks (model.mesh_shape: each cp "
        "device holds an early and a late one); choose a data.seq_len divisible by 4.",
    "training.global_batch_size=16 training.micro_batch_size=2":
        "training.global_batch_size=16 but training.micro_batch_size=2 × fsdp=1 × "
        "gradient_accumulation_steps=1 = 2; set only one of the two batch keys",
}


@pytest.mark.parametrize("mistake", HYDRA_MISTAKES)
def test_a_mistake_hydra_reports_or_ignores_is_one_sentence_and_exit_2(mistake, bad_value_runs):
    run = bad_value_runs[mistake]
    assert run["code"] == 2, run
    [line] = run["stderr"].strip().splitlines()
    assert HYDRA_MISTAKES[mistake] in line
    assert "error" not in run["stdout"] and "Traceback" not in run["stderr"]
    # Nothing ran: refused before devices, data or compiling, and no run dir left behind.
    assert "devices:" not in run["stdout"] and not run["run_dir_left"]


BAD_VALUES = [
    "optimizer.lr=-1", "grpo.num_generations=1", "optimizer.b1=1.0", "optimizer.b2=-0.1",
    "optimizer.eps=0", "optimizer.grad_clip=-1", "optimizer.weight_decay=-0.1",
    "optimizer.warmup_steps=-5", "optimizer.min_lr_ratio=1.5", "training.steps=0",
    "training.seed=-1", "training.micro_batch_size=0", "training.global_batch_size=0",
    "training.gradient_accumulation_steps=0", "training.sync_gradients_every=0",
    "training.zero_stage=5", "training.loss_vocab_chunk=0", "training.eval_every_steps=-1",
    "data.seq_len=0", "data.validation_fraction=1.0", "data.eval_batches=0", "data.prefetch=-1",
    "checkpoint.keep=0", "checkpoint.every_steps=-2", "logging.every_steps=0",
    "logging.peak_tflops=0", "model.rms_norm_eps=0", "model.num_layers=0",
    "model.sliding_window=-3", "distributed.step_timeout_s=0",
]


@pytest.fixture(scope="module")
def bad_value_runs(tmp_path_factory) -> dict:
    """Each bad value through run_training.py's entry point (tests/bad_values_worker.py)."""
    from helpers import REPO

    base = tmp_path_factory.mktemp("bad_values")
    mistakes = [m.split() for m in HYDRA_MISTAKES]
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "bad_values_worker.py"),
         json.dumps([str(base), BAD_VALUES + mistakes])],
        cwd=base, env=cli_env(None), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines()]
    return {" ".join(run["override"]) if isinstance(run["override"], list) else
            run["override"]: run for run in runs}


@pytest.mark.parametrize("override", BAD_VALUES)
def test_a_bad_value_is_one_sentence_on_stderr_before_any_work(override, bad_value_runs):
    run = bad_value_runs[override]
    assert run["code"] == 2
    [line] = run["stderr"].strip().splitlines()
    key, value = override.split("=")
    assert f"error: {key}=" in line and " is out of range: it must be " in line
    assert float(line.split(f"{key}=")[1].split()[0]) == float(value)
    assert "error" not in run["stdout"]  # stdout may go to a file; the sentence must not hide there
    # Nothing ran before the check: not a line on the console, and no run dir left behind.
    assert run["stdout"].strip() == "" and not run["run_dir_left"]


# Each command's probe: how the user starts it, and a value it refuses.
REFUSALS = {
    "run_training.py": ("runpy.run_path('run_training.py', run_name='__main__')",
                        ["run_training.py", "optimizer.lr=-1", "hydra.run.dir={run_dir}"],
                        "optimizer.lr=-1.0 is out of range"),
    "plan": ("runpy.run_module('tunix_train.plan', run_name='__main__')",
             ["plan", "model.mesh_shape=[[4,1],[fsdp,tp]]", "optimizer.lr=-1",
              "hydra.run.dir={run_dir}"], "optimizer.lr=-1.0 is out of range"),
    "generate": ("runpy.run_module('tunix_train.generate', run_name='__main__')",
                 ["generate", "generate.temperature=-1"],
                 "generate.temperature=-1.0 is out of range"),
    "export": ("runpy.run_module('tunix_train.export', run_name='__main__')",
               ["export", "checkpoint.resume_from={tmp_path}", "export.path={run_dir}",
                "export.dtype=float8"], "export.dtype='float8' is not one of"),
}


@pytest.mark.parametrize("command", REFUSALS)
def test_a_refused_value_is_told_before_jax_or_the_training_code_loads(command, repo, tmp_path):
    """A mistyped command costs its refusal only (run_training.py 0.8 s on a 2-core VM,
    2026-11-29, against 2-2.6 s when JAX, Orbax and Flax were imported first; the planner 1.0 s
    against 1.7, or 4.9 with a mesh to simulate, which it re-ran itself for; generate 0.65
    against 2.1; export 0.6 against 1.9): what the process had imported at its exit, and no
    run dir (or export folder) left."""
    start, argv, message = REFUSALS[command]
    run_dir = tmp_path / "run"
    probe = ("import atexit, runpy, sys\n"
             "atexit.register(lambda: print(sorted(m for m in ('jax', 'flax', 'orbax.checkpoint', "
             "'tunix_train.training.run') if m in sys.modules)))\n"
             f"sys.argv = {[arg.format(run_dir=run_dir, tmp_path=tmp_path) for arg in argv]!r}"
             f"\n{start}\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=repo, env=cli_env(None),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: {message}" in result.stderr
    assert result.stdout.strip() == "[]"
    assert not run_dir.exists()


def test_the_progress_bar_starts_after_compiling_and_moves_every_step(tmp_path, capsys):
    """The bar appears at the first step the loop runs (its rate and ETA then exclude the
    compile), moves at every step, and shows the logged values at logged steps."""
    import time

    from tunix_train.config import LoggingConfig
    from tunix_train.training.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, LoggingConfig(progress="always"), total_steps=4)
    assert writer._bar is None  # nothing drawn at start-up, while compiling
    frames = []
    for step in (1, 2, 3, 4):
        time.sleep(0.15)  # a step's time: tqdm redraws at most every 0.1 s
        writer.tick(step)
        if step == 2:
            writer.progress(step, {"loss": 1.5, "tokens_per_s": 1000.0})
        frames.append(capsys.readouterr().out.replace("\r", "\n"))
    writer.close()
    for step, frame in enumerate(frames, 1):
        assert f"{step}/4" in frame
    assert "loss=1.5000" in frames[1]
