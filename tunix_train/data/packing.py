"""Raw documents → features → rows of `data.seq_len` packed by Grain.

A document becomes `inputs`, `targets` (inputs shifted by one) and per-token loss `weights`:
BOS + text + EOS, all targets weighted 1 (a piece of a long file gets BOS only if it is the
file's first, EOS only if its last); for SFT, BOS + prompt + response + EOS with weight 0 on
every target inside the prompt, so the loss counts the response (and its EOS) only.

Grain's packers then fill rows of `seq_len` and add `segment_ids` (1, 2, … per document in the
row, 0 for padding) and `positions` (restarting at 0 per document). The model masks attention by
segment, so documents in one row never see each other, and padding carries weight 0.

- `concat` (ConcatThenSplit): no padding; a document longer than the room left continues in
  the next row as a new segment (positions restart there too).
- `first_fit` (FirstFitPack): whole documents into the first row with room; documents longer than
  `seq_len` are truncated; the rest is padding. Suits SFT, where a split pair loses its prompt.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import grain
import numpy as np
from grain import experimental as grain_x

from tunix_train.data.sources import Piece
from tunix_train.data.tokenizer import Tokenizer

FEATURES = ("inputs", "targets", "weights")
_FIRST_FIT_BINS = 8  # rows packed together: more bins → less padding, more documents held


def featurizer(kind: str, tokenizer: Tokenizer | None) -> Callable[[Any], dict]:
    if kind == "tokens":
        eos_id = tokenizer.eos_id if tokenizer is not None else None
        return functools.partial(window_features, eos_id=eos_id)
    return functools.partial(sft_features if kind == "sft" else text_features,
                             tokenizer=tokenizer)


def _wrap(tokenizer: Tokenizer, ids: np.ndarray, first: bool = True,
          last: bool = True) -> tuple[np.ndarray, int]:
    """BOS + ids + EOS (where the tokenizer has them, and only at the document's own start and
    end); also the number of leading BOS."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None and first else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None and last else []
    return np.concatenate([bos, ids, eos]).astype(np.int32), len(bos)


def _shifted(ids: np.ndarray, weights: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    if len(ids) < 2:  # nothing to predict: one padding token that the loss ignores
        ids, weights = np.array([pad_id, pad_id], np.int32), np.zeros(1, np.float32)
    return {"inputs": ids[:-1], "targets": ids[1:], "weights": weights}


def text_features(document: str | Piece, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    piece = document if isinstance(document, Piece) else Piece(document, True, True)
    ids, _ = _wrap(tokenizer, tokenizer.encode(piece.text), piece.first, piece.last)
    return _shifted(ids, np.ones(max(len(ids) - 1, 0), np.float32), tokenizer.pad_id)


def sft_features(pair: tuple[str, str], tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    prompt, response = (tokenizer.encode(text) for text in pair)
    ids, n_bos = _wrap(tokenizer, np.concatenate([prompt, response]))
    # Target j is ids[j + 1]: a response token (or the closing EOS) from j = n_bos + |prompt| - 1.
    first_response = n_bos + len(prompt) - 1
    weights = (np.arange(len(ids) - 1) >= first_response).astype(np.float32)
    return _shifted(ids, weights, tokenizer.pad_id)


def window_features(window: np.ndarray, eos_id: int | None) -> dict[str, np.ndarray]:
    """A pre-tokenized window, already `seq_len + 1` long; with an EOS id, each EOS ends a
    document: the next token starts a new segment, and predicting across the boundary is not
    counted."""
    inputs, targets = window[:-1], window[1:]
    length = len(inputs)
    starts = np.zeros(length, bool)
    starts[0] = True
    weights = np.ones(length, np.float32)
    if eos_id is not None:
        ends = inputs == eos_id
        starts[1:] |= ends[:-1]
        weights[ends] = 0.0
    segment_ids = np.cumsum(starts).astype(np.int32)
    first = np.maximum.accumulate(np.where(starts, np.arange(length), 0))
    return {"inputs": inputs, "targets": targets, "weights": weights,
            "segment_ids": segment_ids, "positions": (np.arange(length) - first).astype(np.int32)}


def row_stream(documents: grain.MapDataset, index: int, count: int, features: Callable,
               kind: str, seq_len: int, packing: str, pad_id: int) -> grain.IterDataset:
    """Stream `index` of `count`: documents index, index + count, index + 2·count, … packed.

    Each sequence of the global batch is its own stream, so a process builds only the ones it
    holds, and the global batches do not depend on how many processes there are.
    """
    # No read threads per stream: the whole process-local pipeline is prefetched by one thread.
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    stream = documents[index::count].map(features).to_iter_dataset(read)
    if kind == "tokens":
        return stream
    lengths = {name: seq_len for name in FEATURES}
    if packing == "concat":
        packed = grain_x.ConcatThenSplitIterDataset(stream, length_struct=lengths)
    else:
        stream = stream.map(lambda doc: {k: v[:seq_len] for k, v in doc.items()})
        packed = grain_x.FirstFitPackIterDataset(stream, length_struct=lengths,
                                                 num_packing_bins=_FIRST_FIT_BINS,
                                                 shuffle_bins=False)
    return packed.map(functools.partial(_finish_row, pad_id=pad_id))


def _finish_row(packed: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    segment_ids = packed["inputs_segment_ids"]
    padding = segment_ids == 0
    inputs, targets = packed["inputs"].copy(), packed["targets"].copy()
    inputs[padding] = targets[padding] = pad_id
    return {"inputs": inputs, "targets": targets, "weights": packed["weights"],
            "segment_ids": segment_ids, "positions": packed["inputs_positions"]}


def restore_json_state(state: Any) -> Any:
    """Undoes what a JSON round trip does to a packer's state.

    Grain's ConcatThenSplit compares its `remainder_slices` with the tuple (-1, -1); after JSON
    they are lists, which compare unequal, and a restored iterator would skip data.
    """
    if isinstance(state, dict):
        return {k: ({f: tuple(s) for f, s in v.items()} if k == "remainder_slices"
                    else restore_json_state(v)) for k, v in state.items()}
    if isinstance(state, list):
        return [restore_json_state(v) for v in state]
    return state
