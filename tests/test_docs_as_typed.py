"""README.md's and docs/'s commands, run verbatim from a fresh copy of the repository
(tests/typed_docs.py): relative paths, no substituted argument; CPU-scale overrides appended.

The pages are read in the order a user reads them: the checkpointing page's run is what the
models page exports and generates from, as the pages say.
"""

import json
import re
import shutil

import pytest

from typed_docs import (CPU_SCALE, TINY_MODEL, Typed, cpu_scale, devices, last_printed, ok,
                        page_commands, python_blocks)

pytestmark = pytest.mark.slow
RUN = "outputs/default/2026-11-22/10-00-00"  # the run dir docs/checkpointing.md and models.md use
SMALL_BATCH = ["training.micro_batch_size=2"]


@pytest.fixture(scope="module")
def typed(tmp_path_factory) -> Typed:
    typed = Typed(tmp_path_factory.mktemp("typed") / "tunix_train")
    # docs/data.md's first command: every page's demo files (and a user's "own" corpus below).
    ok(typed.run(page_commands("docs/data.md", "tunix_train.data.demo")[0]))
    return typed


# ------------------------------------------------------------------ README: More than the default

README = page_commands("README.md", "python ")[2:]  # after the install-and-run lines
README_DEVICES = [4, 1, 4, 16, None]  # each command's mesh, simulated as README says


def test_readme_shows_the_commands_run_here():
    assert len(README) == len(README_DEVICES) == 5
    assert "model=gemma3_1b 'model.mesh_shape=[[4,1]" in README[0]
    assert README[4].startswith("python -m tunix_train.plan model=gemma3_4b")


@pytest.mark.parametrize("index", range(5), ids=["fsdp4", "jsonl_spm", "llama_fsdp2_tp2_accum",
                                                 "pp2_fsdp8", "plan_4b"])
def test_readme_more_than_the_default_as_typed(typed, index):
    command, count = README[index], README_DEVICES[index]
    if "corpus/*.jsonl" in command:  # "Your own text": a user's corpus and tokenizer
        (typed.root / "corpus").mkdir(exist_ok=True)
        shutil.copy(typed.root / "demo_data" / "docs.jsonl", typed.root / "corpus" / "docs.jsonl")
        shutil.copy(typed.root / "demo_data" / "spm.model", typed.root / "tokenizer.model")
    scale = [*cpu_scale(command), *SMALL_BATCH]
    if "plan" not in command:
        scale += ["training.steps=2", f"hydra.run.dir=outputs/readme{index}"]
    output = ok(typed.run(command, *scale, env=devices(count) if count else None))
    if "plan" in command:
        assert "fsdp=8 × tp=2" in output and "verdict: fits" in output
    else:
        assert "finished step 2 of 2" in output
    if "llama3" in command:
        assert "(Llama 3: 7 layers" in output


# ------------------------------------------- docs/checkpointing.md, then docs/models.md on its run

@pytest.fixture(scope="module")
def trained(typed) -> Typed:
    """The checkpointing page's "preempted or crashed" command: the run the pages use."""
    [same_dir, _, _] = page_commands("docs/checkpointing.md", "checkpoint.")[-3:]
    assert f"hydra.run.dir={RUN}" in same_dir
    ok(typed.run(same_dir, *CPU_SCALE, *SMALL_BATCH))
    return typed


def test_checkpointing_page_as_typed(trained):
    every, same_dir, resume, init = page_commands("docs/checkpointing.md", "run_training.py")
    run = trained.root / RUN
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [200, 400, 600]
    # Started again, the finished run says so and does nothing.
    again = ok(trained.run(same_dir, *CPU_SCALE, *SMALL_BATCH))
    assert "is already complete: its checkpoint of step 600" in again
    # From step 400 of that run, in a run dir of its own.
    output = ok(trained.run(resume, *CPU_SCALE, *SMALL_BATCH))
    assert "resuming from step 400" in output and "finished step 600 of 600" in output
    # Parameters only.
    output = ok(trained.run(init, *CPU_SCALE, *SMALL_BATCH))
    assert f"parameters from {run}" in output and "finished step 200 of 200" in output
    # Every checkpoint setting of the first command, at its own step counts.
    output = ok(trained.run(every, *CPU_SCALE, *SMALL_BATCH, "hydra.run.dir=outputs/every"))
    assert sorted(p.name for p in (trained.root / "outputs/every/checkpoints").iterdir()) == [
        "200", "400", "600"]


