"""The data pipeline: every source and tokenizer trains, packing isolates documents, SFT weights
only the response, a restored iterator continues exactly, and bad input is one sentence."""

import contextlib
import io
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import REPO, TINY, compose_config, mesh_arg, run_cli
from tunix_train import validation
from tunix_train.config import ConfigError
from tunix_train.data import demo, sources
from tunix_train.models import families
from tunix_train.training.setup import Setup
from tunix_train.training.train_step import jit_eval_step

ROWS = 4
STEPS = 30  # enough for the held-out loss to fall clearly from its initial ~ln(vocab)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Every format, a SentencePiece model and a BPE tokenizer, trained here in seconds."""
    out = tmp_path_factory.mktemp("corpus")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        demo.write_all(out)
    # What it prints is what it wrote: every file, text/'s documents as one line.
    written = {str(p) for p in out.rglob("*") if p.is_file() and p.parent.name != "text"}
    lines = printed.getvalue().splitlines()
    assert {line for line in lines if not line.endswith("documents)")} == written
    assert f"{out / 'text'}/ ({len(list((out / 'text').iterdir()))} documents)" in lines
    return out


def _cfg(*overrides):
    return compose_config(*TINY, mesh_arg(1, 1), f"training.micro_batch_size={ROWS}", *overrides)


def _build(cfg, devices=None):
    return Setup.create(cfg, devices or jax.devices()[:1]).open_data()


def _host(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# Each source and tokenizer trains.

SOURCES = {
    "text+byte": ["data=text", "data.path={c}/text/*.txt"],
    "jsonl+hf": ["data=jsonl", "data.path={c}/docs.jsonl", "data.tokenizer=hf:{c}/bpe"],
    "parquet+sentencepiece": ["data=parquet", "data.path={c}/docs.parquet",
                              "data.tokenizer=sentencepiece:{c}/spm.model"],
    "tokens": ["data=tokens", "data.path={c}/tokens.bin"],
    "tokens+eos": ["data=tokens", "data.path={c}/tokens.bin", "data.tokenizer=byte"],
    "sft": ["data=sft", "data.path={c}/sft.jsonl"],
}


@pytest.fixture(scope="module")
def trainer():
    """One compiled step for every source: they share the model, batch shape and vocabulary."""
    cfg = _cfg()
    setup = Setup.create(cfg, jax.devices()[:1])
    step = setup.train_step()
    eval_step = jit_eval_step(setup.state, setup.options, setup.batch_sharding)

    def evaluate(params, batches):
        sums = jax.device_get([eval_step(params, b) for b in batches])
        return sum(float(s[0]) for s in sums) / sum(float(s[1]["tokens"]) for s in sums)

    return step, evaluate, setup.fresh_state()


@pytest.mark.parametrize("source", SOURCES)
def test_each_source_and_tokenizer_trains(corpus, trainer, source):
    step, evaluate, initial = trainer
    data = _build(_cfg(*(o.format(c=corpus) for o in SOURCES[source])))
    state = jax.tree.map(jnp.copy, initial)  # the step donates its input
    before = evaluate(state["params"], data.eval_batches)
    for _ in range(STEPS):
        state, metrics = step(state, next(data.train))
    after = evaluate(state["params"], data.eval_batches)
    data.close()
    print(source, before, after)
    assert np.isfinite(after) and after < before - 0.5, (before, after)


# ---------------------------------------------------------------------------------------------
# Packing.

def _row_of_documents(texts, seq_len=64):
    """One packed row holding `texts` (a finite stream, so the row ends in padding)."""
    import grain

    from tunix_train.data import packing
    from tunix_train.data.tokenizer import ByteTokenizer

    features = packing.featurizer("text", ByteTokenizer())
    stream = packing.row_stream(grain.MapDataset.source(texts), 0, 1, features, "text",
                                seq_len, "concat", pad_id=0)
    return next(iter(stream))


def test_packed_documents_do_not_attend_to_each_other():
    cfg = compose_config(*TINY, "model.num_layers=2", "model.global_every=2").model
    graphdef, params = nnx.split(families.build(cfg, nnx.Rngs(0)))  # one local, one global layer
    forward = jax.jit(lambda p, *args: nnx.merge(graphdef, p)(*args))
    second = "print('second document')"
    row = _row_of_documents(["x = 1 + 2", second])
    changed = _row_of_documents(["y = 7 * 9", second])  # same length, other bytes
    assert list(np.unique(row["segment_ids"])) == [0, 1, 2]
    doc2 = row["segment_ids"] == 2

    def logits(r, segments=True):
        return np.asarray(forward(params, r["inputs"][None], r["positions"][None],
                                  r["segment_ids"][None] if segments else None))[0]

    np.testing.assert_allclose(logits(row)[doc2], logits(changed)[doc2], atol=1e-6)
    # Positions restart: document 2 in the packed row reads exactly as document 2 alone.
    alone = _row_of_documents([second])
    np.testing.assert_allclose(logits(row)[doc2], logits(alone)[alone["segment_ids"] == 1],
                               atol=1e-5)
    # Without the segment mask, document 1 would leak into document 2.
    assert np.abs(logits(row, False)[doc2] - logits(changed, False)[doc2]).max() > 1e-3
    assert np.all(row["weights"][row["segment_ids"] == 0] == 0)  # padding is not counted


def test_every_row_is_full_or_padded_with_zero_weight(corpus):
    data = _build(_cfg("data=text", f"data.path={corpus}/text"))
    batch = _host(next(data.train))
    data.close()
    segments, positions = batch["segment_ids"], batch["positions"]
    # Positions count up inside a segment and restart where a new one begins.
    new_segment = np.diff(segments, axis=-1) != 0
    steps = np.diff(positions, axis=-1)
    assert np.all(steps[~new_segment] == 1) and np.all(positions[..., 1:][new_segment] == 0)
    assert np.all(batch["weights"][segments == 0] == 0)


@pytest.mark.parametrize("piece_bytes", [1, 2, 5, 64, 10_000])
def test_text_files_are_read_in_pieces_that_tile_them(tmp_path, piece_bytes):
    from tunix_train.data.sources import TextFiles

    text = "naïve café ✓ 😀 " * 20 + "end"  # 1- to 4-byte characters
    (tmp_path / "a.txt").write_text(text)
    files = TextFiles([tmp_path / "a.txt"], piece_bytes)
    pieces = [files[i] for i in range(len(files))]
    assert "".join(p.text for p in pieces) == text  # cut only between characters, nothing lost
    assert [p.first for p in pieces] == [True] + [False] * (len(pieces) - 1)
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]


