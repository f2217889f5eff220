"""Prompts for GRPO: JSON lines or Parquet records, read and tokenized once at start-up.

A record holds the prompt in `data.prompt_field`; its other fields go to the reward functions
(e.g. the reference answer). Prompt sets are small (thousands to a few hundred thousand
records), so all of them are held in memory; each epoch visits them in an order drawn from
`training.seed` and the epoch, and the position (epoch, index) is what a checkpoint saves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tunix_train.config import ConfigError, DataConfig
from tunix_train.data import sources
from tunix_train.data import tokenizer as tokenizer_lib

log = logging.getLogger("tunix_train")

@dataclass(frozen=True)
class Prompt:
    text: str  # as written in the record (the reward functions see this)
    ids: tuple[int, ...]  # as the model sees it: BOS, the chat template when on
    fields: dict[str, Any]  # the record's other fields


def read_prompts(data: DataConfig, tokenizer: tokenizer_lib.Tokenizer, max_tokens: int,
                 chat_turn: str) -> list[Prompt]:
    """Every usable record of data.path; prompts longer than `max_tokens` are left out (with a
    warning saying how many), and none left is an error. `chat_turn`: the model family's turn
    format ({prompt} where the prompt goes), used with `data.chat_template=true`."""
    files = sources.resolve(data.path, "prompts", "data.path")
    records = [record for file in files for record in _records(file, data.prompt_field)]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompts, too_long = [], 0
    for record in records:
        text = record.pop(data.prompt_field)
        shown = chat_turn.format(prompt=text) if data.chat_template else text
        ids = (*bos, *tokenizer.encode(shown).tolist())
        if len(ids) > max_tokens:
            too_long += 1
            continue
        prompts.append(Prompt(text, ids, record))
    if too_long:
        log.warning("%d of %d prompts are longer than the %d tokens data.seq_len leaves after "
                    "grpo.max_new_tokens and are left out", too_long, len(records), max_tokens)
    if not prompts:
        raise ConfigError(f"data.path: no prompt fits in {max_tokens} tokens (data.seq_len minus "
                          f"grpo.max_new_tokens); raise data.seq_len.")
    return prompts


def _records(file: Path, prompt_field: str) -> list[dict]:
    if file.suffix == ".parquet":
        columns = _parquet_columns(file)
        if prompt_field not in columns:
            raise ConfigError(f"data.prompt_field: {file} has no column {prompt_field!r} (it has "
                              f"{', '.join(columns) or 'none'}); set data.prompt_field to one "
                              f"of them.")
        rows = len(columns[prompt_field])
        return [{name: values[i] for name, values in columns.items()} for i in range(rows)]
    lines = _WholeRecords([file], (prompt_field,))
    return [lines[i] for i in range(len(lines))]


def _parquet_columns(file: Path) -> dict[str, list]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file).to_pydict()
    except Exception as error:  # pyarrow raises ArrowInvalid and friends
        raise ConfigError(f"data.path: {file} is not a Parquet file ({error}).") from None


class _WholeRecords(sources.JsonLines):
    """JSON lines whose records are kept whole (the reward functions get every field)."""

    def _extract(self, record: Any, where: str):
        if not isinstance(record, dict):
            raise ConfigError(f"data.path: {where} is not a JSON object; each line must be one.")
        field = self.fields[0]
        if field not in record:
            raise ConfigError(f"data.prompt_field: {where} has no field {field!r} (it has "
                              f"{', '.join(record) or 'none'}); set data.prompt_field to one of "
                              f"them.")
        if not isinstance(record[field], str):
            raise ConfigError(f"data.prompt_field: {where} has a {field!r} that is not a string.")
        return dict(record)


class PromptOrder:
    """Batches of prompts, epoch after epoch, each epoch in a seeded order; `get_state` and
    `set_state` are the checkpoint's data position."""

    def __init__(self, prompts: list[Prompt], per_step: int, seed: int):
        self.prompts, self.per_step, self.seed = prompts, per_step, seed
        self.epoch, self.index = 0, 0

    def __iter__(self) -> PromptOrder:
        return self

    def __next__(self) -> list[Prompt]:
        batch = []
        while len(batch) < self.per_step:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.prompts))
            take = order[self.index:self.index + self.per_step - len(batch)]
            batch += [self.prompts[i] for i in take]
            self.index += len(take)
            if self.index >= len(self.prompts):
                self.epoch, self.index = self.epoch + 1, 0
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "prompts": len(self.prompts),
                "per_step": self.per_step}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("prompts") != len(self.prompts):
            raise ConfigError(f"the checkpoint's prompt position is for {state.get('prompts')} "
                              f"prompts, data.path now has {len(self.prompts)}; resume with the "
                              f"same prompts.")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
