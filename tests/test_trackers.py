"""Experiment trackers (tunix_train/training/trackers.py) against the real things: a local MLflow
tracking server (SQLite backend, started here and stopped by its process group) read back
through its REST API, and W&B in offline mode read back with W&B's own reader
(`wandb leet inspect --json`). The reference is always the run's own metrics.jsonl and Hydra's
saved config."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import (ONE_STACK, compose_config, free_port, run_cli, sigterm_when_paused,
                     start_cli)
from typed_docs import CPU_SCALE, Typed, ok, page_commands
from tunix_train.config import ConfigError
from tunix_train import validation
from tunix_train.training.trackers import IDS_FILE, Trackers

FAULTY = "tests/faulty_training.py"
FAULTS = "TUNIX_TRAIN_TEST_FAULTS"

# Every step logged, no periodic checkpoint (SIGTERM saves one), every scalar of a short run.
TRACKED = [*ONE_STACK, "training.steps=4", "logging.every_steps=1", "checkpoint.every_steps=0"]


# docs/monitoring.md's MLflow section: its server command, then its training command.
SERVER, TRACKED_RUN = page_commands("docs/monitoring.md", "mlflow")[-2:]


class MlflowServer:
    """docs/monitoring.md's `mlflow server …` as typed in a fresh copy of the repository (its
    SQLite database and artifacts land there), in a process group of its own."""

    def __init__(self, typed: Typed):
        self.typed, self.process = typed, None
        self.uri = "http://127.0.0.1:" + SERVER.split("--port ")[1].split()[0]
        self.start()

    def start(self) -> None:
        """As Typed.start runs a command, with its log in a file (a pipe nobody reads would
        stall it) and a process group of its own (bash execs it; it starts workers)."""
        self.log = self.typed.root / "mlflow-server.log"
        # The command as typed; its job runner (Huey consumers for MLflow's GenAI jobs, which a
        # training run never submits) off: 17 s of CPU per start, on a 2-core suite.
        env = self.typed.env({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        self.process = subprocess.Popen(["bash", "-c", SERVER], cwd=self.typed.root,
                                        env=env, stdout=self.log.open("a"),
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def ready(self, timeout_s: float = 240) -> str:
        """The server's URI once it answers /health (started again if a test stopped it)."""
        if self.process.poll() is not None:
            self.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self.uri
            except OSError:
                assert self.process.poll() is None, self.log.read_text()[-3000:]
                time.sleep(0.5)
        raise AssertionError(f"{SERVER} not up in {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture(scope="module", autouse=True)
def mlflow_server(tmp_path_factory):
    """Started with the module's first test (it takes seconds to create its database and start
    its workers; the W&B tests, first in this file, run meanwhile) and stopped after the last."""
    server = MlflowServer(Typed(tmp_path_factory.mktemp("typed") / "tunix_train"))
    yield server
    server.stop()


def jsonl_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    """metrics.jsonl as {(TensorBoard's name, step): value}: `loss` → train/loss, `eval_loss` →
    eval/loss."""
    scalars = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        for key, value in record.items():
            name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
            scalars[name, step] = value
    return scalars


def sigterm_after_step_2(args: list[str], cwd: Path, env: dict | None = None) -> None:
    """helpers.sigterm_when_paused after step 2; `args` ends with hydra.run.dir."""
    sigterm_when_paused(args, cwd, 2, env)
    assert max(step for _, step in jsonl_scalars(Path(args[-1].split("=", 1)[1]))) == 2


# --- W&B, offline -------------------------------------------------------------------------------

def wandb_scalars(offline_run: Path) -> dict[tuple[str, int], float]:
    """An offline run's history, read by W&B's own reader of its .wandb file."""
    [log_file] = offline_run.glob("run-*.wandb")
    wandb = Path(sys.executable).with_name("wandb")
    printed = subprocess.run([str(wandb), "leet", "inspect", "--json", str(log_file)],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    scalars = {}
    for line in printed.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            items = record["history"]["item"]
            scalars.update({(k, items["_step"]): v for k, v in items.items()
                            if not k.startswith("_")})
    return scalars


@pytest.mark.slow
def test_wandb_offline_holds_every_scalar_and_a_resumed_run_keeps_its_id(tmp_path):
    run_dir = tmp_path / "run"
    home = {f"WANDB_{k}_DIR": str(tmp_path / k.lower()) for k in ("CONFIG", "CACHE", "DATA")}
    args = [*TRACKED, "logging.wandb.enabled=true", "logging.wandb.mode=offline",
            "logging.wandb.tags=[test]", f"hydra.run.dir={run_dir}"]
    sigterm_after_step_2(args, tmp_path, home)
    result = run_cli(args, tmp_path, home)
    assert result.returncode == 0 and "resuming from step 2" in result.stdout + result.stderr
    run_id = json.loads((run_dir / IDS_FILE).read_text())["wandb"]
    assert f"W&B: this run continues wandb run {run_id}" in result.stdout
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [d.name.rsplit("-", 1)[1] for d in offline] == [run_id, run_id]
    logged = {**wandb_scalars(offline[0]), **wandb_scalars(offline[1])}
    assert logged == jsonl_scalars(run_dir)


# --- MLflow, a real tracking server -----------------------------------------------------------

def hydra_params(run_dir: Path) -> dict[str, str]:
    """Hydra's saved config of the run as MLflow params (dotted keys, text values)."""
    params = {}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                params[f"{prefix}{key}"] = (json.dumps(value) if isinstance(value, list)
                                            else str(value))

    walk("", OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"),
                                    resolve=True))
    return params


@pytest.mark.slow
def test_the_monitoring_pages_mlflow_commands_as_typed(mlflow_server):
    """The page's server (this module's) and its run, as typed, at CPU scale."""
    from mlflow.tracking import MlflowClient

    uri, typed = mlflow_server.ready(), mlflow_server.typed
    output = ok(typed.run(TRACKED_RUN, *CPU_SCALE, "training.steps=2"))
    run_dir = typed.root / "outputs" / "tracked"
    run_id = json.loads((run_dir / IDS_FILE).read_text())["mlflow"]
    assert f"MLflow: this run is mlflow run {run_id}" in output
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "outputs/tracked"
    assert client.get_experiment(run.info.experiment_id).name == "tunix_train"
    assert {(name, m.step): m.value for name in run.data.metrics
            for m in client.get_metric_history(run_id, name)} == jsonl_scalars(run_dir)


@pytest.mark.slow
def test_mlflow_server_holds_every_scalar_and_the_config_and_a_resume_appends(mlflow_server,
                                                                              tmp_path):
    from mlflow.tracking import MlflowClient

    uri = mlflow_server.ready()
    run_dir = tmp_path / "run"
    args = [*TRACKED, "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}",
            "logging.mlflow.experiment=resume", f"hydra.run.dir={run_dir}"]
    sigterm_after_step_2(args, tmp_path)
    client = MlflowClient(uri)
    run_id = json.loads((run_dir / IDS_FILE).read_text())["mlflow"]
    assert client.get_run(run_id).info.status == "KILLED"  # preempted, to be resumed
    result = run_cli(args, tmp_path)
    assert result.returncode == 0 and "resuming from step 2" in result.stdout + result.stderr

    [run] = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert (run.info.run_id, run.info.status) == (run_id, "FINISHED")
    expected = jsonl_scalars(run_dir)
    got = {(name, m.step): m.value for name in run.data.metrics
           for m in client.get_metric_history(run_id, name)}
    assert got == expected
    assert run.data.params == {**hydra_params(run_dir), "run_dir": str(run_dir)}
    final = json.loads(run.data.tags["final"])
    assert final == {"final/eval_loss": expected["eval/loss", 4]}
    startup = {Path(a.path).name for a in client.list_artifacts(run_id, "startup")}
    assert startup == {"mesh.txt", "memory.txt", "communication.txt"}
    mesh = Path(client.download_artifacts(run_id, "startup/mesh.txt", str(tmp_path)))
    assert "parameters: " in mesh.read_text() and "mesh: fsdp=1 × tp=1" in mesh.read_text()


@pytest.mark.slow
def test_each_sweep_point_is_a_run_of_its_own_named_after_its_values(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = mlflow_server.ready()
    result = run_cli(["-m", *ONE_STACK, "training.steps=1", "optimizer.lr=0.001,0.002",
                      "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}",
                      "logging.mlflow.experiment=sweep", f"hydra.sweep.dir={tmp_path}/sweep"],
                     tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id])
    assert sorted((r.info.run_name, r.data.params["optimizer.lr"], r.data.tags["run_dir"])
                  for r in runs) == [("optimizer.lr=0.001", "0.001", f"{tmp_path}/sweep/0"),
                                     ("optimizer.lr=0.002", "0.002", f"{tmp_path}/sweep/1")]


@pytest.mark.slow
def test_a_server_stopped_mid_run_costs_one_warning_and_nothing_else(mlflow_server, tmp_path):
    """The server goes away after step 2: the run finishes, says so once, and metrics.jsonl and
    TensorBoard hold every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = mlflow_server.ready()
    run_dir, go = tmp_path / "run", tmp_path / "go"
    args = [*TRACKED, "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}",
            "logging.mlflow.experiment=stopped", f"hydra.run.dir={run_dir}"]
    process = start_cli(args, tmp_path, {FAULTS: json.dumps(
        {"pause_at_step": 2, "resume_file": str(go)})}, script=FAULTY)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "paused after step 2 " in line:
            mlflow_server.stop()
            go.touch()
    output = "".join(lines)
    assert process.wait(timeout=300) == 0, output[-3000:]
    [warning] = [line for line in lines if "WARNING" in line and "fault injection" not in line]
    assert "MLflow failed (" in warning and "training goes on without it" in warning
    scalars = jsonl_scalars(run_dir)
    assert sorted(step for name, step in scalars if name == "train/loss") == [1, 2, 3, 4]
    assert sorted(step for name, step in scalars if name == "eval/loss") == [0, 4]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tensorboard = {e.step: e.value for e in events.Scalars("train/loss")}  # float32
    assert tensorboard == pytest.approx({s: scalars["train/loss", s] for s in (1, 2, 3, 4)})


# --- No tracker stops a run -------------------------------------------------------------------

def test_an_unreachable_server_at_start_is_one_warning_and_no_tracker(tmp_path, caplog):
    cfg = compose_config("logging.mlflow.enabled=true",
                         f"logging.mlflow.tracking_uri=http://127.0.0.1:{free_port()}")
    with caplog.at_level(logging.WARNING, logger="tunix_train"):
        trackers = Trackers.open(cfg, tmp_path)
        trackers.scalars(1, {"train/loss": 1.0})
        trackers.close("finished")
    [warning] = [r.getMessage() for r in caplog.records]  # urllib3's retries are not said
    assert warning.startswith("MLflow could not start (") and "metrics.jsonl keep" in warning
    assert json.loads((tmp_path / IDS_FILE).read_text()) == {}


def test_wandb_without_credentials_is_one_warning_and_no_tracker(tmp_path, caplog, monkeypatch):
    for variable in ("HOME", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "home"))  # no ~/.netrc, no settings
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = compose_config("logging.wandb.enabled=true")  # online, W&B's default
    with caplog.at_level(logging.WARNING, logger="tunix_train"):
        trackers = Trackers.open(cfg, tmp_path)
        trackers.scalars(1, {"train/loss": 1.0})
    [warning] = [r.getMessage() for r in caplog.records if r.name == "tunix_train"]
    assert warning.startswith("W&B could not start (UsageError: ") and "wandb login" in warning


@pytest.mark.parametrize("key", ["wandb", "mlflow"])
def test_a_tracker_without_its_package_is_refused_before_anything_runs(key, monkeypatch):
    monkeypatch.setitem(sys.modules, key, None)  # importlib finds no such package
    cfg = compose_config(f"logging.{key}.enabled=true")
    with pytest.raises(ConfigError) as refused:
        validation.validate(cfg)
    assert str(refused.value) == (
        f"logging.{key}.enabled=true needs the {key} package, which is not installed: pip "
        f"install -c constraints.txt -e '.[{key}]', or set logging.{key}.enabled=false.")