@pytest.mark.parametrize("max_bytes", [1, 400_000, 10**12])
def test_the_builtin_corpus_is_the_standard_librarys_sorted_files_outside_the_skipped_ones(
        max_bytes):
    """Against the definition: every non-empty `.py` file below the standard library whose
    folders are none of the skipped ones, in sorted order, until `max_bytes` is reached."""
    from tunix_train.data import builtin

    root = builtin.stdlib_root()
    wanted, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if builtin._SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        if size := path.stat().st_size:
            wanted.append(path)
            total += size
        if total >= max_bytes:
            break
    assert builtin.files(max_bytes) == wanted and wanted


def test_sft_weights_only_the_response(corpus):
    from tunix_train.data.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    # Rows of 64 hold every pair whole (first_fit truncates longer ones).
    data = _build(_cfg("data=sft", f"data.path={corpus}/sft.jsonl", "data.seq_len=64"))
    batch = _host(next(data.train))
    data.close()
    pairs = [json.loads(line) for line in (corpus / "sft.jsonl").read_text().splitlines()]
    responses = {p["response"] for p in pairs}
    inputs, targets, weights = (batch[k].reshape(-1, batch[k].shape[-1])
                                for k in ("inputs", "targets", "weights"))
    segments = batch["segment_ids"].reshape(inputs.shape)
    checked = 0
    for r in range(inputs.shape[0]):
        for s in set(np.unique(segments[r])) - {0}:
            here = segments[r] == s
            pair = tokenizer.decode(inputs[r][here][1:])  # BOS, prompt, response (no EOS)
            counted = targets[r][here][weights[r][here] == 1]
            assert counted[-1] == tokenizer.eos_id
            response = tokenizer.decode(counted[:-1])
            assert response in responses  # the counted targets are the response, in full
            assert pair.startswith("reverse ") and pair.endswith(":" + response)
            prompt_length = len(pair) - len(response)  # bytes = tokens for the byte tokenizer
            assert np.sum(weights[r][here] == 0) == prompt_length
            checked += 1
    assert checked >= ROWS  # first_fit puts several whole pairs into each row


