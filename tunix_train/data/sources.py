"""Document sources: local files → random-access sequences of raw documents, split into a
training and a held-out part.

A source only indexes its files at start-up (file names, line offsets, Parquet row counts, token
counts); a document's text is read when the pipeline asks for it, so each process reads only the
documents of its own batch rows. Raw documents are `Piece`s of text files, `str` (records),
`(prompt, response)` pairs (SFT) or int32 windows of `seq_len + 1` ids (the `tokens` source,
already tokenized and cut).

The held-out split is fixed by the data alone, never by the seed or the process count: a stable
hash of each file's name (text) or of (file, record number) (jsonl, Parquet) sends about
`data.validation_fraction` of the documents to validation; `tokens` holds out the tail of each
file. `data.eval_path` replaces all of this with separate held-out files.
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tunix_train.config import ConfigError, DataConfig
from tunix_train.data import builtin
from tunix_train.data.token_files import TokenWindows

SOURCES = ("builtin", "text", "jsonl", "parquet", "tokens")


@dataclass(frozen=True)
class Corpus:
    train: Sequence[Any]
    validation: Sequence[Any]
    kind: str  # "text" | "sft" | "tokens": how raw documents become features (see packing.py)


def open_corpus(data: DataConfig, vocab_limit: int, bytes_per_token: int = 4) -> Corpus:
    """The configured source, split. `vocab_limit` bounds the ids a `tokens` file may hold;
    `bytes_per_token` (1 for the byte tokenizer, about 4 for subword ones) sizes text pieces."""
    if data.name not in SOURCES:
        raise ConfigError(f"data.name={data.name!r} is not one of {', '.join(SOURCES)}.")
    if data.prompt_field and data.name not in ("jsonl", "parquet"):
        raise ConfigError(f"data.prompt_field/response_field (SFT) need records: data=jsonl or "
                          f"data=parquet, not data={data.name}.")
    if data.name == "builtin":
        files = builtin.files(data.max_corpus_bytes)
        return _split_files(files, None, data, builtin.stdlib_root(), bytes_per_token)
    files = resolve(data.path, data.name, "data.path")
    eval_files = resolve(data.eval_path, data.name, "data.eval_path") if data.eval_path else None
    if data.name == "text":
        root = Path(os.path.commonpath(files))
        return _split_files(files, eval_files, data, root, bytes_per_token)
    if data.name == "tokens":
        return _tokens(files, eval_files, data, vocab_limit)
    return _records(files, eval_files, data)


def _tokens(files: list[Path], eval_files: list[Path] | None, data: DataConfig,
            vocab_limit: int) -> Corpus:
    open_ = functools.partial(TokenWindows.open, dtype=data.dtype, seq_len=data.seq_len,
                              vocab_limit=vocab_limit)
    whole = open_(files)
    if eval_files:
        return Corpus(whole, open_(eval_files), "tokens")
    return Corpus(*whole.split_tail(data.validation_fraction), "tokens")


def _records(files: list[Path], eval_files: list[Path] | None, data: DataConfig) -> Corpus:
    kind = "sft" if data.prompt_field else "text"
    fields = (data.prompt_field, data.response_field) if data.prompt_field else (data.text_field,)
    open_ = functools.partial(JsonLines if data.name == "jsonl" else ParquetRows, fields=fields)
    whole = open_(files)
    if eval_files:
        return Corpus(whole, open_(eval_files), kind)
    return Corpus(*_subsets(whole, whole.held_out(data.validation_fraction), data), kind)


JSON_LINES = (".jsonl", ".json")
CHECK_ALL_BYTES = 64 * 2**20  # JSON lines files up to this size in all: every line, at start-up
FIRST_RECORDS = 32  # larger ones: the first lines of each file read before anything compiles
FIRST_FILES = 8  # of their first 8 files (a folder of thousands of shards)


def check_records(data: DataConfig) -> None:
    """The JSON lines files the data keys name parse as JSON, line by line, before anything
    compiles: a broken file is one sentence, not an error after minutes of compiling or in the
    middle of a run. Every line of them when they hold at most CHECK_ALL_BYTES (about a second
    of parsing); past that, the first lines of the first files, and a broken line further in
    is found when it is read (the run then stops naming it and the checkpoint to go on from)."""
    if data.name not in ("jsonl", "prompts", "preferences"):
        return
    for key, pattern in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if not pattern:
            continue
        json_files = [f for f in resolve(pattern, data.name, key) if f.suffix in JSON_LINES]
        whole = sum(f.stat().st_size for f in json_files) <= CHECK_ALL_BYTES
        for file in json_files if whole else json_files[:FIRST_FILES]:
            with open(file, encoding="utf-8", errors="replace") as lines:
                for number, line in enumerate(
                        lines if whole else itertools.islice(lines, FIRST_RECORDS), 1):
                    try:
                        if line.strip():
                            json.loads(line)
                    except ValueError as error:
                        where = f"line {number} of {file}"
                        raise ConfigError(not_json(key, where, error)) from None


def not_json(key: str, where: str, error: ValueError) -> str:
    return (f"{key}: {where} is not JSON ({error}); each line must be one JSON object: fix or "
            f"remove that line.")


def resolve(pattern: str | None, source: str, key: str) -> list[Path]:
    """A file, a directory (all files under it) or a glob → sorted non-empty files."""
    if not pattern:
        raise ConfigError(f"data={source} needs {key}=<a file, a directory or a glob>.")
    expanded = os.path.expanduser(pattern)
    if glob.has_magic(expanded):
        files = [Path(p) for p in sorted(glob.glob(expanded, recursive=True)) if Path(p).is_file()]
        if not files:
            raise ConfigError(f"{key}={pattern!r} matches no files; check the pattern.")
    elif Path(expanded).is_dir():
        files = sorted(p for p in Path(expanded).rglob("*")
                       if p.is_file() and not p.name.startswith("."))
        if not files:
            raise ConfigError(f"{key}={pattern!r} is a directory with no files in it.")
    elif Path(expanded).is_file():
        files = [Path(expanded)]
    else:
        raise ConfigError(f"{key}={pattern!r} does not exist; give an existing file, directory "
                          f"or glob.")
    for file in files:
        if file.stat().st_size == 0:
            raise ConfigError(f"{key}: {file} is empty; remove it or narrow {key}.")
    return files


# ---------------------------------------------------------------------------------------------
# Text files: one document per file, read in pieces.

@dataclass(frozen=True)
class Piece:
    """Part of a document: only its first piece opens with BOS, only its last ends with EOS."""

    text: str
    first: bool
    last: bool


def _continuation_bytes(data: bytes, at: int) -> int:
    """How many UTF-8 continuation bytes (0b10xxxxxx) start at `at`: a cut there moves past them."""
    count = 0
    while count < 3 and at + count < len(data) and data[at + count] & 0xC0 == 0x80:
        count += 1
    return count


class TextFiles:
    """Files cut into pieces of at most `piece_bytes` (at UTF-8 character boundaries), each piece
    shuffled and dealt like a document of its own: a long file (a book, a large module) does not
    then fill its batch row for hundreds of consecutive steps. Only the piece is read."""

    def __init__(self, files: Sequence[Path], piece_bytes: int):
        self.files = list(files)
        self.sizes = np.array([f.stat().st_size for f in self.files], np.int64)
        counts = np.maximum(1, -(-self.sizes // piece_bytes))
        self.file_ids = np.repeat(np.arange(len(self.files)), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        self.starts = (np.arange(len(self.file_ids)) - first) * piece_bytes
        self.stops = np.minimum(self.starts + piece_bytes, self.sizes[self.file_ids])

    def __len__(self) -> int:
        return len(self.file_ids)

    def __getitem__(self, index: int) -> Piece:
        file_id = int(self.file_ids[index])
        start, stop = int(self.starts[index]), int(self.stops[index])
        size = int(self.sizes[file_id])
        with open(self.files[file_id], "rb") as f:
            f.seek(start)
            data = f.read(stop - start + 3)  # up to 3 more: the rest of a character cut at `stop`
        head = _continuation_bytes(data, 0) if start else 0
        tail = stop - start + (_continuation_bytes(data, stop - start) if stop < size else 0)
        return Piece(data[head:tail].decode("utf-8", errors="replace"), start == 0, stop >= size)


def _split_files(files: list[Path], eval_files: list[Path] | None, data: DataConfig,
                 root: Path, bytes_per_token: int) -> Corpus:
    # About one row of tokens per piece: longer pieces keep a row on one file for several
    # consecutive steps, which measurably slowed the default run's learning.
    piece_bytes = bytes_per_token * data.seq_len
    if eval_files:
        return Corpus(TextFiles(files, piece_bytes), TextFiles(eval_files, piece_bytes), "text")
    root = root if root.is_dir() else root.parent
    held = [zlib.crc32(str(f.relative_to(root)).encode()) % 10_000
            < data.validation_fraction * 10_000 for f in files]
    train = [f for f, h in zip(files, held) if not h]
    validation = [f for f, h in zip(files, held) if h]
    if not validation:  # a few files may hash none to validation: hold out the last one
        if len(train) < 2:
            raise ConfigError(_single_document(data))
        validation.append(train.pop())
    return Corpus(TextFiles(train, piece_bytes), TextFiles(validation, piece_bytes), "text")


def _single_document(data: DataConfig) -> str:
    return (f"data.path={data.path!r} holds a single document, which leaves none to hold out for "
            f"evaluation; add documents or set data.eval_path.")


# ---------------------------------------------------------------------------------------------
# Records: JSON lines and Parquet rows. Both index (file, record) pairs up front.

def _record_hash(file_ids: np.ndarray, records: np.ndarray, names: list[str]) -> np.ndarray:
    """A stable per-record value in [0, 1): a multiplicative mix of the file name and row."""
    file_salt = np.array([zlib.crc32(n.encode()) for n in names], np.uint64)[file_ids]
    mixed = (records.astype(np.uint64) + file_salt * np.uint64(0x9E3779B97F4A7C15))
    mixed = (mixed ^ (mixed >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
    return (mixed >> np.uint64(40)).astype(np.float64) / float(1 << 24)


class _Subset:
    def __init__(self, source, indices: np.ndarray):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        return self.source[int(self.indices[index])]


def _subsets(whole, held_out: np.ndarray, data: DataConfig) -> tuple[_Subset, _Subset]:
    validation = np.flatnonzero(held_out)
    train = np.flatnonzero(~held_out)
    if len(validation) == 0:
        if len(train) < 2:
            raise ConfigError(_single_document(data))
        train, validation = train[:-1], train[-1:]
    return _Subset(whole, train), _Subset(whole, validation)


class _Records:
    """What JSON lines and Parquet share: field extraction with clear errors."""

    fields: tuple[str, ...]
    names: list[str]
    file_ids: np.ndarray
    records: np.ndarray  # record number within its file

    def __len__(self) -> int:
        return len(self.file_ids)

    def held_out(self, fraction: float) -> np.ndarray:
        return _record_hash(self.file_ids, self.records, self.names) < fraction

    def _check_fields(self, present: Sequence[str], where: str) -> None:
        missing = [f for f in self.fields if f not in present]
        if missing:
            key = "data.text_field" if len(self.fields) == 1 else "data.prompt_field/response_field"
            raise ConfigError(
                f"{key}: {where} has no field {missing[0]!r} (it has {', '.join(present) or 'none'}); "
                f"set {key} to one of them."
            )

    def _extract(self, record: Any, where: str):
        if not isinstance(record, dict):
            raise ConfigError(f"data.path: {where} is not a JSON object; each line must be one.")
        self._check_fields(list(record), where)
        values = tuple(record[f] for f in self.fields)
        if not all(isinstance(v, str) for v in values):
            raise ConfigError(f"data.path: {where} has a field among {self.fields} that is not a "
                              f"string.")
        return values[0] if len(values) == 1 else values


def _line_spans(file: Path, chunk: int = 1 << 26) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) byte offsets of the lines of a file that can hold a JSON object."""
    data = np.memmap(file, np.uint8, mode="r")
    breaks = [np.flatnonzero(data[at:at + chunk] == 10) + at for at in range(0, len(data), chunk)]
    ends = np.concatenate([*breaks, [len(data)]]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    keep = ends - starts >= 2  # "{}" is the shortest JSON object; skips blank lines
    return starts[keep], ends[keep]


class JsonLines(_Records):
    def __init__(self, files: list[Path], fields: tuple[str, ...]):
        self.files, self.fields, self.names = files, fields, [f.name for f in files]
        spans = [_line_spans(f) for f in files]
        for file, (starts, _) in zip(files, spans):
            if len(starts) == 0:
                raise ConfigError(f"data.path: {file} has no JSON lines; remove it or fix it.")
        self.file_ids = np.concatenate([np.full(len(s), i) for i, (s, _) in enumerate(spans)])
        self.records = np.concatenate([np.arange(len(s)) for s, _ in spans])
        self.starts = np.concatenate([s for s, _ in spans])
        self.ends = np.concatenate([e for _, e in spans])
        for i in range(len(files)):  # the first record of each file, before anything runs
            self[int(np.searchsorted(self.file_ids, i))]

    def __getitem__(self, index: int):
        file = self.files[self.file_ids[index]]
        start, end = int(self.starts[index]), int(self.ends[index])
        with open(file, "rb") as f:
            f.seek(start)
            line = f.read(end - start)
        where = f"line {self.records[index] + 1} of {file}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(not_json("data.path", where, error)) from None
        return self._extract(record, where)


class ParquetRows(_Records):
    """Rows read a row group at a time (column chunks of the wanted fields only), cached."""

    def __init__(self, files: list[Path], fields: tuple[str, ...]):
        import pyarrow.parquet as pq

        self.files, self.fields, self.names = files, fields, [f.name for f in files]
        self._meta = []
        for file in files:
            try:
                meta = pq.ParquetFile(file).metadata
            except Exception as error:  # pyarrow raises ArrowInvalid and friends
                raise ConfigError(f"data.path: {file} is not a Parquet file ({error}).") from None
            if meta.num_rows == 0:
                raise ConfigError(f"data.path: {file} is empty; remove it or narrow data.path.")
            self._check_fields(meta.schema.to_arrow_schema().names, str(file))
            self._meta.append(np.cumsum([0] + [meta.row_group(g).num_rows
                                               for g in range(meta.num_row_groups)]))
        self.file_ids = np.concatenate([np.full(m[-1], i) for i, m in enumerate(self._meta)])
        self.records = np.concatenate([np.arange(m[-1]) for m in self._meta])

    def __getitem__(self, index: int):
        file_id, row = int(self.file_ids[index]), int(self.records[index])
        group = int(np.searchsorted(self._meta[file_id], row, side="right")) - 1
        columns = self._row_group(file_id, group)
        record = {f: columns[f][row - self._meta[file_id][group]] for f in self.fields}
        return self._extract(record, f"{self.files[file_id]} row {row}")

    @functools.lru_cache(maxsize=8)  # noqa: B019 (one source per run; the cache dies with it)
    def _row_group(self, file_id: int, group: int) -> dict[str, list]:
        import pyarrow.parquet as pq

        table = pq.ParquetFile(self.files[file_id]).read_row_group(group, columns=list(self.fields))
        return table.to_pydict()
