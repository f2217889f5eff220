"""Experiment trackers beside TensorBoard: Weights & Biases (`logging.wandb.*`) and MLflow
(`logging.mlflow.*`), both off by default, each an optional extra (`.[wandb]`, `.[mlflow]`).

Process 0 sends each tracker what goes to TensorBoard (every scalar, same name, same step),
the resolved config (MLflow params, W&B config, dotted keys), the run dir, the start-up facts
(mesh, parameter counts, memory plan, communication) and the final validation metrics. The
tracker's run id is kept in `<run dir>/trackers.json`, so a resumed run appends to the same
tracker run; a sweep point (`-m`) is a run of its own, named after its overrides.

A tracker never stops or loses a run: if one fails (package broken, server unreachable, bad
credentials), one warning says so, that tracker is dropped for the rest of the run, and
TensorBoard and metrics.jsonl keep everything. `validation.py` refuses a missing package
before anything compiles.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from tunix_train.config import Config, MlflowConfig, WandbConfig

log = logging.getLogger("tunix_train")

IDS_FILE = "trackers.json"
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # logging.<key> → the package it needs

# MLflow's client retries a failed request 7 times over ~4 minutes by default: a server gone
# mid-run would stall training that long at each logged step. Ours gives up after ~3 s (the
# tracker is then dropped with one warning); a user's own MLFLOW_HTTP_* settings win.
_MLFLOW_QUICK_FAILURE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                         "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                         "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
_MLFLOW_PARAMS_PER_CALL = 100  # MLflow's log_batch limit
_MLFLOW_VALUE_CHARS = 6000  # MLflow's longest param value


def resolved(cfg: Config) -> dict[str, Any]:
    """The resolved config as nested dicts (W&B's config)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def flat(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"num_layers": 4}} as {"model.num_layers": 4} (MLflow's params); lists stay
    values."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def run_name(given: str | None, run_dir: Path) -> str:
    """The tracker run's name: the key's, else a sweep point's swept values
    (`optimizer.lr=0.001`), else the run dir."""
    if given:
        return given
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return _sweep_point(HydraConfig.get())
    try:
        return str(Path(run_dir).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(run_dir)


def _sweep_point(hydra_cfg: Any) -> str:
    """This job's values of the keys the sweep varies: the sweep's own command line is in its
    multirun.yaml (Hydra's sweeper writes it before the first job, under every launcher)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    swept: set[str] = set()
    sweep_file = Path(hydra_cfg.sweep.dir) / "multirun.yaml"
    if sweep_file.exists():
        given = list(OmegaConf.load(sweep_file).hydra.overrides.task)
        swept = {o.key_or_group for o in OverridesParser.create().parse_overrides(given)
                 if o.is_sweep_override()}
    point = [o for o in hydra_cfg.overrides.task if o.split("=", 1)[0].lstrip("+~") in swept]
    return ",".join(point) or hydra_cfg.job.override_dirname or str(hydra_cfg.job.num)


class _Wandb:
    label = "W&B"

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any],
                 run_id: str | None):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, mode=cfg.mode, tags=list(cfg.tags),
            name=run_name(cfg.name, run_dir), config={**config, "run_dir": str(run_dir)},
            id=run_id, resume="allow" if run_id else None,
            dir=os.environ.get("WANDB_DIR") or str(run_dir),
            # train.log keeps the console; W&B's capture would wrap our stdout and progress bar.
            settings=wandb.Settings(console="off"))
        self.id = self.run.id

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def text(self, tag: str, text: str) -> None:
        self.run.summary[f"startup/{tag}"] = text

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update(values)

    def close(self, status: str) -> None:
        if status == "preempted":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status != "failed" else 1)


class _Mlflow:
    label = "MLflow"
    _STATUS = {"finished": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}

    def __init__(self, cfg: MlflowConfig, run_dir: Path, config: dict[str, Any],
                 run_id: str | None):
        for key, value in _MLFLOW_QUICK_FAILURE.items():
            os.environ.setdefault(key, value)
        # A retried request is a warning line of urllib3's each time: ours says it once.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._param = Param
        self.client = MlflowClient(tracking_uri=cfg.tracking_uri)
        params = {k: _param_text(v) for k, v in {**flat(config), "run_dir": str(run_dir)}.items()}
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            logged = self.client.get_run(run_id).data.params
            # MLflow's params are immutable: a key the resumed run changes (training.steps, say)
            # becomes a tag that says so.
            for key in sorted(k for k in params if k in logged and logged[k] != params[k]):
                self.client.set_tag(run_id, f"resumed.{key}", params[key])
            params = {k: v for k, v in params.items() if k not in logged}
        else:
            experiment = self.client.get_experiment_by_name(cfg.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(cfg.experiment))
            run_id = self.client.create_run(experiment_id, run_name=run_name(cfg.run_name, run_dir),
                                            tags={"run_dir": str(run_dir)}).info.run_id
        self.id = run_id
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(run_id, params=items[i:i + _MLFLOW_PARAMS_PER_CALL])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, float(v), now, step)
                                                for k, v in values.items()])

    def text(self, tag: str, text: str) -> None:
        self.client.log_text(self.id, text, f"startup/{tag}.txt")

    def summary(self, values: dict[str, float]) -> None:
        self.client.set_tag(self.id, "final", json.dumps(values))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.id, self._STATUS[status])


def _param_text(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:_MLFLOW_VALUE_CHARS]


class Trackers:
    """The trackers a run logs to (none by default): each call goes to every tracker still
    working; the first failure of one is one warning, and that tracker is dropped."""

    def __init__(self, trackers: list | None = None):
        self._live = list(trackers or [])

    @classmethod
    def open(cls, cfg: Config, run_dir: Path) -> Trackers:
        """Process 0's trackers for `run_dir`, each resuming the tracker run recorded there."""
        kinds = [(key, kind) for key, kind in (("wandb", _Wandb), ("mlflow", _Mlflow))
                 if getattr(cfg.logging, key).enabled]
        if not kinds:
            return cls()
        ids_file = Path(run_dir) / IDS_FILE
        ids = json.loads(ids_file.read_text()) if ids_file.exists() else {}
        config, opened = resolved(cfg), []
        for key, kind in kinds:
            try:
                tracker = kind(getattr(cfg.logging, key), run_dir, config, ids.get(key))
            except Exception as error:  # noqa: BLE001 (a tracker never stops a run)
                _warn_failed(kind.label, "could not start", error)
                continue
            verb = "continues" if ids.get(key) == tracker.id else "is"
            log.info("%s: this run %s %s run %s", kind.label, verb, key, tracker.id)
            ids[key] = tracker.id
            opened.append(tracker)
        ids_file.write_text(json.dumps(ids))
        return cls(opened)

    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self._live):
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # noqa: BLE001 (a tracker never stops a run)
                _warn_failed(tracker.label, "failed", error)
                self._live.remove(tracker)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._each("scalars", step, values)

    def text(self, tag: str, text: str) -> None:
        self._each("text", tag, text)

    def summary(self, values: dict[str, float]) -> None:
        self._each("summary", values)

    def close(self, status: str) -> None:
        """`status`: finished, preempted (resumable) or failed."""
        self._each("close", status)
        self._live = []


def _warn_failed(label: str, what: str, error: BaseException) -> None:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    log.warning("%s %s (%s: %s); training goes on without it, and TensorBoard and "
                "metrics.jsonl keep every value of this run.", label, what,
                type(error).__name__, first)
