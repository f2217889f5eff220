"""Small record sets (GRPO's prompts, DPO's preference pairs): JSON lines or Parquet records read
whole at start-up, then visited epoch after epoch, each epoch in an order drawn from the seed and
the epoch. The position (epoch, index) is what a checkpoint saves, so a resumed run draws what
the uninterrupted one would have."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tunix_train.config import ConfigError
from tunix_train.data.sources import JsonLines


class SeededOrder:
    """`per_step` items at a time; `get_state`/`set_state` are the checkpoint's data position."""

    noun = "items"  # what the items are, for the error of a resume onto other data

    def __init__(self, items: Sequence[Any], per_step: int, seed: int):
        self.items, self.per_step, self.seed = items, per_step, seed
        self.epoch, self.index = 0, 0

    def __iter__(self) -> SeededOrder:
        return self

    def __next__(self) -> list[Any]:
        batch = []
        while len(batch) < self.per_step:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.items))
            take = order[self.index:self.index + self.per_step - len(batch)]
            batch += [self.items[i] for i in take]
            self.index += len(take)
            if self.index >= len(self.items):
                self.epoch, self.index = self.epoch + 1, 0
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, self.noun: len(self.items),
                "per_step": self.per_step}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get(self.noun) != len(self.items):
            raise ConfigError(f"the checkpoint's data position is for {state.get(self.noun)} "
                              f"{self.noun}, data.path now has {len(self.items)}; resume with the "
                              f"same {self.noun}.")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def whole_records(file: Path, required: dict[str, str]) -> list[dict]:
    """Every record of a JSON lines or Parquet file, whole (prompt sets and preference pairs:
    small enough to hold). `required`: field → the config key naming it; each record must hold
    every such field."""
    if file.suffix == ".parquet":
        columns = _parquet_columns(file)
        for field in required:
            if field not in columns:
                raise ConfigError(missing_field(required, field, str(file), "column",
                                                list(columns)))
        rows = len(next(iter(columns.values()), []))
        return [{name: values[i] for name, values in columns.items()} for i in range(rows)]
    lines = _WholeRecords([file], required)
    return [lines[i] for i in range(len(lines))]


def _parquet_columns(file: Path) -> dict[str, list]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file).to_pydict()
    except Exception as error:  # pyarrow raises ArrowInvalid and friends
        raise ConfigError(f"data.path: {file} is not a Parquet file ({error}).") from None


class _WholeRecords(JsonLines):
    """JSON lines whose records are kept whole (reward functions get every field)."""

    def __init__(self, files: list[Path], required: dict[str, str]):
        self.keys = required
        super().__init__(files, tuple(required))

    def _extract(self, record: Any, where: str):
        if not isinstance(record, dict):
            raise ConfigError(f"data.path: {where} is not a JSON object; each line must be one.")
        for field in self.fields:
            if field not in record:
                raise ConfigError(missing_field(self.keys, field, where, "field", list(record)))
        return dict(record)


def missing_field(required: dict[str, str], field: str, where: str, kind: str,
                  present: list[str]) -> str:
    """The sentence for a record (or table) without `field`: the fields it has that no other
    key already names are what `required[field]` may point at; if there are none, the data
    lacks it."""
    key = required.get(field, "data.path")
    free = [name for name in present if name not in required]
    fix = (f"set {key} to {free[0]}" if len(free) == 1 else
           f"set {key} to one of {', '.join(free)}" if free else
           f"every record needs one: add it there, or set {key} to the {kind} that holds it")
    return (f"{key}: {where} has no {kind} {field!r} (it has {', '.join(present) or 'none'}); "
            f"{fix}.")