# ---------------------------------------------------------------------------------------------
# Order and restore.

@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_restored_iterator_continues_exactly(corpus, packing):
    # Short documents in short rows: states fall inside, between and across documents.
    overrides = ["data=sft", f"data.path={corpus}/sft.jsonl", "data.seq_len=16",
                 f"data.packing={packing}"]
    cfg = _cfg(*overrides, "training.gradient_accumulation_steps=2")
    reference = _build(cfg)
    batches = [_host(next(reference.train)) for _ in range(8)]
    states = []
    restored = _build(cfg)
    for k in range(1, 8):
        next(restored.train)
        states.append(json.loads(json.dumps(restored.train.get_state())))  # as a checkpoint
    reference.close()
    restored.close()
    for k, state in enumerate(states, start=1):
        # A fresh iterator on another mesh and accumulation split with the same global batch:
        # 4 fsdp shards × 2 rows × 1 micro-step instead of 1 × 4 × 2.
        other = _build(compose_config(*TINY, *overrides, mesh_arg(4, 1),
                                      "training.micro_batch_size=2"), jax.devices()[:4])
        other.train.set_state(state)
        got = _host(next(other.train))
        other.close()
        for name, value in batches[k].items():
            np.testing.assert_array_equal(got[name], value.reshape(got[name].shape),
                                          err_msg=f"batch {k + 1} {name}")


def test_order_depends_only_on_the_global_batch(corpus):
    overrides = ["data=jsonl", f"data.path={corpus}/docs.jsonl", "data.seq_len=16"]
    # 8 sequences per step: 1 device × 4 rows × 2 micro-steps, and fsdp 2 × tp 4 × 4 rows × 1.
    one = _build(_cfg(*overrides, "training.gradient_accumulation_steps=2"))
    eight = _build(compose_config(*TINY, *overrides, mesh_arg(2, 4),
                                  "training.micro_batch_size=4"), jax.devices())
    for _ in range(3):
        a, b = _host(next(one.train)), _host(next(eight.train))
        assert a["inputs"].shape == (2, 4, 16) and b["inputs"].shape == (1, 8, 16)
        for name in a:
            np.testing.assert_array_equal(a[name].reshape(b[name].shape), b[name])
    one.close()
    eight.close()


def test_resuming_with_another_global_batch_is_refused(corpus):
    data = _build(_cfg())
    state = data.train.get_state()
    data.close()
    other = _build(_cfg("training.micro_batch_size=2"))
    with pytest.raises(ConfigError, match="resume with the same global batch"):
        other.train.set_state(state)
    other.close()


# ---------------------------------------------------------------------------------------------
# Bad input: one sentence naming the key.

