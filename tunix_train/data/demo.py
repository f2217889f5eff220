"""`python -m tunix_train.data.demo <dir>`: small local corpora in every supported format, and a
SentencePiece model and a BPE `tokenizer.json` trained on them, all from the bundled corpus (the
standard library's source), in seconds and offline. docs/data.md's examples and the tests use it.

    <dir>/text/*.txt        one document per file          data=text
    <dir>/docs.jsonl        {"text": …} per line            data=jsonl
    <dir>/docs.parquet      a `text` column                 data=parquet
    <dir>/sft.jsonl         {"prompt": …, "response": …}    data=sft
    <dir>/tokens.bin        uint16 byte-tokenizer ids       data=tokens
    <dir>/spm.model         SentencePiece, 500 pieces       data.tokenizer=sentencepiece:…
    <dir>/bpe/              tokenizer.json + config, 500    data.tokenizer=hf:…
    <dir>/grpo/sums_sft.jsonl  {"prompt": "3+4=", "response": "7"}  data=sft
    <dir>/grpo/sums.jsonl      {"prompt": "3+4=", "answer": "7"}    trainer=grpo data=prompts
    <dir>/grpo/sums.parquet    the same records                     trainer=grpo data=prompts
    <dir>/dpo/pairs.jsonl      {"prompt": "reverse abc:", "chosen": " cba", "rejected": " abc"}
                                                                    trainer=dpo data=preferences
    (in a folder of their own: data.path globs over <dir> would take prompts for documents)
"""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import numpy as np

from tunix_train.data import builtin
from tunix_train.data.tokenizer import ByteTokenizer

VOCAB_SIZE = 500  # both trained tokenizers; fits gemma3_tiny's 512 embedding rows


def documents(max_bytes: int = 300_000) -> list[str]:
    """Top-level definitions of standard-library modules: a few hundred documents of varied
    length, from a few tokens to several thousand."""
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in builtin.files(max_bytes))
    pieces = (piece.strip() for text in texts for piece in re.split(r"\n(?=def |class )", text))
    return [piece for piece in pieces if piece]


def write_text(out: Path, docs: list[str]) -> Path:
    (out / "text").mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (out / "text" / f"doc{i:04d}.txt").write_text(doc)
    return out / "text"


def write_jsonl(out: Path, docs: list[str]) -> Path:
    path = out / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(out: Path, docs: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = out / "docs.parquet"
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path,
                   row_group_size=64)
    return path


def write_sft(out: Path, docs: list[str], pairs: int = 2000) -> Path:
    """A task a tiny model learns in a few hundred steps: spell an identifier backwards."""
    words = sorted({w for d in docs for w in re.findall(r"[a-z_]{4,12}", d)})
    words = [words[i] for i in np.random.default_rng(0).permutation(len(words))[:pairs]]
    path = out / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"reverse {w}:", "response": f" {w[::-1]}"})
                            + "\n" for w in words))
    return path


def write_sums(out: Path) -> Path:
    """A verifiable task for GRPO (docs/grpo.md): one-digit sums, every pair of digits. A few
    SFT steps on the pairs teach the format and a little arithmetic; GRPO prompts carry the
    answer to check (sums.jsonl, the same in sums.parquet). Returns the folder."""
    out = out / "grpo"
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    (out / "sums_sft.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n" for a, b in pairs))
    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    (out / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), out / "sums.parquet")
    return out


def write_preferences(out: Path, docs: list[str], pairs: int = 1000) -> Path:
    """Preference pairs for DPO (docs/dpo.md): the identifier spelt backwards is preferred to
    it spelt forwards. Returns pairs.jsonl's path."""
    out = out / "dpo"
    out.mkdir(parents=True, exist_ok=True)
    words = sorted({w for d in docs for w in re.findall(r"[a-z_]{4,10}", d) if w != w[::-1]})
    words = [words[i] for i in np.random.default_rng(1).permutation(len(words))[:pairs]]
    path = out / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"reverse {w}:", "chosen": f" {w[::-1]}",
                                        "rejected": f" {w}"}) + "\n" for w in words))
    return path


def write_tokens(out: Path, docs: list[str]) -> Path:
    """nanoGPT's layout: every document's ids followed by EOS, as one flat uint16 array."""
    tokenizer = ByteTokenizer()
    ids = [np.append(tokenizer.encode(d), tokenizer.eos_id) for d in docs]
    path = out / "tokens.bin"
    np.concatenate(ids).astype(np.uint16).tofile(path)
    return path


def train_sentencepiece(out: Path, docs: list[str], vocab_size: int = VOCAB_SIZE) -> Path:
    import sentencepiece

    model = io.BytesIO()
    lines = (line for d in docs for line in d.splitlines() if line.strip())
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,  # Gemma's numbering
        minloglevel=2,
    )
    path = out / "spm.model"
    path.write_bytes(model.getvalue())
    return path


def train_bpe(out: Path, docs: list[str], vocab_size: int = VOCAB_SIZE) -> Path:
    """A byte-level BPE in Hugging Face `tokenizers` format, with its special tokens named in
    tokenizer_config.json as Hugging Face model directories do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    directory = out / "bpe"
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_all(out: Path) -> None:
    """Writes every demo file under `out` and prints each file's path (a folder's files one by
    one, except the text/ folder's hundreds of documents)."""
    out.mkdir(parents=True, exist_ok=True)
    docs = documents()
    written = [write(out, docs) for write in (write_text, write_jsonl, write_parquet, write_sft,
                                              write_tokens, train_sentencepiece, train_bpe)]
    written += [write_sums(out), write_preferences(out, docs)]
    for path in written:
        if path.is_dir() and path.name != "text":
            for file in sorted(path.iterdir()):
                print(file)
        else:
            print(f"{path}/ ({len(list(path.iterdir()))} documents)" if path.is_dir() else path)


if __name__ == "__main__":
    write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "demo_data"))
