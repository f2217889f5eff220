"""Pre-tokenized flat binary files (nanoGPT's train.bin / val.bin): the `tokens` source's
windows of `seq_len + 1` ids, memory-mapped, each id checked against the model's vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tunix_train.config import ConfigError

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN_TOKENS = 1 << 20  # ids checked against the model's vocabulary at start-up, per file


class TokenWindows:
    """Windows of `seq_len + 1` ids (inputs and the shifted targets), stride `seq_len`."""

    def __init__(self, files: list[Path], tokens: list[np.memmap], seq_len: int,
                 vocab_limit: int, windows: tuple[np.ndarray, np.ndarray]):
        self.files, self._tokens = files, tokens
        self.seq_len, self.vocab_limit = seq_len, vocab_limit
        self.file_ids, self.starts = windows

    @classmethod
    def open(cls, files: list[Path], dtype: str, seq_len: int,
             vocab_limit: int) -> "TokenWindows":
        tokens = [_open_tokens(f, _DTYPES[dtype], seq_len, vocab_limit) for f in files]
        counts = [(len(t) - 1) // seq_len for t in tokens]
        windows = (np.concatenate([np.full(n, i) for i, n in enumerate(counts)]),
                   np.concatenate([np.arange(n) * seq_len for n in counts]))
        return cls(files, tokens, seq_len, vocab_limit, windows)

    def __len__(self) -> int:
        return len(self.file_ids)

    def __getitem__(self, index: int) -> np.ndarray:
        file_id, start = int(self.file_ids[index]), int(self.starts[index])
        window = np.asarray(self._tokens[file_id][start:start + self.seq_len + 1], np.int32)
        _check_ids(window, self.files[file_id], self.vocab_limit)
        return window

    def split_tail(self, fraction: float) -> tuple["TokenWindows", "TokenWindows"]:
        """(train, validation): the last `fraction` of each file's windows is held out."""
        held = np.zeros(len(self), bool)
        for file_id in range(len(self.files)):
            ids = np.flatnonzero(self.file_ids == file_id)
            held[ids[len(ids) - max(1, round(fraction * len(ids))):]] = True
        if held.all():
            raise ConfigError("data.path holds too few windows of data.seq_len tokens to hold "
                              "some out for evaluation; add data, lower data.seq_len or set "
                              "data.eval_path.")
        part = lambda mask: TokenWindows(  # noqa: E731
            self.files, self._tokens, self.seq_len, self.vocab_limit,
            (self.file_ids[mask], self.starts[mask]))
        return part(~held), part(held)


def _open_tokens(file: Path, dtype, seq_len: int, vocab_limit: int) -> np.memmap:
    size = file.stat().st_size
    if size % np.dtype(dtype).itemsize:
        raise ConfigError(f"data.path: {file} is {size} bytes, not a whole number of "
                          f"{np.dtype(dtype).name} ids; check data.dtype.")
    tokens = np.memmap(file, dtype, mode="r")
    if len(tokens) <= seq_len:
        raise ConfigError(f"data.path: {file} holds {len(tokens)} tokens, fewer than "
                          f"data.seq_len + 1 = {seq_len + 1}; lower data.seq_len.")
    _check_ids(tokens[:_SCAN_TOKENS], file, vocab_limit)
    return tokens


def _check_ids(ids: np.ndarray, file: Path, vocab_limit: int) -> None:
    top = int(ids.max())
    if top >= vocab_limit:
        raise ConfigError(f"data.path: {file} holds token id {top} but model.vocab_size="
                          f"{vocab_limit}; raise model.vocab_size or check data.dtype.")

