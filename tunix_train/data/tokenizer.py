"""Tokenizers, chosen by `data.tokenizer`: `byte`, `sentencepiece:<model file>` or
`hf:<tokenizer.json or a directory holding it>`. All read local files only.

Each exposes `vocab_size`, `encode(text) -> int32 ids`, `decode(ids) -> text` and the special ids BOS/EOS/PAD taken from
the tokenizer itself (`None` where it has none: a document then simply goes without that token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from tunix_train.config import ConfigError


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """Needs no files: ids 0-2 are PAD/BOS/EOS, then the 256 byte values."""

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


class SentencePieceTokenizer:
    """A SentencePiece model file (Gemma's format); special ids are the model's own."""

    def __init__(self, path: Path):
        import sentencepiece

        self._model = sentencepiece.SentencePieceProcessor()
        self._model.Load(str(path))  # raises OSError/RuntimeError on a missing or corrupt file
        self.vocab_size = self._model.GetPieceSize()
        self.bos_id = _present(self._model.bos_id())
        self.eos_id = _present(self._model.eos_id())
        self.pad_id = _present(self._model.pad_id()) or 0

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._model.EncodeAsIds(text), dtype=np.int32)

    def decode(self, ids) -> str:
        return self._model.DecodeIds([int(i) for i in ids])


# Names special tokens go by in common tokenizer.json files, when no tokenizer_config.json says.
_SPECIAL_NAMES = {
    "bos": ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>"),
    "eos": ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
}


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizers` file. Special tokens come from a `tokenizer_config.json`
    next to it when there is one, else from the usual names (`<bos>`, `</s>`, `<|endoftext|>` …)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        self._tokenizer = HFTokenizer.from_file(str(file))  # raises on a missing or corrupt file
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        named = _configured_specials(file.parent / "tokenizer_config.json")
        ids = {}
        for kind, candidates in _SPECIAL_NAMES.items():
            names = ([named[kind]] if kind in named else []) + list(candidates)
            ids[kind] = next((i for i in map(self._tokenizer.token_to_id, names)
                              if i is not None), None)
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"] or 0

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _present(token_id: int) -> int | None:
    return None if token_id < 0 else token_id  # SentencePiece says -1 for "not defined"


def _configured_specials(config_file: Path) -> dict[str, str]:
    if not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text())
    out = {}
    for kind in ("bos", "eos", "pad"):
        token = config.get(f"{kind}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            out[kind] = token
    return out


_KINDS = {"sentencepiece": SentencePieceTokenizer, "hf": HuggingFaceTokenizer}


def open_tokenizer(source: str) -> Tokenizer:
    """`byte`, `sentencepiece:<path>` or `hf:<path>` → a tokenizer, or one clear ConfigError."""
    if source == "byte":
        return ByteTokenizer()
    kind, _, location = source.partition(":")
    if kind not in _KINDS or not location:
        raise ConfigError(
            f"data.tokenizer={source!r} is not byte, sentencepiece:<model file> or "
            f"hf:<tokenizer.json or its directory>."
        )
    path = Path(location).expanduser()
    if not path.exists():
        raise ConfigError(f"data.tokenizer={source!r}: {path} does not exist; fix the path.")
    try:
        return _KINDS[kind](path)
    except Exception as error:  # each library has its own error types for a bad file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"data.tokenizer={source!r}: {path} cannot be read as a {kind} tokenizer ({reason}); "
            f"point it at a valid file."
        ) from error


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens; raise model.vocab_size to at least "
            f"{tokenizer.vocab_size}."
        )