def test_checkpointing_pages_plain_orbax_snippet_as_typed(trained):
    [snippet] = [b for b in python_blocks("docs/checkpointing.md") if "metadata" in b]
    result = trained.run_python(snippet + "\nprint(state['params']['embedder']['embedding']"
                                          ".shape)\n")
    assert last_printed(result) == "(512, 64)"  # [vocab, embed] of the run


def test_models_page_export_and_generate_from_the_run_as_typed(trained):
    export = page_commands("docs/models.md", "tunix_train.export")[0]
    ok(trained.run(export))
    config = json.loads((trained.root / "exported" / "config.json").read_text())
    assert config["num_hidden_layers"] == 7 and config["hidden_size"] == 64
    assert list((trained.root / "exported").glob("*.safetensors"))
    generate = page_commands("docs/models.md", f"checkpoint.resume_from={RUN}")[-1]
    assert "tunix_train.generate" in generate
    result = json.loads(last_printed(trained.run(generate)))
    assert len(result["ids"]) == 64 and isinstance(result["text"], str)


def hugging_face_folders(typed: Typed) -> None:
    """checkpoints/gemma-3-1b-pt and checkpoints/Llama-3.2-1B as the models page has them (tiny
    random models with the demo's BPE tokenizer, their vocabulary large enough for the page's
    token ids), and the user's corpus.jsonl; made once."""
    import hf_reference

    for name, family in (("gemma-3-1b-pt", "gemma3"), ("Llama-3.2-1B", "llama3")):
        folder = typed.root / "checkpoints" / name
        if not (folder / "config.json").is_file():
            hf_reference.build(folder, family=family, vocab_size=8192)
            shutil.copy(typed.root / "demo_data" / "bpe" / "tokenizer.json", folder)
    shutil.copy(typed.root / "demo_data" / "docs.jsonl", typed.root / "corpus.jsonl")


def test_models_page_hugging_face_commands_as_typed(trained):
    """Hugging Face folders where the page puts them (a tiny random Gemma 3 and Llama 3 with
    the demo's BPE tokenizer, their vocabulary large enough for the page's token ids), and the
    user's corpus the Llama command names."""
    hugging_face_folders(trained)
    gemma, llama, *generates = page_commands("docs/models.md", "hf:checkpoints/")
    for index, (command, model, mesh) in enumerate((
            (gemma, "gemma-3-1b-pt (Gemma 3: 7 layers", "fsdp=4 × tp=1"),
            (llama, "Llama-3.2-1B (Llama 3: 3 layers", "fsdp=2 × tp=2"))):
        output = ok(trained.run(command, "training.steps=2", "data.seq_len=32", *SMALL_BATCH,
                                f"hydra.run.dir=outputs/imported{index}", env=devices(4)))
        assert "finished step 2 of 2" in output and model in output and mesh in output
    for command in generates:
        result = json.loads(last_printed(trained.run(command, "generate.max_new_tokens=4")))
        assert len(result["ids"]) == 4


def test_lora_page_as_typed(trained):
    """docs/lora.md: LoRA on the models page's Llama folder, both exports, generation, the PEFT
    snippet on the exported adapter, and the planner's command."""
    hugging_face_folders(trained)
    [lora] = page_commands("docs/lora.md", "run_training.py")
    output = ok(trained.run(lora, "training.steps=2", "data.seq_len=32", *SMALL_BATCH))
    assert "finished step 2 of 2; run dir: outputs/llama-lora" in output
    assert "LoRA: rank 16, alpha 16 on q, k, v, o, gate, up, down" in output
    adapter, merged, generate, plan = page_commands("docs/lora.md", "python -m tunix_train.")
    ok(trained.run(adapter))
    ok(trained.run(merged))
    assert (trained.root / "exported/llama-lora-adapter/adapter_model.safetensors").is_file()
    assert json.loads((trained.root / "exported/llama-lora-merged/config.json").read_text())[
        "architectures"] == ["LlamaForCausalLM"]
    assert len(json.loads(last_printed(trained.run(generate, "generate.max_new_tokens=4")))[
        "ids"]) == 4
    [snippet] = python_blocks("docs/lora.md")
    result = trained.run_python(snippet + "\nprint(type(model).__name__)\n")
    assert last_printed(result) == "PeftModelForCausalLM"
    output = ok(trained.run(plan))
    assert "verdict: fits" in output and re.search(r"frozen base 16\.\d\d GB", output)


