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

from tunix_train.config import ConfigError, DataConfig
from tunix_train.data import records as records_lib
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
    """The file's records, whole; each holds the prompt as a string."""
    records = records_lib.whole_records(file, {prompt_field: "data.prompt_field"})
    for i, record in enumerate(records):
        if not isinstance(record[prompt_field], str):
            raise ConfigError(f"data.prompt_field: {file} record {i + 1} has a {prompt_field!r} "
                              f"that is not a string.")
    return records


class PromptOrder(records_lib.SeededOrder):
    """Batches of prompts, epoch after epoch, each epoch in a seeded order (data/records.py)."""

    noun = "prompts"
