"""The package's import arrows run one way, read from the source of every module:

    entry points (cli, plan, generate, export, launch)
      → grpo, dpo → training → inference → analysis → parallel → models, data, checkpoint
      → config, validation, paths, backend, gc_policy

No cycles; the model package never imports the distribution layer (it names logical axes only);
inference never imports the trainer; mesh axis names are spelled in the mesh module alone.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tunix_train"

LAYERS = [  # top to bottom; a module may import its own layer's modules and those below
    {"tunix_train.cli", "tunix_train.plan", "tunix_train.generate", "tunix_train.export",
     "tunix_train.launch", "tunix_train.overrides"},
    {"tunix_train.grpo", "tunix_train.dpo"},
    {"tunix_train.training"},
    {"tunix_train.inference"},
    {"tunix_train.analysis", "tunix_train.starting_weights"},
    {"tunix_train.parallel"},
    {"tunix_train.models", "tunix_train.data", "tunix_train.checkpoint",
     "tunix_train.checkpoint_fit", "tunix_train.checkpoint_storage",
     "tunix_train.checkpoint_damage"},
    {"tunix_train.config", "tunix_train.validation", "tunix_train.trainers", "tunix_train.paths",
     "tunix_train.backend", "tunix_train.gc_policy"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package modules `name` imports, anywhere in its source (function bodies too)."""
    targets = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets.add(node.module)
            targets |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {t for t in targets if t in MODULES and t not in (name, "tunix_train")}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> int | None:
    for index, members in enumerate(LAYERS):
        if any(name == m or name.startswith(m + ".") for m in members):
            return index
    return None


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "tunix_train" and _layer(m) is None] == []


def test_arrows_run_down_the_layers_only():
    upward = [(a, b) for a, targets in GRAPH.items() for b in targets
              if _layer(a) is not None and _layer(b) < _layer(a)]
    assert upward == []


def test_the_import_graph_has_no_cycles():
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                pytest.fail("import cycle: " + " → ".join(path[path.index(target):] + [target])
                            if target in path else f"import cycle through {target}")
            if target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_models_name_logical_axes_only_and_inference_needs_no_trainer():
    for name, targets in GRAPH.items():
        if name.startswith("tunix_train.models"):
            assert not any(t.startswith("tunix_train.parallel") for t in targets), name
        if name.startswith("tunix_train.inference") or name in (
                "tunix_train.generate", "tunix_train.export"):
            assert not any(t.startswith("tunix_train.training") for t in targets), name


def test_mesh_axis_names_are_spelled_in_the_mesh_module_alone():
    spelled = {name for name, path in MODULES.items()
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and node.value in ("fsdp", "tp", "ep")}
    assert spelled == {"tunix_train.parallel.mesh"}


def test_the_platform_is_asked_in_the_backend_module_alone():
    """Every difference between the CPU's program and a GPU's starts at tunix_train/backend.py
    (the brief: keep `jax.default_backend()` checks few and in one place)."""
    asking = {name for name, path in MODULES.items()
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Attribute) and node.attr == "default_backend"}
    assert asking == {"tunix_train.backend"}


def _code_strings(tree: ast.AST) -> list[str]:
    """String constants of a module, docstrings left out."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_production_code_can_switch_on_fault_injection():
    """Faults reach a run only through tests/faulty_training.py: the package neither names a
    fault variable nor imports the tests' hooks."""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert not [s for s in _code_strings(tree) if "FAULT" in s.upper().replace("DEFAULT", "")], path
        imported = {alias.name for node in ast.walk(tree)
                    if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        assert "faults" not in imported and "Faults" not in imported, path


FAMILY_MODULES = {"tunix_train.models.gemma3", "tunix_train.models.llama3",
                  "tunix_train.models.qwen3", "tunix_train.models.qwen3_moe",
                  "tunix_train.models.mixtral"}
OUTSIDE_MODELS = ("tunix_train.parallel", "tunix_train.training", "tunix_train.inference",
                  "tunix_train.analysis", "tunix_train.grpo")


def test_families_are_registered_not_imported_by_the_layers_that_use_models():
    """The distribution layer and everything above it see a model through models/family.py,
    families.py and decoder.py: none imports a family's module or spells a family's stacks."""
    from tunix_train.config import ModelConfig
    from tunix_train.models import families
    from tunix_train.models.family import LAYERS, TRAILING

    every_stack = ModelConfig(num_layers=13, global_every=6, num_experts=4, moe_every=3,
                              expert_hidden_dim=8)  # blocks and trailing layers, dense and routed
    stacks = {s for f in families.FAMILIES.values() for s in f.stacking(every_stack).stacks}
    stacks -= {LAYERS, TRAILING}  # also the logical axes of layer stacks, which rules name
    assert stacks == {"local_layers", "global_layers", "dense_layers"}
    assert {f"tunix_train.models.{name}" for name in families.FAMILIES} == FAMILY_MODULES
    for name, targets in GRAPH.items():
        if name.startswith(OUTSIDE_MODELS):
            assert not targets & FAMILY_MODULES, name
            spelled = set(_code_strings(ast.parse(MODULES[name].read_text()))) & stacks
            assert not spelled, (name, spelled)
    importers = {name for name, targets in GRAPH.items() if targets & FAMILY_MODULES}
    assert importers == {"tunix_train.models.families", "tunix_train.models.qwen3",
                         "tunix_train.models.qwen3_moe", "tunix_train.models.mixtral"}


def test_the_names_the_validator_accepts_are_the_registries_own():
    """validation.py sits below the family registry (it may not import it), so it keeps the
    families' names: every family it accepts has a description. The trainer registry names its
    trainers' code without importing it: every trainer's is there, its own."""
    from tunix_train import trainers, validation
    from tunix_train.models import families

    assert tuple(families.FAMILIES) == validation.FAMILY_NAMES
    tasks = {name: trainers.task_of(name) for name in trainers.TRAINERS}
    assert len(set(tasks.values())) == len(tasks), tasks
