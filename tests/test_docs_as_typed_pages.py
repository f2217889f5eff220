"""docs/data.md's, docs/monitoring.md's, docs/dpo.md's and docs/models.md's commands, and the
planner's host-offload plan of docs/memory_and_communication.md, as typed, from a fresh copy of
the repository (tests/typed_docs.py; test_docs_as_typed.py says how the pages are split)."""

import json

import pytest

from typed_docs import (CPU_SCALE, SMALL_BATCH, TINY_MODEL, ok, page_commands, python_blocks,
                        typed)  # noqa: F401 (typed: a fixture)

pytestmark = pytest.mark.slow


def test_dpo_page_as_typed(typed):
    """docs/dpo.md's laptop example as typed, with a smaller model appended (the page's data,
    steps and batch): held-out preference accuracy ends far above chance and the margin grows,
    while a control with optimizer.lr=0 stays at the reference (margin 0, no pair preferred)."""
    [demo, train] = page_commands("docs/dpo.md", "python")[:2]
    ok(typed.run(demo))
    output = ok(typed.run(train, *TINY_MODEL, many_steps=True))
    assert "validation loss before training 0.6931" in output
    control = "outputs/dpo-laptop-lr0"  # the same programs as the run (many_steps), cached
    ok(typed.run(train, *TINY_MODEL, "optimizer.lr=0", "training.steps=2",
                 f"hydra.run.dir={control}", many_steps=True))

    def held_out(run_dir: str, key: str) -> dict[int, float]:
        lines = (typed.root / run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r[key] for r in map(json.loads, lines) if key in r}

    accuracy, margin = held_out("outputs/dpo-laptop", "eval_accuracy"), held_out(
        "outputs/dpo-laptop", "eval_margin")
    assert sorted(accuracy) == [0, 20, 40, 60]
    assert accuracy[60] > 0.75 and margin[60] > margin[20] > margin[0] == 0, (accuracy, margin)
    assert set(held_out(control, "eval_accuracy").values()) == {0.0}
    assert set(held_out(control, "eval_margin").values()) == {0.0}


DATA = page_commands("docs/data.md", "run_training.py")


@pytest.mark.parametrize("command", DATA, ids=[f"data{i}" for i in range(len(DATA))])
def test_data_page_commands_as_typed(typed, command):
    index = DATA.index(command)
    output = ok(typed.run(command, *CPU_SCALE, *SMALL_BATCH, "training.steps=2",
                          "training.eval_every_steps=0", f"hydra.run.dir=outputs/data{index}"))
    assert "finished step 2 of 2" in output


def test_monitoring_page_run_and_script_as_typed(typed):
    """The page's run (its steps, shortened by CPU scale only), then its Python snippet."""
    [command] = page_commands("docs/monitoring.md", "hydra.run.dir=outputs/watch")
    output = ok(typed.run(command, *CPU_SCALE, *SMALL_BATCH))
    assert "no collectives" in output
    [script] = python_blocks("docs/monitoring.md")
    printed = ok(typed.run_python(script)).splitlines()
    assert printed[0].startswith("loss ") and " -> " in printed[0]
    assert [step for step, _ in eval(printed[1])] == [5 * i for i in range(1, 9)]


def test_models_page_mixture_of_experts_as_typed(typed):
    """docs/models.md's Qwen 3 MoE run (shorter rows appended): the held-out loss falls at every
    evaluation, with the router's metrics logged; then its planner commands as typed (Qwen 3
    30B-A3B on fsdp 8, 235B-A22B on fsdp 8 × ep 8), each printing the per-device memory the
    page's table shows."""
    [train] = page_commands("docs/models.md", "model=qwen3_moe_tiny")
    output = ok(typed.run(train, "data.seq_len=64", "data.max_corpus_bytes=400000"))
    assert "aux " in output and "load " in output
    lines = (typed.root / "outputs/moe-laptop/metrics.jsonl").read_text().splitlines()
    held_out = {r["step"]: r["eval_loss"] for r in map(json.loads, lines) if "eval_loss" in r}
    steps = sorted(held_out)
    assert steps == [0, 20, 40, 60]
    assert all(held_out[a] > held_out[b] for a, b in zip(steps, steps[1:])), held_out
    page = (typed.root / "docs/models.md").read_text()
    rows = {"qwen3_30b_a3b": "`qwen3_30b_a3b`, fsdp 8 | `offload_optimizer=true` |",
            "qwen3_235b_a22b": "`qwen3_235b_a22b`, fsdp 8 × ep 8 | `remat=full`, "
                               "`moe_ep_buffer_factor=2` |"}
    for model, row_starts in rows.items():
        [plan] = page_commands("docs/models.md", f"tunix_train.plan model={model}")
        printed = ok(typed.run(plan))
        [row] = [line for line in page.splitlines() if row_starts in line]
        device, host = row.split("|")[3].replace("GB host", "").split(" GB + ")
        assert f"= {device.strip()} GB on the device, {host.strip()} GB in host memory" in printed
        assert "verdict: fits" in printed


def test_memory_page_parameters_in_host_memory_plan_as_typed(typed):
    """docs/memory_and_communication.md's Llama 3.1 8B full fine-tuning on one 80 GB device
    with parameters and optimizer in host memory, as typed: it prints the lines the page shows
    (XLA's memory analysis of the compiled step) and fits."""
    page = "docs/memory_and_communication.md"
    [plan] = page_commands(page, "training.offload_params=true")
    printed = ok(typed.run(plan))
    shown = (typed.root / page).read_text().split(plan, 1)[1].split("```")[2]
    assert shown.strip()
    for line in shown.strip().splitlines():
        assert line in printed, line
    assert "verdict: fits" in printed