def _bad_inputs(corpus, tmp):
    (tmp / "empty.txt").write_text("")
    (tmp / "broken.model").write_bytes(b"not a model")
    (tmp / "odd.bin").write_bytes(b"\x01\x02\x03")
    big = np.arange(600, dtype=np.uint16).repeat(4)
    big.tofile(tmp / "big.bin")
    return {
        "missing path": (["data=text"], "data=text needs data.path="),
        "path does not exist": (["data=text", f"data.path={tmp}/nowhere.txt"], "does not exist"),
        "glob matches nothing": (["data=jsonl", f"data.path={tmp}/*.jsonl"], "matches no files"),
        "empty file": (["data=text", f"data.path={tmp}/empty.txt"], "is empty"),
        "missing text_field": (["data=jsonl", f"data.path={corpus}/docs.jsonl",
                                "data.text_field=body"], "has no field 'body'"),
        "missing parquet column": (["data=parquet", f"data.path={corpus}/docs.parquet",
                                    "data.text_field=body"], "has no field 'body'"),
        "unreadable tokenizer": ([f"data.tokenizer=sentencepiece:{tmp}/broken.model"],
                                 "cannot be read as a sentencepiece tokenizer"),
        "unreadable hf tokenizer": ([f"data.tokenizer=hf:{tmp}/broken.model"],
                                    "cannot be read as a hf tokenizer"),
        "missing tokenizer": ([f"data.tokenizer=hf:{tmp}/none.json"], "does not exist"),
        "vocab larger than the model's": (
            [f"data.tokenizer=hf:{corpus}/bpe", "model.vocab_size=300"],
            "model.vocab_size=300 is smaller than the tokenizer's 500 tokens"),
        "ids larger than the model's": (["data=tokens", f"data.path={tmp}/big.bin"],
                                        "holds token id 599 but model.vocab_size=512"),
        "bytes not a whole number of ids": (["data=tokens", f"data.path={tmp}/odd.bin"],
                                            "not a whole number of uint16 ids"),
        "one document only": (["data=text", f"data.path={corpus}/text/doc0000.txt"],
                              "set data.eval_path"),
    }


@pytest.mark.parametrize("override,match", [
    ("data.packing=greedy", "data.packing='greedy' is not one of concat, first_fit"),
    ("data.dtype=int8", "data.dtype='int8' is not one of uint16, uint32"),
    ("data.validation_fraction=0", r"data.validation_fraction=0.0 is out of range: it must be in \(0, 1\)"),
    ("data.prompt_field=q", "data.prompt_field and data.response_field go together"),
    ("data.name=csv", "data.name='csv' is not one of builtin, text, jsonl, parquet, tokens"),
    ("data.tokenizer=tiktoken:x", "data.tokenizer='tiktoken:x' is not byte, sentencepiece:"),
    ("data.tokenizer=none", "data.tokenizer=none suits only data=tokens"),
    ("data.prompt_field=q data.response_field=a", "need records: data=jsonl or data=parquet"),
])
def test_data_keys_are_checked_before_anything_is_read(override, match):
    with pytest.raises(ConfigError, match=match):
        cfg = _cfg(*override.split())
        validation.validate(cfg)
        _build(cfg)


def test_bad_input_is_one_sentence_naming_the_key(corpus, tmp_path):
    for case, (overrides, message) in _bad_inputs(corpus, tmp_path).items():
        with pytest.raises(ConfigError) as error:
            _build(_cfg(*overrides))
        text = str(error.value)
        assert message in text, (case, text)
        assert "\n" not in text and text.endswith("."), case
        assert "data." in text or "model." in text, case


def test_a_broken_json_line_among_the_first_is_refused_before_anything_runs(corpus, tmp_path):
    """run_training.py parses JSON lines files right after validating the config (before
    devices, data loading or compiling): a broken line is named with its line number, deep in
    a small file too; in a large one (past CHECK_ALL_BYTES) only the first lines are read."""
    good = (corpus / "docs.jsonl").read_text().splitlines()[:2]
    (tmp_path / "broken.jsonl").write_text("\n".join([*good, '{"text": "unfinished']) + "\n")
    with pytest.raises(ConfigError, match=rf"data.path: line 3 of {tmp_path}/broken.jsonl is not "
                                          r"JSON \(.*\); each line must be one JSON object"):
        sources.check_records(_cfg("data=jsonl", f"data.path={tmp_path}/broken.jsonl").data)
    sources.check_records(_cfg("data=jsonl", f"data.path={corpus}/docs.jsonl").data)
    deep = _records_broken_at(tmp_path / "deep.jsonl", 80, 40)
    config = _cfg("data=jsonl", f"data.path={deep}").data
    with pytest.raises(ConfigError, match=rf"line 40 of {deep} is not JSON"):
        sources.check_records(config)
    with monkeypatch_value(sources, "CHECK_ALL_BYTES", 0):
        sources.check_records(config)  # line 40 is past the first lines


