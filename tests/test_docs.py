"""Commands shown in README.md and docs/: all must compose (test_docs_as_typed*.py run them)."""

import re
import shlex
from pathlib import Path

import pytest

from helpers import REPO, compose_config
from tunix_train import overrides as overrides_lib

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def shown_commands(path: Path, script: str = "run_training.py") -> list[str]:
    """Shell lines inside ```bash blocks that invoke `script` (directly or via the launcher)."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if f" {script}" in line and not line.startswith("#")]


def split_command(line: str, script: str = "run_training.py") -> tuple[dict, list[str]]:
    """(environment assignments, Hydra overrides) of one shown command."""
    words = shlex.split(line.split("&&")[-1])
    while script not in words:  # `srun bash -c '... run_training.py ...'`
        words = shlex.split(next(w for w in words if script in w))
    at = words.index(script)
    env = dict(w.split("=", 1) for w in words[:at] if re.match(r"^[A-Z_]+=", w))
    return env, words[at + 1:]


ALL = [(p.name, c) for p in DOCS for c in shown_commands(p)]


@pytest.mark.parametrize("page,command", ALL, ids=[f"{p}:{i}" for i, (p, _) in enumerate(ALL)])
def test_every_shown_training_command_composes(page, command):
    _, words = split_command(command)
    flags_with_values = {i + 1 for i, w in enumerate(words) if w in ("--cfg", "-c")}
    overrides = [w for i, w in enumerate(words) if not w.startswith(("-", "hydra"))
                 and i not in flags_with_values]
    if "-m" in words or "--multirun" in words:  # a sweep: its first point
        overrides = overrides_lib.single_values(overrides)
    compose_config(*overrides)


RUNNABLE = shown_commands(REPO / "docs" / "distributed_training.md")


def test_docs_show_the_parallelism_examples():
    meshes = {tuple(split_command(c)[1][0:1]) for c in RUNNABLE}
    assert {("model.mesh_shape=[[1,1],[\"fsdp\",\"tp\"]]",), ("model.mesh_shape=[[2,2],[\"fsdp\",\"tp\"]]",),
            ("model.mesh_shape=[[2,2,2],[\"pp\",\"fsdp\",\"tp\"]]",)} <= meshes


def test_models_guide_sampler_snippet_runs():
    page = REPO / "docs" / "models.md"
    [script] = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    scope: dict = {}
    exec(compile(script, str(page), "exec"), scope)
    assert [len(c) for c in scope["completions"]] == [8, 8]
    assert all(0 <= i < 512 for c in scope["completions"] for i in c)


def test_ci_runs_exactly_readmes_test_command_and_it_installs_the_parity_reference():
    import tomllib

    readme = (REPO / "README.md").read_text()
    [command] = [line for line in readme.splitlines() if "python -m pytest" in line]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith("#")]
    assert ci[-1] == command
    assert not [line for line in ci if "pip install" in line and line != command
                and "--upgrade pip" not in line]  # nothing installed beside it
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = lambda extra: {r.split("=")[0].split(">")[0] for r in extras[extra]}  # noqa: E731
    assert {"torch", "transformers"} <= names("test")
    # docs/multi_node.md's `pip install -c constraints.txt -e '.[slurm]'`: what the suite ran,
    # at the versions it ran (pinned: unpinned, the plugin pulls a pre-release hydra-core).
    constraints = (REPO / "constraints.txt").read_text().splitlines()
    pinned = {line.split("==")[0] for line in constraints}
    assert names("slurm") <= names("test") and names("slurm") | {"submitit"} <= pinned
