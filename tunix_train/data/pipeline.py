"""The Grain pipeline: source → tokenize → pack → batch → global jax.Array.

Every sequence of the global batch (`accum × rows` per step) is its own Grain stream (see
`packing.row_stream`): the training documents, shuffled by `training.seed` afresh each epoch,
dealt round-robin to the streams, tokenized and packed. Sequence `j` of step `s` (micro-step
`j // rows`, row `j % rows`) is the `s`-th packed row of stream `j`. A process builds only the
streams of the rows its devices hold (from the batch sharding), so it reads only its share of
the documents, and the global batches depend only on the seed and the global batch size: not on
the number of processes, the mesh or the split into accumulated micro-batches.

The iterator's state is Grain's own checkpointable state of each stream, gathered from all
processes into one JSON-able list indexed by global sequence: a run restored from it continues
exactly, on any number of processes.
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import grain
import jax
import numpy as np
from grain import experimental as grain_x
from jax.sharding import NamedSharding

from tunix_train.config import ConfigError, DataConfig, ModelConfig
from tunix_train.data import packing, sources
from tunix_train.data import tokenizer as tokenizer_lib

log = logging.getLogger(__name__)

Batch = dict[str, jax.Array]
EVAL_SEED = 0  # the held-out documents' order (shuffled, so evaluation samples many of them)


@dataclass(frozen=True)
class BatchShape:
    accum: int  # micro-steps per optimizer step
    rows: int  # sequences per micro-step, all fsdp shards together
    seq_len: int

    @property
    def sequences(self) -> int:
        return self.accum * self.rows


@dataclass(frozen=True)
class Streams:
    """How any global row's stream is built; the same recipe on every process."""

    documents: grain.MapDataset
    features: Callable[[Any], dict]
    kind: str
    seq_len: int
    packing: str
    pad_id: int

    def stream(self, index: int, count: int) -> grain.IterDataset:
        return packing.row_stream(self.documents, index, count, self.features, self.kind,
                                  self.seq_len, self.packing, self.pad_id)


@dataclass
class Data:
    train: "GlobalBatches"
    eval_batches: list[Batch]  # the same held-out batches at every evaluation, built once
    tokenizer: tokenizer_lib.Tokenizer | None

    def close(self) -> None:
        self.train.close()


def open_data(data: DataConfig, model: ModelConfig, seed: int, shape: BatchShape,
          sharding: NamedSharding) -> Data:
    """The training iterator and the evaluation batches of the configured source."""
    tokenizer = _tokenizer(data, model)
    bytes_per_token = 1 if isinstance(tokenizer, tokenizer_lib.ByteTokenizer) else 4
    corpus = sources.open_corpus(data, model.vocab_size, bytes_per_token)
    features = packing.featurizer(corpus.kind, tokenizer)
    pad_id = tokenizer.pad_id if tokenizer is not None else 0

    def streams(documents: grain.MapDataset) -> Streams:
        return Streams(documents, features, corpus.kind, data.seq_len, data.packing, pad_id)

    train_docs = grain.MapDataset.source(corpus.train).shuffle(seed=seed).repeat()
    train = GlobalBatches(streams(train_docs), shape, sharding, prefetch=data.prefetch)
    eval_shape = BatchShape(accum=1, rows=shape.rows, seq_len=shape.seq_len)
    # A fixed order, not training.seed's: runs with different seeds evaluate on the same tokens.
    eval_docs = grain.MapDataset.source(corpus.validation).shuffle(seed=EVAL_SEED).repeat()
    evaluation = GlobalBatches(streams(eval_docs), eval_shape, sharding, prefetch=0)
    eval_batches = [next(evaluation) for _ in range(data.eval_batches)]
    evaluation.close()
    log.info("data: %s, %d training and %d held-out documents, tokenizer %s (%s tokens)",
             data.name, len(corpus.train), len(corpus.validation), data.tokenizer,
             f"{tokenizer.vocab_size:,}" if tokenizer is not None else "ids as stored")
    return Data(train, eval_batches, tokenizer)


def _tokenizer(data: DataConfig, model: ModelConfig) -> tokenizer_lib.Tokenizer | None:
    if data.tokenizer == "none":
        if data.name != "tokens":
            raise ConfigError(f"data.tokenizer=none suits only data=tokens (ids already stored); "
                              f"data={data.name} needs byte, sentencepiece:<path> or hf:<path>.")
        return None
    tokenizer = tokenizer_lib.open_tokenizer(data.tokenizer)
    tokenizer_lib.check_vocab(tokenizer, model.vocab_size)
    return tokenizer