def test_dpo_page_as_typed(typed):
    """docs/dpo.md's laptop example as typed, with a smaller model appended (the page's data,
    steps and batch): held-out preference accuracy ends far above chance and the margin grows,
    while a control with optimizer.lr=0 stays at the reference (margin 0, no pair preferred)."""
    [demo, train] = page_commands("docs/dpo.md", "python")[:2]
    ok(typed.run(demo))
    output = ok(typed.run(train, *TINY_MODEL))
    assert "validation loss before training 0.6931" in output
    control = "outputs/dpo-laptop-lr0"
    ok(typed.run(train, *TINY_MODEL, "optimizer.lr=0", "training.steps=2",
                 f"hydra.run.dir={control}"))

    def held_out(run_dir: str, key: str) -> dict[int, float]:
        lines = (typed.root / run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}

    accuracy, margin = held_out("outputs/dpo-laptop", "eval_accuracy"), held_out(
        "outputs/dpo-laptop", "eval_margin")
    assert sorted(accuracy) == [0, 20, 40, 60]
    assert accuracy[60] > 0.75 and margin[60] > margin[20] > margin[0] == 0, (accuracy, margin)
    assert set(held_out(control, "eval_accuracy").values()) == {0.0}
    assert set(held_out(control, "eval_margin").values()) == {0.0}


# ------------------------------------------------------------------- the other runnable pages

DISTRIBUTED = page_commands("docs/distributed_training.md", "run_training.py")


@pytest.mark.parametrize("command", DISTRIBUTED, ids=[f"mesh{i}" for i in range(len(DISTRIBUTED))])
def test_parallelism_guide_commands_as_typed(typed, command):
    """Each as shown, with the environment it shows, a tiny model and 2 steps appended."""
    env = dict(word.split("=", 1) for word in command.split() if word.startswith("XLA_FLAGS="))
    index = DISTRIBUTED.index(command)
    output = ok(typed.run(command, *cpu_scale(command), "training.steps=2",
                          f"hydra.run.dir=outputs/mesh{index}", env=env))
    assert "finished step 2 of 2" in output


def test_multi_node_pages_local_launch_as_typed(typed):
    [local] = page_commands("docs/multi_node.md", "device_count=2 python -m tunix_train.launch")
    output = ok(typed.run(local, *CPU_SCALE, "training.steps=2", "hydra.run.dir=outputs/launched"))
    assert "[rank 1]" in output and "finished step 2 of 2" in output


DATA = page_commands("docs/data.md", "run_training.py")


@pytest.mark.parametrize("command", DATA, ids=[f"data{i}" for i in range(len(DATA))])
def test_data_page_commands_as_typed(typed, command):
    index = DATA.index(command)
    output = ok(typed.run(command, *CPU_SCALE, *SMALL_BATCH, "training.steps=2",
                          "training.eval_every_steps=0", f"hydra.run.dir=outputs/data{index}"))
    assert "finished step 2 of 2" in output


def test_monitoring_page_run_and_script_as_typed(typed):
    """The page's run (its steps, shortened by CPU scale only), then its Python snippet."""
    [command] = page_commands("docs/monitoring.md", "run_training.py")
    output = ok(typed.run(command, *CPU_SCALE, *SMALL_BATCH))
    assert "no collectives" in output
    [script] = python_blocks("docs/monitoring.md")
    printed = ok(typed.run_python(script)).splitlines()
    assert printed[0].startswith("loss ") and " -> " in printed[0]
    assert [step for step, _ in eval(printed[1])] == [5 * i for i in range(1, 9)]



def test_multi_node_pages_processes_started_by_hand_as_typed(typed):
    """The page's two commands, the second started 3 s after the first: one run dir."""
    import time

    first, second = page_commands("docs/multi_node.md", "python run_training.py 'model.mesh")
    append = [*CPU_SCALE, "training.steps=2", "experiment.name=by-hand"]
    processes = [typed.start(first, *append)]
    time.sleep(3)
    processes.append(typed.start(second, *append))
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    [run_dir] = (typed.root / "outputs" / "by-hand").glob("*/*")
    assert "finished step 2 of 2; run dir: outputs/by-hand/" in outputs[0]
    assert (run_dir / "checkpoints" / "2").is_dir()
