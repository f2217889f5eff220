"""docs/distributed_training.md's and docs/multi_node.md's commands as typed, from a fresh copy
of the repository (tests/typed_docs.py; test_docs_as_typed.py says how the pages are split)."""

import numpy as np
import pytest

from typed_docs import CPU_SCALE, cpu_scale, ok, page_commands, typed  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow

DISTRIBUTED = page_commands("docs/distributed_training.md", "run_training.py")


@pytest.mark.parametrize("command", DISTRIBUTED, ids=[f"mesh{i}" for i in range(len(DISTRIBUTED))])
def test_parallelism_guide_commands_as_typed(typed, command):
    """Each as shown, with the environment it shows, a tiny model and 2 steps appended."""
    env = dict(word.split("=", 1) for word in command.split() if word.startswith("XLA_FLAGS="))
    index = DISTRIBUTED.index(command)
    output = ok(typed.run(command, *cpu_scale(command), "training.steps=2",
                          f"hydra.run.dir=outputs/mesh{index}", env=env))
    assert "finished step 2 of 2" in output
    if '"ep"' in command:  # a mixture's experts over ep: the start-up line says what each holds
        assert "experts: 4 of 8 per routed layer on each device (ep=2)" in output


def test_multi_node_pages_local_launch_as_typed(typed):
    [local] = page_commands("docs/multi_node.md", "device_count=2 python -m tunix_train.launch")
    output = ok(typed.run(local, *CPU_SCALE, "training.steps=2", "hydra.run.dir=outputs/launched"))
    assert "[rank 1]" in output and "finished step 2 of 2" in output


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


def test_multi_node_pages_torchrun_as_typed(typed):
    """The page's CPU torchrun command (4 processes × 4 devices, the design document's
    `[[8,2]]` mesh) against one process driving the same 16 devices: the same losses."""
    import json

    [command] = page_commands("docs/multi_node.md", "device_count=4 torchrun")
    append = [*CPU_SCALE, "training.steps=3", "logging.every_steps=1"]
    output = ok(typed.run(command, *append, "hydra.run.dir=outputs/torchrun"))
    assert "(started by torchrun)" in output and "finished step 3 of 3" in output
    reference = ok(typed.run("python run_training.py 'model.mesh_shape=[[8,2],[\"fsdp\",\"tp\"]]'",
                             *append, "hydra.run.dir=outputs/one-process",
                             env={"XLA_FLAGS": "--xla_force_host_platform_device_count=16"}))
    assert "devices: 16 × cpu (cpu) over 1 process" in reference

    def losses(run: str) -> list[float]:
        lines = (typed.root / "outputs" / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines if '"loss"' in line]

    assert len(losses("torchrun")) == 3
    np.testing.assert_allclose(losses("torchrun"), losses("one-process"), rtol=1e-5)
