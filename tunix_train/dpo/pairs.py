"""Preference pairs for DPO: JSON lines or Parquet records, read and tokenized once at start-up.

A record holds a prompt (`data.prompt_field`) and a chosen and a rejected response
(`data.chosen_field`, `data.rejected_field`): each text, or a list of chat messages
({"role", "content"}) rendered with the model family's turns (user turns as `chat_turn`,
assistant turns closed by `end_turn`); text prompts are wrapped in a user turn when
`data.chat_template=true`. Responses end with EOS where the tokenizer has one.

A pair is one row of `data.seq_len` tokens, packed as two segments:

    [BOS prompt chosen EOS | BOS prompt rejected EOS | padding]
     segment 1               segment 2                 segment 0

with positions restarting at each segment and attention kept within it, so one forward pass
scores both responses. `weights` is 1 where the target is a response token, 0 on the prompt and
the padding. Pairs longer than a row are left out (with a warning saying how many).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tunix_train.config import ConfigError, DataConfig
from tunix_train.data import records as records_lib
from tunix_train.data import sources
from tunix_train.data import tokenizer as tokenizer_lib
from tunix_train.dpo.objective import CHOSEN, REJECTED
from tunix_train.models.family import Family

log = logging.getLogger("tunix_train")

FIELDS = ("inputs", "targets", "weights", "segment_ids", "positions")
HELD_OUT_SEED = 0  # the held-out split's draw: the same pairs whatever training.seed


@dataclass(frozen=True)
class Pair:
    prompt: tuple[int, ...]  # BOS and the prompt
    chosen: tuple[int, ...]  # the response and EOS
    rejected: tuple[int, ...]

    def row(self, seq_len: int) -> dict[str, np.ndarray]:
        row = {name: np.zeros(seq_len, np.float32 if name == "weights" else np.int32)
               for name in FIELDS}
        start = 0
        for segment, response in ((CHOSEN, self.chosen), (REJECTED, self.rejected)):
            tokens = np.array(self.prompt + response, np.int32)
            n = len(tokens) - 1  # inputs and targets are shifted by one
            span = slice(start, start + n)
            row["inputs"][span], row["targets"][span] = tokens[:-1], tokens[1:]
            row["weights"][span] = np.arange(1, n + 1) >= len(self.prompt)
            row["segment_ids"][span] = segment
            row["positions"][span] = np.arange(n)
            start += n
        return row

    def length(self) -> int:
        """The row columns the pair takes."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected) - 2


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
    """A row without a pair (padding of a held-out batch): it counts nothing."""
    return {name: np.zeros(seq_len, np.float32 if name == "weights" else np.int32)
            for name in FIELDS}


def stack(rows: Sequence[dict[str, np.ndarray]], accum: int) -> dict[str, np.ndarray]:
    """accum × rows_per_micro row dicts → one [accum, rows, seq_len] batch."""
    batch = {name: np.stack([row[name] for row in rows]) for name in rows[0]}
    return {name: value.reshape(accum, -1, *value.shape[1:]) for name, value in batch.items()}


class PairOrder(records_lib.SeededOrder):
    """Pairs, epoch after epoch, in a seeded order (data/records.py); each step's pairs as one
    [accum, rows, seq_len] batch of `row(index)`s."""

    noun = "pairs"

    def __init__(self, count: int, row, accum: int, per_step: int, seed: int):
        super().__init__(range(count), per_step, seed)
        self.row, self.accum = row, accum

    def __next__(self) -> dict[str, np.ndarray]:
        return stack([self.row(i) for i in super().__next__()], self.accum)


