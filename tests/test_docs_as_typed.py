"""README.md's and docs/'s commands, run verbatim from a fresh copy of the repository
(tests/typed_docs.py): relative paths, no substituted argument; CPU-scale overrides appended.

The pages are read in the order a user reads them: the checkpointing page's run is what the
models page exports and generates from, as the pages say.

The docs' commands are split over three files so that none keeps one of the suite's two
workers busy for long: README and the checkpointing, models and LoRA pages (test_docs_as_typed.py),
the parallelism and multi-node guides (test_docs_as_typed_guides.py), the data, monitoring and
DPO pages (test_docs_as_typed_pages.py). Each file makes its own working copy (`typed`).
"""

import json
import re
import shutil

import pytest

from typed_docs import (CPU_SCALE, REPO, SMALL_BATCH, Typed, cpu_scale, devices, last_printed, ok,
                        page_commands, python_blocks, typed)  # noqa: F401 (typed: a fixture)

pytestmark = pytest.mark.slow
RUN = "outputs/default/2026-11-22/10-00-00"  # the run dir docs/checkpointing.md and models.md use


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
        assert "(Llama 3: 4 layers" in output


# ------------------------------------------- docs/checkpointing.md, then docs/models.md on its run

@pytest.fixture(scope="module")
def trained(typed) -> Typed:
    """The checkpointing page's "preempted or crashed" command: the run the pages use."""
    [same_dir, _, _] = page_commands("docs/checkpointing.md", "checkpoint.")[-3:]
    assert f"hydra.run.dir={RUN}" in same_dir
    ok(typed.run(same_dir, *CPU_SCALE, *SMALL_BATCH, many_steps=True))
    return typed


def test_checkpointing_page_as_typed(trained):
    every, same_dir, resume, init = page_commands("docs/checkpointing.md", "run_training.py")
    run = trained.root / RUN
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [200, 400, 600]
    # Started again, the finished run says so and does nothing.
    again = ok(trained.run(same_dir, *CPU_SCALE, *SMALL_BATCH))
    assert "is already complete: its checkpoint of step 600" in again
    # From step 400 of that run, in a run dir of its own.
    output = ok(trained.run(resume, *CPU_SCALE, *SMALL_BATCH, many_steps=True))
    assert "resuming from step 400" in output and "finished step 600 of 600" in output
    # Parameters only.
    output = ok(trained.run(init, *CPU_SCALE, *SMALL_BATCH, many_steps=True))
    assert f"parameters from {run}" in output and "finished step 200 of 200" in output
    # Every checkpoint setting of the first command, at its own step counts.
    output = ok(trained.run(every, *CPU_SCALE, *SMALL_BATCH, "hydra.run.dir=outputs/every",
                             many_steps=True))
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
    assert config["num_hidden_layers"] == 4 and config["hidden_size"] == 64
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
    [lora] = page_commands("docs/lora.md", "run_training.py model.init_from=hf:")
    output = ok(trained.run(lora, "training.steps=2", "data.seq_len=32", *SMALL_BATCH))
    assert "finished step 2 of 2; run dir: outputs/llama-lora" in output
    assert "LoRA: rank 16, alpha 16 on q, k, v, o, gate, up, down" in output
    adapter, merged, generate, plan = page_commands("docs/lora.md", "outputs/llama-lora")[1:] + \
        page_commands("docs/lora.md", "model=llama3_1_8b")
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
    # The model's parameters, not the adapters', and the LoRA line training prints.
    assert "plan: llama3_1_8b (8,030,261,248 parameters)" in output
    assert "LoRA: rank 16, alpha 16 on q, k, v, o, gate, up, down: 41,943,040 trainable" in output


def test_lora_pages_laptop_example_as_typed(typed):
    """docs/lora.md's laptop example, each command as typed (fewer steps, shorter sequences;
    the model as shown): the LoRA and plan lines the page shows are the ones printed."""
    base, lora, export = page_commands("docs/lora.md", "tiny")
    [plan] = page_commands("docs/lora.md", "tunix_train.plan 'model.mesh_shape=[[1,1]")
    shown = re.findall(r"^(?:LoRA|plan): .*$", (REPO / "docs/lora.md").read_text(), re.M)
    lora_lines = {line.split("frozen base ")[1].split()[0]: line for line in shown
                  if line.startswith("LoRA: rank 8")}
    short = ["training.steps=2", "data.seq_len=32", "data.max_corpus_bytes=400000"]
    ok(typed.run(base, *short))
    assert lora_lines["float32"] in ok(typed.run(lora, *short))
    ok(typed.run(export))
    config = json.loads((typed.root / "exported/tiny-lora-merged/config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    output = ok(typed.run(plan))
    [plan_line] = [line for line in shown if line.startswith("plan: gemma3_tiny")]
    assert plan_line.split(" (compiled in")[0] in output and lora_lines["bfloat16"] in output
