"""Tokenizers. The byte tokenizer needs no files: ids 0-2 are PAD/BOS/EOS, then the 256 bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ByteTokenizer:
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    offset: int = 3

    @property
    def vocab_size(self) -> int:
        return self.offset + 256

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + self.offset

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= self.offset) & (ids < self.vocab_size)] - self.offset
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