def read_pairs(data: DataConfig, tokenizer: tokenizer_lib.Tokenizer, family: Family
               ) -> tuple[list[Pair], list[Pair]]:
    """(training pairs, held-out pairs): data.eval_path's, or data.validation_fraction of
    data.path's drawn with a fixed seed."""
    train = _pairs(data, data.path, "data.path", tokenizer, family)
    if data.eval_path:
        return train, _pairs(data, data.eval_path, "data.eval_path", tokenizer, family)
    held = np.random.default_rng(HELD_OUT_SEED).random(len(train)) < data.validation_fraction
    if not held.any() or held.all():
        raise ConfigError(f"data.validation_fraction={data.validation_fraction} of {len(train)} "
                          f"pairs leaves {'no' if not held.any() else 'only'} held-out pairs; "
                          f"change it or set data.eval_path.")
    return ([p for p, h in zip(train, held) if not h], [p for p, h in zip(train, held) if h])


def _pairs(data: DataConfig, path: str, key: str, tokenizer: tokenizer_lib.Tokenizer,
           family: Family) -> list[Pair]:
    files = sources.resolve(path, "preferences", key)
    fields = {data.prompt_field: "data.prompt_field", data.chosen_field: "data.chosen_field",
              data.rejected_field: "data.rejected_field"}
    records = [(file, i, r) for file in files
               for i, r in enumerate(records_lib.whole_records(file, fields))]
    bos = () if tokenizer.bos_id is None else (tokenizer.bos_id,)
    eos = () if tokenizer.eos_id is None else (tokenizer.eos_id,)
    encode = lambda text: tuple(int(i) for i in tokenizer.encode(text))  # noqa: E731
    pairs, too_long = [], 0
    for file, i, record in records:
        where = f"{file} record {i + 1}"
        prompt = _prompt_text(record[data.prompt_field], data, family, where)
        chosen, rejected = (_response_text(record[f], family, where, f)
                            for f in (data.chosen_field, data.rejected_field))
        pair = Pair(bos + encode(prompt), encode(chosen) + eos, encode(rejected) + eos)
        if pair.length() > data.seq_len:
            too_long += 1
            continue
        pairs.append(pair)
    if too_long:
        log.warning("%d of %d preference pairs of %s do not fit one row of data.seq_len=%d "
                    "tokens (prompt twice, both responses) and are left out", too_long,
                    len(records), key, data.seq_len)
    if not pairs:
        raise ConfigError(f"{key}: no preference pair fits in data.seq_len={data.seq_len} tokens "
                          f"(a row holds the prompt twice and both responses); raise data.seq_len.")
    return pairs


def _prompt_text(prompt: Any, data: DataConfig, family: Family, where: str) -> str:
    if isinstance(prompt, str):
        return family.chat_turn.format(prompt=prompt) if data.chat_template else prompt
    messages = _messages(prompt, where, data.prompt_field)
    if messages[-1]["role"] != "user":
        raise ConfigError(f"data.prompt_field: {where} has messages ending with a "
                          f"{messages[-1]['role']!r} turn; a prompt ends with the user's.")
    return "".join(_turn(m, family) for m in messages)


def _response_text(response: Any, family: Family, where: str, field: str) -> str:
    if isinstance(response, str):
        return response
    messages = _messages(response, where, field)
    if any(m["role"] != "assistant" for m in messages):
        raise ConfigError(f"data: {where} has a {field!r} with a non-assistant message; a "
                          f"response holds the assistant's turn only.")
    return "".join(m["content"] + family.end_turn for m in messages)


def _turn(message: dict, family: Family) -> str:
    if message["role"] == "user":
        return family.chat_turn.format(prompt=message["content"])
    if message["role"] == "assistant":
        return message["content"] + family.end_turn
    raise ConfigError(f"data: a message has role {message['role']!r}; the family's turns know "
                      f"user and assistant.")


def _messages(value: Any, where: str, field: str) -> list[dict]:
    ok = isinstance(value, (list, tuple, np.ndarray)) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and
        isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise ConfigError(f"data: {where} has a {field!r} that is neither text nor a list of "
                          f"chat messages ({{\"role\": …, \"content\": …}}).")
    return list(value)
