"""Token windows → deterministic global batches, each process reading only its own rows.

The global order depends only on the seed: batch `s`, micro-step `m`, global row `r` is element
`(s * accum + m) * rows + r` of a Grain `MapDataset` shuffled by `training.seed`. Which rows a
process reads follows from the batch sharding, so the data a step sees is the same on any mesh
and any number of processes, and resuming at step `s` needs nothing but `s`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grain
import jax
import numpy as np
from jax.sharding import NamedSharding

from tunix_train.config import ConfigError, DataConfig, ModelConfig
from tunix_train.data import builtin
from tunix_train.data.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchShape:
    accum: int  # micro-steps per optimizer step
    rows: int  # sequences per micro-step, all fsdp shards together
    seq_len: int

    @property
    def sequences(self) -> int:
        return self.accum * self.rows


def pack_windows(documents: list[bytes], tokenizer: ByteTokenizer, seq_len: int) -> np.ndarray:
    """Concatenates BOS+doc+EOS streams and cuts [N, seq_len + 1] windows (inputs + 1 target)."""
    pieces = []
    for doc in documents:
        pieces += [[tokenizer.bos_id], tokenizer.encode(doc), [tokenizer.eos_id]]
    stream = np.concatenate(pieces).astype(np.int32)
    count = (len(stream) - 1) // seq_len
    if count == 0:
        raise ConfigError(
            f"data.seq_len={seq_len} is longer than the whole corpus ({len(stream)} tokens); "
            f"lower data.seq_len."
        )
    starts = np.arange(count) * seq_len
    return stream[starts[:, None] + np.arange(seq_len + 1)]


def load_windows(data: DataConfig, model: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) windows of the configured source."""
    if data.name != "builtin":
        raise ConfigError(f"data={data.name!r} is not available; use data=builtin.")
    tokenizer = ByteTokenizer()
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens; raise model.vocab_size."
        )
    train_docs, val_docs = builtin.documents(data.max_corpus_bytes, data.validation_fraction)
    return (pack_windows(train_docs, tokenizer, data.seq_len),
            pack_windows(val_docs, tokenizer, data.seq_len))


def _local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous range of batch rows (axis 1) this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    intervals = sorted({(i[1].start or 0, i[1].stop or global_shape[1]) for i in index_map.values()})
    lo, reach = intervals[0][0], intervals[0][0]
    for start, stop in intervals:
        if start > reach:
            raise RuntimeError(f"this process's batch rows are not contiguous: {intervals}")
        reach = max(reach, stop)
    hi = reach
    return slice(lo, hi)


class GlobalBatches:
    """Global batches: dicts of [accum, rows, seq_len] jax.Arrays, by step or as an iterator.

    The iterator's position is its whole state (`get_state`/`set_state`, JSON-serialisable),
    saved with every checkpoint so a resumed run reads exactly the batches it would have read.
    """

    def __init__(self, windows: np.ndarray, shape: BatchShape, sharding: NamedSharding,
                 seed: int, shuffle: bool = True):
        dataset = grain.MapDataset.source(windows)
        self.dataset = dataset.shuffle(seed=seed).repeat() if shuffle else dataset.repeat()
        self.shape = shape
        self.sharding = sharding
        global_shape = (shape.accum, shape.rows, shape.seq_len)
        self.rows = _local_rows(sharding, global_shape)
        self.next_step = 0

    def __iter__(self) -> "GlobalBatches":
        return self

    def __next__(self) -> dict[str, jax.Array]:
        batch = self.batch(self.next_step)
        self.next_step += 1
        return batch

    def get_state(self) -> dict:
        return {"next_step": self.next_step}

    def set_state(self, state: dict) -> None:
        self.next_step = int(state["next_step"])

    def batch(self, step: int) -> dict[str, jax.Array]:
        shape = self.shape
        first = step * shape.sequences
        local = np.stack([
            np.stack([self.dataset[first + m * shape.rows + r]
                      for r in range(self.rows.start, self.rows.stop)])
            for m in range(shape.accum)
        ])
        return self._to_global({
            "inputs": local[..., :-1],
            "targets": local[..., 1:],
            "weights": np.ones(local[..., 1:].shape, np.float32),
        })

    def _to_global(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        global_shape = (self.shape.accum, self.shape.rows, self.shape.seq_len)
        return {
            name: jax.make_array_from_process_local_data(self.sharding, value, global_shape)
            for name, value in local.items()
        }
