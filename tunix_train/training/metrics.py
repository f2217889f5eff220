"""Where numbers go: TensorBoard (tensorboardX), metrics.jsonl, train.log, a progress bar and
the experiment trackers a run turns on (trackers.py: W&B, MLflow).

Only process 0 writes files; every process logs (other ranks only warnings and errors, see
`setup_process_logging`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import jax

from tunix_train.analysis.costs import StepCosts
from tunix_train.config import LoggingConfig
from tunix_train.parallel.launcher import LAUNCHER_ENV
from tunix_train.training.trackers import Trackers

log = logging.getLogger("tunix_train")


def setup_process_logging(process_index: int) -> None:
    """Rank 0 logs in full; other ranks only warnings and errors, prefixed with their rank.

    Under our launcher, console lines are already prefixed by it; files still need the prefix.
    """
    if process_index == 0:
        return
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    launcher_prefixes = bool(os.environ.get(LAUNCHER_ENV))
    for handler in root.handlers:
        if launcher_prefixes and not isinstance(handler, logging.FileHandler):
            continue
        fmt = handler.formatter._fmt if handler.formatter else "%(message)s"  # noqa: SLF001
        handler.setFormatter(logging.Formatter(f"[rank {process_index}] {fmt}"))


# What tensorboardX imports whenever it is installed, for what a run never gives it: torch (to
# accept torch tensors; ~4 s of start-up where transformers users have it), google.cloud.storage
# and boto3 (for gs:// and s3:// log dirs; 0.2 s). A run's TensorBoard folder is a local path.
_UNUSED_BY_TENSORBOARDX = ("torch", "google.cloud.storage", "boto3")


def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported lazily (only process 0 needs it) and without the
    modules above (those not imported already)."""
    blocked = [name for name in _UNUSED_BY_TENSORBOARDX if name not in sys.modules]
    sys.modules.update(dict.fromkeys(blocked))  # `import name` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in blocked:
            del sys.modules[name]
    return SummaryWriter