@contextlib.contextmanager
def monkeypatch_value(module, name: str, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


def _records_broken_at(path, count: int, broken: int):
    lines = [json.dumps({"text": f"record {i} of a few words"}) for i in range(count)]
    lines[broken - 1] = '{"text": unfinished'
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_a_broken_line_met_mid_run_stops_it_naming_the_line_and_the_step_to_go_on_from(tmp_path):
    """A large file's broken line further in is met when it is read: the run stops with the
    same sentence, saying before which step it stopped and which checkpoint it keeps; with the
    line fixed, the same command goes on from that checkpoint to the end. (tests/faults.py
    checks the small file as a large one.)"""
    import grain

    # A line past the first 32 that the run reads mid-way: about the 40th document of the
    # first epoch's order (training.seed=0 shuffles the documents: data/pipeline.py).
    order = list(grain.MapDataset.range(80).shuffle(seed=0))
    line = next(i for i in order[40:] if i >= 32) + 1
    data = _records_broken_at(tmp_path / "data.jsonl", 80, line)
    (tmp_path / "eval.jsonl").write_text(data.read_text().splitlines()[0] + "\n")
    run_dir = tmp_path / "run"
    command = [*TINY, "model.num_layers=2", "data=jsonl", f"data.path={data}",
               f"data.eval_path={tmp_path}/eval.jsonl", "data.seq_len=32",
               "training.global_batch_size=8", "training.steps=16", "checkpoint.every_steps=2",
               f"hydra.run.dir={run_dir}"]
    stopped = run_cli(command, cwd=tmp_path, script="tests/faulty_training.py",
                      env_extra={"TUNIX_TRAIN_TEST_FAULTS": '{"check_all_bytes": 0}'})
    assert stopped.returncode == 2, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    said = re.search(rf"error: data.path: line {line} of {data} is not JSON \(.*\); each line must be "
                     rf"one JSON object: fix or remove that line. The run stopped before step "
                     rf"(\d+); its checkpoint of step (\d+) is kept: fix it and run the same "
                     rf"command again to go on from there.\n", stopped.stderr)
    assert said, stopped.stderr[-3000:]
    before, kept = int(said[1]), int(said[2])
    saved = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert 0 < kept == saved < before < 16
    data.write_text(data.read_text().replace('{"text": unfinished', '{"text": "fixed"}'))
    again = run_cli(command, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from step {kept} (" in again.stdout
    assert "finished step 16 of 16" in again.stdout


# ---------------------------------------------------------------------------------------------
# As users run it.

@pytest.mark.slow
def test_a_run_on_local_files_evaluates_every_n_steps(corpus, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli([*TINY, "model.num_layers=2", "data=jsonl",  # 2 layers: a shorter compile
                      f"data.path={corpus}/docs.jsonl",
                      f"data.tokenizer=sentencepiece:{corpus}/spm.model", "training.steps=4",
                      "training.eval_every_steps=2", "logging.every_steps=2",
                      f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [step for step, _ in evals] == [0, 2, 4]
    assert evals[-1][1] < evals[0][1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [0, 2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["glob matches nothing", "vocab larger than the model's"])
def test_bad_input_on_the_command_line_exits_with_one_sentence(corpus, tmp_path, case):
    overrides, message = _bad_inputs(corpus, tmp_path)[case]
    result = run_cli([*TINY, *overrides, f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and message in output and "Traceback" not in output, output


def test_data_guide_commands_read_the_demo_files(corpus, tmp_path, monkeypatch):
    """docs/data.md's commands, run from a directory holding `demo_data/` as the guide says,
    up to their first batch (the training itself is the same for every source)."""
    from test_docs import shown_commands, split_command

    (tmp_path / "demo_data").symlink_to(corpus)
    monkeypatch.chdir(tmp_path)
    commands = shown_commands(REPO / "docs" / "data.md")
    assert len(commands) >= 12
    for command in commands:
        _, overrides = split_command(command)
        cfg = compose_config(*TINY, *overrides, mesh_arg(1, 1), "training.micro_batch_size=2")
        data = _build(cfg)
        batch = _host(next(data.train))
        data.close()
        assert batch["weights"].sum() > 0, command
