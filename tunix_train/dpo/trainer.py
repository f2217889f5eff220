"""`trainer=dpo`: DPO's part (`DpoTask`) of the one run of training/run.py.

    preference pairs (pairs.py) → (run: restore or initialise) → the reference
    (training/reference.py) → the loop's step: the reference's log-probs of the batch, then the
      train step with DPO's loss (objective.py)

A step is `training.global_batch_size` pairs (micro-batches and accumulation as in the default
trainer), each pair one row. The reference is the run's starting weights, a frozen copy sharded
like the policy (with LoRA, the base with the adapters off: no copy). With
`dpo.precompute_reference=true` every training pair is scored by the reference once before the
first step and no reference model is held while training. The held-out pairs' reference
log-probs are computed once at start-up either way.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.config import Config
from tunix_train.data import tokenizer as tokenizer_lib
from tunix_train.dpo import objective as objective_lib
from tunix_train.dpo.pairs import PairOrder, empty_row, read_pairs, stack
from tunix_train.models import families
from tunix_train.parallel.sharding import on_devices
from tunix_train.training import reference as reference_lib
from tunix_train.training import run as run_lib
from tunix_train.training.loop import StepHooks
from tunix_train.training.metrics import MetricsWriter
from tunix_train.training.setup import Setup

log = logging.getLogger("tunix_train")


def run(cfg: Config, run_dir: Path, hooks: StepHooks = StepHooks()) -> dict[str, Any]:
    return run_lib.run(cfg, run_dir, DpoTask, hooks)


class DpoTask(run_lib.Task):
    """trainer=dpo's part of the run: pairs in, the reference's log-probs beside them."""

    def __init__(self, setup: Setup):
        cfg, b = setup.cfg, setup.batch
        self.setup, self.d = setup, cfg.dpo
        tokenizer = tokenizer_lib.open_tokenizer(cfg.data.tokenizer)
        tokenizer_lib.check_vocab(tokenizer, cfg.model.vocab_size)
        self.pairs, self.held_out = read_pairs(cfg.data, tokenizer, families.of(cfg.model))
        self.ref_rows: dict[int, np.ndarray] | None = None  # precomputed: pair → [seq_len]
        self.inputs = PairOrder(len(self.pairs), self._row, b.accum, b.sequences,
                                cfg.training.seed)
        self.reference = self.score = None

    @staticmethod
    def loss(cfg: Config) -> tuple[Callable, dict[str, Any]]:
        return functools.partial(objective_lib.loss_sums, objective_lib.Objective.of(cfg.dpo)), \
            {"ref_logps": jnp.float32}

    def _row(self, index: int) -> dict[str, np.ndarray]:
        row = self.pairs[index].row(self.setup.batch.seq_len)
        if self.ref_rows is not None:
            row["ref_logps"] = self.ref_rows[index]
        return row

    def start(self, state, writer: MetricsWriter, first_step: int) -> None:
        d, b = self.d, self.setup.batch
        log.info("dpo: %d training and %d held-out pairs, %d per step; loss %s, beta %g%s",
                 len(self.pairs), len(self.held_out), b.sequences, d.loss, d.beta,
                 f", label smoothing {d.label_smoothing:g}" if d.label_smoothing else "")
        self.reference = reference_lib.starting_weights(self.setup, "DPO")
        self.score = reference_lib.scorer(self.setup)
        reference = reference_lib.params_of(self.reference, self.setup, state)
        self.eval_batches = self._held_out_batches(reference)
        if d.precompute_reference:
            self.ref_rows = dict(enumerate(self._reference_logps(reference, self.pairs)))
            self.reference = self.score = None  # no reference model from here on
            log.info("reference log-probs of the %d training pairs computed; no reference "
                     "model is held while training", len(self.pairs))

    def _held_out_batches(self, reference) -> list[dict]:
        """The first data.eval_batches × training.global_batch_size held-out pairs (the same
        pairs on any mesh), their reference log-probs in, in batches of a micro-step's rows."""
        rows_per, seq_len = self.setup.batch.rows, self.setup.batch.seq_len
        pairs = self.held_out[:self.setup.batch.sequences * self.setup.cfg.data.eval_batches]
        scored = self._reference_logps(reference, pairs)
        rows = [p.row(seq_len) | {"ref_logps": r} for p, r in zip(pairs, scored)]
        rows += [empty_row(seq_len) | {"ref_logps": np.zeros(seq_len, np.float32)}] * (
            -len(rows) % rows_per)
        return [on_devices(stack(rows[start:start + rows_per], 1), self.setup.batch_sharding)
                for start in range(0, len(rows), rows_per)]

    def _reference_logps(self, reference, pairs: list) -> list[np.ndarray]:
        """The reference's token log-probs of each pair's row, scored a step's worth of rows at
        a time (the scorer compiled for the step's shape)."""
        b = self.setup.batch
        out = []
        for start in range(0, len(pairs), b.sequences):
            rows = [p.row(b.seq_len) for p in pairs[start:start + b.sequences]]
            count = len(rows)
            rows += [empty_row(b.seq_len)] * (b.sequences - count)
            batch = on_devices(stack(rows, b.accum), self.setup.batch_sharding)
            scored = _host(self.score(reference, batch)).reshape(b.sequences, b.seq_len)
            out += list(scored[:count])
        return out

    def step(self, update: Callable) -> Callable:
        sharding = self.setup.batch_sharding

        def dpo_step(state, host_batch: dict) -> tuple[Any, dict]:
            batch = on_devices(host_batch, sharding)
            if "ref_logps" not in batch:
                batch["ref_logps"] = self.score(
                    reference_lib.params_of(self.reference, self.setup, state), batch)
            state, metrics = update(state, batch)
            return state, {**metrics, **objective_lib.per_pair(metrics)}

        return dpo_step

    def evaluator(self) -> Callable[[Any], dict[str, float]]:
        summed = self.setup.eval_sums(self.eval_batches, self.loss(self.setup.cfg)[0])

        def evaluate(state) -> dict[str, float]:
            per_pair = objective_lib.per_pair(summed(state), ("loss", *objective_lib.METRICS))
            return {name: float(value) for name, value in per_pair.items()}

        return evaluate

    def close(self) -> None:
        pass


def _host(array: jax.Array) -> np.ndarray:
    """A global array, whole, on every process."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