class MetricsWriter:
    """Scalars to TensorBoard, metrics.jsonl and `trackers`; text (config, mesh, reports) to
    TensorBoard, start-up facts to the trackers too."""

    # Text for the trackers besides TensorBoard: the start-up facts (the config goes to them as
    # params, GRPO's samples stay in TensorBoard).
    TRACKED_TEXT = ("mesh", "memory", "communication")

    def __init__(self, run_dir: Path, cfg: LoggingConfig, total_steps: int, first_step: int = 0,
                 trackers: Trackers | None = None):
        self.enabled = jax.process_index() == 0
        self._tb = self._jsonl = self._bar = None
        self._trackers = trackers or Trackers()
        self._show = False
        if not self.enabled:
            return
        self._tb = _summary_writer()(str(run_dir / "tensorboard"))
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        self._show = cfg.progress == "always" or (cfg.progress == "auto" and sys.stdout.isatty())
        self._total = total_steps

    def text(self, tag: str, text: str) -> None:
        if self._tb is not None:
            # TensorBoard renders text as Markdown; indenting keeps tables and JSON monospaced.
            self._tb.add_text(tag, "    " + text.replace("\n", "\n    "), 0)
        if tag in self.TRACKED_TEXT:
            self._trackers.text(tag, text)

    def scalars(self, step: int, values: dict[str, float], group: str = "train") -> None:
        if not self.enabled:
            return
        for name, value in values.items():
            self._tb.add_scalar(f"{group}/{name}", value, step)
        record = {"step": step, **({f"{group}_{k}": v for k, v in values.items()}
                                   if group != "train" else values)}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._tb.flush()
        self._trackers.scalars(step, {f"{group}/{name}": v for name, v in values.items()})

    def summary(self, values: dict[str, float]) -> None:
        """The run's outcome (final validation metrics) for the trackers' run summaries."""
        self._trackers.summary(values)

    def tick(self, step: int) -> None:
        """The progress bar at `step`, every step. It starts at the first step the loop runs,
        after compiling, so its rate and ETA are those of training, and on a line of its own."""
        if not self._show:
            return
        if self._bar is None:
            from tqdm import tqdm

            sys.stdout.flush()
            self._bar = tqdm(total=self._total, initial=step, unit="step",
                             dynamic_ncols=True, file=sys.stdout)
        self._bar.update(step - self._bar.n)

    def progress(self, step: int, values: dict[str, float]) -> None:
        """The logged values beside the bar, at each logged step."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{values['loss']:.4f}",
                                  tok_s=f"{values['tokens_per_s']:,.0f}", refresh=True)

    @contextlib.contextmanager
    def console(self) -> Iterator[None]:
        """Routes console log lines through the progress bar so they do not tear it."""
        if not self._show:
            yield
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm():
            yield

    def close(self, status: str = "finished") -> None:
        """`status`: finished, preempted or failed (the trackers' run status)."""
        self._trackers.close(status)
        for closable in (self._bar, self._tb, self._jsonl):
            if closable is not None:
                closable.close()


class Throughput:
    """Wall-clock rate over each logging interval (the host does not wait on the device per step).

    With `mfu_factor` (model FLOPs per token / total peak FLOP/s, see flops.py) it adds `mfu`.
    """

    def __init__(self, step: int, tokens_per_step: int, mfu_factor: float | None = None):
        self._step, self._time = step, time.perf_counter()
        self._tokens_per_step, self._mfu_factor = tokens_per_step, mfu_factor

    def interval(self, step: int, now: float | None = None) -> dict[str, float]:
        """The rates of the steps since the last interval, up to `now` (when `step` finished)."""
        now = time.perf_counter() if now is None else now
        steps = max(step - self._step, 1)
        seconds = now - self._time
        self._step, self._time = step, now
        rates = {"step_time_s": seconds / steps,
                 "tokens_per_s": self._tokens_per_step * steps / seconds}
        if self._mfu_factor is not None:
            rates["mfu"] = rates["tokens_per_s"] * self._mfu_factor
        return rates


def format_line(step: int, total: int, values: dict[str, Any]) -> str:
    return (f"step {step}/{total} | loss {values['loss']:.4f} | "
            + (f"reward {values['reward_mean']:.3f} | " if "reward_mean" in values else "")
            + (f"margin {values['margin']:.3f} | accuracy {values['accuracy']:.2f} | "
               if "accuracy" in values else "")
            + (f"aux {values['moe_aux_loss']:.3f} | load {values['expert_load_min']:.2f}-"
               f"{values['expert_load_max']:.2f} | " if "moe_aux_loss" in values else "")
            + f"lr {values['lr']:.2e} | "
            f"grad_norm {values['grad_norm']:.3f} | {values['tokens_per_s']:,.0f} tok/s | "
            f"{values['step_time_s']:.3f} s/step"
            + (f" | MFU {values['mfu']:.1%}" if "mfu" in values else ""))


def report_costs(costs: StepCosts, writer: MetricsWriter, run_dir: Path) -> None:
    """The compiled step's costs: start-up log lines, TensorBoard text and `comm_report.json`
    (process 0 writes files), and a warning if the step will not fit the device."""
    memory = costs.memory_lines()
    lines = [*memory, costs.sync_line(),
             f"FLOPs per step (all devices, as compiled): {costs.flops_per_step:.3e}",
             "communication per step, per device:", *costs.comm.table().splitlines()]
    for line in lines:
        log.info(line)
    _warn_if_too_big(costs.per_device_bytes["total"])
    writer.text("memory", "\n".join(memory))
    writer.text("communication", "\n".join(lines[len(memory):]))
    if jax.process_index() == 0:
        record = {"mesh": {k: int(v) for k, v in costs.sync.mesh.shape.items()},
                  **costs.comm.to_json()}
        (run_dir / "comm_report.json").write_text(json.dumps(record, indent=1))


def _warn_if_too_big(needed: int) -> None:
    """Before the first step: the compiled step against what JAX may allocate (GPUs report it)."""
    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit and needed > limit:
        log.warning(
            "the step needs %.1f GB per device but JAX may use %.1f GB of this %s: expect an "
            "out-of-memory error; lower training.micro_batch_size, set training.remat=full, add "
            "fsdp devices, or raise XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's default is 0.75).",
            needed / 1e9, limit / 1e9, device.device_kind)
