"""`python -m tunix_train.export` and `python -m tunix_train.generate` from a run directory,
as a user runs them (subprocesses), against the checkpoint's own parameters."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from compile_flags import with_fast_compile
from helpers import REPO, TINY, compose_config, mesh_arg, run_cli
from test_docs import DOCS, shown_commands, split_command
from test_generate import full_recompute_greedy, varied
from tunix_train import cli
from tunix_train.data import demo
from tunix_train.data.tokenizer import SentencePieceTokenizer
from tunix_train.export import export
from tunix_train.generate import generate
from tunix_train.training.setup import Setup

pytestmark = pytest.mark.slow
EIGHT_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory holding a checkpoint in the shared layout (state, data, config items)."""
    return save_run(tmp_path_factory.mktemp("run"), compose_config(*TINY, mesh_arg(8, 1)))


def save_run(run, cfg):
    setup = Setup.create(cfg)
    state = setup.fresh_state()
    state["params"] = jax.device_put(varied(state["params"]), setup.params.shardings)
    manager = ocp.CheckpointManager(run / "checkpoints", item_names=("state", "data", "config"))
    manager.save(5, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"next_step": 5}),
        config=ocp.args.JsonSave(dataclasses.asdict(cfg))))
    manager.wait_until_finished()
    manager.close()
    return run, setup.params.graphdef, jax.device_get(state["params"])


