"""docs/data.md's, docs/monitoring.md's and docs/dpo.md's commands as typed, from a fresh copy of
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