def _local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> range:
    """The contiguous range of batch rows (axis 1) this process's devices hold."""
    index_map = sharding.addressable_devices_indices_map(global_shape)
    intervals = sorted({(i[1].start or 0, i[1].stop or global_shape[1]) for i in index_map.values()})
    lo, reach = intervals[0][0], intervals[0][0]
    for start, stop in intervals:
        if start > reach:
            raise RuntimeError(f"this process's batch rows are not contiguous: {intervals}")
        reach = max(reach, stop)
    return range(lo, reach)


class GlobalBatches:
    """An iterator of global batches: dicts of [accum, rows, seq_len] jax.Arrays `inputs`,
    `targets`, `weights`, `segment_ids`, `positions`.

    One background thread (`data.prefetch` batches ahead) runs the Grain pipeline, so the host
    prepares the next batches while the device computes. `get_state` is collective when there
    are several processes (every process must call it, as every process saves a checkpoint).
    """

    def __init__(self, streams: Streams, shape: BatchShape, sharding: NamedSharding,
                 prefetch: int = 2):
        self.shape, self.sharding = shape, sharding
        rows = _local_rows(sharding, (shape.accum, shape.rows, shape.seq_len))
        # Global sequence m·rows + r is micro-step m, row r; this process holds rows `rows`.
        self.streams = [m * shape.rows + r for m in range(shape.accum) for r in rows]
        local = grain_x.ZipIterDataset([streams.stream(j, shape.sequences)
                                        for j in self.streams])
        dataset = local.map(functools.partial(_stack, shape=(shape.accum, len(rows))))
        if prefetch:
            dataset = grain_x.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
        self._iterator = iter(dataset)
        # Stops the prefetch thread even if nobody calls close(): a thread still running at
        # interpreter exit aborts the process.
        self._finalizer = weakref.finalize(self, _close, self._iterator)
        self.next_step = 0

    def __iter__(self) -> "GlobalBatches":
        return self

    def __next__(self) -> Batch:
        local = next(self._iterator)
        self.next_step += 1
        global_shape = (self.shape.accum, self.shape.rows, self.shape.seq_len)
        return {name: jax.make_array_from_process_local_data(self.sharding, value, global_shape)
                for name, value in local.items()}

    def get_state(self) -> dict[str, Any]:
        # Map and prefetch pass the zip's state through: one state per local stream.
        local = self._iterator.get_state()["parents"]
        streams = _gather({str(j): s for j, s in zip(self.streams, local)})
        return {"step": self.next_step, "sequences": self.shape.sequences,
                "seq_len": self.shape.seq_len,
                "streams": [streams[str(j)] for j in range(self.shape.sequences)]}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = (state["sequences"], state["seq_len"])
        if saved != (self.shape.sequences, self.shape.seq_len):
            raise ConfigError(
                f"the checkpoint's data position is for a global batch of {saved[0]} sequences "
                f"of {saved[1]} tokens, this run has {self.shape.sequences} of "
                f"{self.shape.seq_len}; resume with the same global batch and data.seq_len."
            )
        streams = [packing.restore_json_state(state["streams"][j]) for j in self.streams]
        self._iterator.set_state({"parents": streams})
        self.next_step = int(state["step"])

    def close(self) -> None:
        self._finalizer()
        self._iterator = None  # freed now, not at interpreter exit when Grain's modules are gone


def _close(iterator) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def _stack(rows: tuple[dict[str, np.ndarray], ...],
           shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """One packed row per local stream (micro-step major) → [accum, local rows, seq_len]."""
    return {name: np.stack([row[name] for row in rows]).reshape(*shape, -1) for name in rows[0]}


def _gather(local: dict[str, Any]) -> dict[str, Any]:
    """Every process's stream states merged (rows replicated over tp report the same state)."""
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps(local).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array(payload.size, np.int64)))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:payload.size] = payload
    everything = np.asarray(multihost_utils.process_allgather(padded))
    merged: dict[str, Any] = {}
    for row, size in zip(everything, sizes.ravel()):
        merged.update(json.loads(row[:size].tobytes()))
    return merged