def tool(name, args, cwd, check=True):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(EIGHT_DEVICES)
    with_fast_compile(env)
    result = subprocess.run([sys.executable, "-m", f"tunix_train.{name}", *args], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported")
    tool("export", [f"checkpoint.resume_from={run_dir[0]}", f"export.path={out}",
                    "export.dtype=float32"], out)
    return out


def test_generate_prints_the_greedy_continuation_as_json(run_dir, tmp_path):
    run, graphdef, params = run_dir
    prompt = [1, 40, 41, 42, 43, 44]
    result = tool("generate", [f"checkpoint.resume_from={run}", mesh_arg(2, 4),
                               f"generate.prompt_ids={prompt}", "generate.max_new_tokens=12",
                               "generate.eos_id=-1"], tmp_path)
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last["ids"] == full_recompute_greedy(graphdef, params, prompt, 12)
    assert isinstance(last["text"], str)


def test_a_run_trained_with_sentencepiece_generates_and_exports_with_it(tmp_path, monkeypatch):
    """Without `data.tokenizer` on the command line, both tools take the run's own tokenizer:
    the prompt is encoded with it (BOS first), the completion decoded with it, and the export
    carries the file and its special ids."""
    spm = demo.train_sentencepiece(tmp_path, demo.documents(100_000))
    run, graphdef, params = save_run(tmp_path / "run", compose_config(
        *TINY, mesh_arg(8, 1), f"data.tokenizer=sentencepiece:{spm}"))
    tokenizer = SentencePieceTokenizer(spm)
    prompt = "def main():\n    return"
    argv = [f"checkpoint.resume_from={run}", mesh_arg(2, 4), f"generate.prompt='{prompt}'",
            "generate.max_new_tokens=10", "generate.eos_id=-1"]
    result = generate(cli.compose(argv), cli.explicit_model_keys(argv))
    ids = [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]
    assert result["ids"] == full_recompute_greedy(graphdef, params, ids, 10)
    pieces = [i for i in result["ids"] if i < tokenizer.vocab_size]
    assert result["text"] == tokenizer.decode(pieces)

    # An id of the model's padded vocabulary rows (500-511 here) has no text and does not fail
    # (the tokenizer has 500 pieces, the model 512 rows).
    from tunix_train.inference.sampler import Sampler

    monkeypatch.setattr(Sampler, "__call__", lambda *a, **k: [[510, 100, 505]])
    assert generate(cli.compose(argv))["text"] == tokenizer.decode([100])

    export(cli.compose([f"checkpoint.resume_from={run}", f"export.path={tmp_path / 'out'}"]))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (2, 1, 0)  # not the byte ids
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == spm.read_bytes()


def test_an_imported_checkpoint_brings_its_own_tokenizer(tmp_path):
    from tunix_train.inference import weights

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    cfg = compose_config(f"model.init_from=hf:{tmp_path}")  # (dimensions are not read here)
    assert weights.tokenizer_source(cfg, chosen=False) == f"hf:{tmp_path / 'tokenizer.json'}"
    assert weights.tokenizer_source(cfg, chosen=True) == "byte"  # the command line wins


def test_export_from_a_run_loads_in_transformers(run_dir, exported):
    pytest.importorskip("torch", reason="needs the `hf` extra (torch, transformers)")
    from transformers import Gemma3ForCausalLM

    import hf_reference

    _, graphdef, params = run_dir
    model = Gemma3ForCausalLM.from_pretrained(exported, attn_implementation="eager").eval()
    tokens = np.random.default_rng(0).integers(3, 259, (2, 40))
    ours = nnx.merge(graphdef, params)(jnp.asarray(tokens))
    np.testing.assert_allclose(hf_reference.logits(model, tokens), ours, atol=1e-4)
    config = json.loads((exported / "config.json").read_text())
    assert config["eos_token_id"] == 2  # the byte tokenizer's, which the run trained with


def test_training_from_an_imported_checkpoint_logs_mfu(run_dir, exported, tmp_path):
    from tunix_train.analysis import flops

    result = run_cli([f"model.init_from=hf:{exported}", "training.steps=2", "data.seq_len=32",
                      "data.max_corpus_bytes=400000", "logging.every_steps=1",
                      "logging.peak_tflops=0.001", "training.mixed_precision=fp32",
                      f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "loading Hugging Face weights" in log  # (test_hf checks the values themselves)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train = [r for r in records if "loss" in r]
    cfg = compose_config(*TINY)
    per_token = flops.training_flops_per_token(cfg.model, 32)
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * per_token / 1e9, rel=1e-6)


def test_bad_input_is_one_sentence_and_exit_2(exported, tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    cases = [
        (["-m", "tunix_train.export", f"model.init_from=hf:{exported}",
          "export.path=notes.txt/out"],  # resolved against the starting directory
         f"export.path={tmp_path}/notes.txt/out cannot be created (Not a directory at "
         f"{tmp_path}/notes.txt/out); give a folder you can write to."),
        (["-m", "tunix_train.export", f"checkpoint.resume_from={tmp_path}",
          f"export.path={tmp_path / 'out'}"], "holds no committed checkpoint"),
        *[(["-m", "tunix_train.export", f"model.init_from=hf:{exported}",
            f"export.path={tmp_path / 'refused'}", f"export.{key}={value}"],
           f"export.{key}='{value}' is not one of")  # were a traceback, and a merged export
          for key, value in (("dtype", "float8"), ("lora", "adapters"))],
        (["-m", "tunix_train.generate", f"model.init_from=hf:{exported}"],
         "set exactly one of generate.prompt"),
        (["-m", "tunix_train.generate", f"model.init_from=hf:{exported}", "generate.prompt=hi",
          "generate.max_new_tokens=0"], "generate.max_new_tokens=0 is out of range: it must be "
                                        "at least 1."),
        (["-m", "tunix_train.generate", f"model.init_from=hf:{exported}", "generate.prompt=hi",
          "model.attention_impl=bogus"], "model.attention_impl='bogus' is not one of"),  # was
        # ignored: every key is checked, not the tool's own alone
        ([str(REPO / "run_training.py"), f"model.init_from=hf:{exported}", "model.num_layers=3",
          f"hydra.run.dir={tmp_path}/run"], "model.num_layers=3 contradicts"),
    ]
    for args, message in cases:
        result = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True,
                                text=True, timeout=300)
        output = result.stdout + result.stderr
        assert result.returncode == 2 and message in output, output[-2000:]
        assert "Traceback" not in output
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one sentence only
    assert not (tmp_path / "refused").exists()


TOOLS = ("tunix_train.generate", "tunix_train.export")
SHOWN = [(page.name, line, name) for page in DOCS for name in TOOLS
         for line in shown_commands(page, f"-m {name}")]


@pytest.mark.parametrize("page,line,name", SHOWN, ids=[f"{p}:{i}" for i, (p, _, _) in
                                                        enumerate(SHOWN)])
def test_every_shown_tool_command_composes(page, line, name):
    _, overrides = split_command(line, name)
    compose_config(*overrides)


def test_docs_show_both_tools():
    assert {name for _, _, name in SHOWN} == set(TOOLS)
