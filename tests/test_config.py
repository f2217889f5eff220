import dataclasses
import typing

import pytest
from hydra.errors import ConfigCompositionException

from helpers import compose_config
from tunix_train import config as config_lib
from tunix_train import validation
from tunix_train.config import ConfigError
from tunix_train.training.setup import batch_shape


def test_defaults_compose_into_the_typed_schema():
    cfg = compose_config()
    assert isinstance(cfg, config_lib.Config)
    assert cfg.model.name == "gemma3_tiny" and cfg.data.name == "builtin"
    assert cfg.model.mesh_shape == [[-1, 1], ["fsdp", "tp"]]


@pytest.mark.parametrize("name,layers,dim", [("gemma3_270m", 18, 640), ("gemma3_1b", 26, 1152),
                                             ("gemma3_4b", 34, 2560)])
def test_model_group_has_published_dimensions(name, layers, dim):
    cfg = compose_config(f"model={name}")
    assert (cfg.model.num_layers, cfg.model.embed_dim, cfg.model.vocab_size) == (
        layers, dim, 262144)


def test_misspelt_key_and_wrong_type_fail_in_hydra():
    with pytest.raises(ConfigCompositionException):  # Hydra's own error; cli.py words it
        compose_config("training.setps=3")
    with pytest.raises(ConfigCompositionException):
        compose_config("training.steps=many")


def test_unknown_model_is_a_composition_error():
    with pytest.raises(ConfigCompositionException, match="gemma3_2b"):
        compose_config("model=gemma3_2b")


@pytest.mark.parametrize("override,match", [
    ("data.seq_len=0", "data.seq_len=0 is out of range: it must be at least 1."),
    ("training.mixed_precision=fp8", "training.mixed_precision='fp8' is not one of"),
    ("training.zero_stage=4", r"training.zero_stage=4 is out of range: it must be in \[0, 3\]"),
    ("model.num_kv_heads=3", "model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
    ("training.sync_gradients_every=3", "must divide training.gradient_accumulation_steps"),
])
def test_validation_names_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        validation.validate(compose_config(override))


def test_global_batch_must_divide_over_fsdp_and_accumulation():
    cfg = compose_config("training.global_batch_size=10", "training.gradient_accumulation_steps=2")
    with pytest.raises(ConfigError, match=r"global_batch_size=10 does not divide over fsdp=4"):
        batch_shape(cfg.training, cfg.data.seq_len, fsdp_size=4)
    cfg = compose_config("training.global_batch_size=16", "training.gradient_accumulation_steps=2")
    assert batch_shape(cfg.training, cfg.data.seq_len, fsdp_size=4).rows == 8  # micro 2 × fsdp 4


def test_an_installed_package_carries_every_config_file():
    """tunix_train/configs links to configs/, and pyproject's package-data globs cover every file
    in it, so a non-editable install finds the Hydra tree too."""
    import fnmatch
    import tomllib

    from helpers import REPO
    from tunix_train.config import CONFIG_DIR

    assert CONFIG_DIR.resolve() == (REPO / "configs").resolve()
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["tunix_train"]
    files = [p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*.yaml")]
    assert files and all(any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/")
                             for p in patterns) for f in files), files


def numeric_keys() -> list[tuple[str, str]]:
    keys = []
    for section in dataclasses.fields(config_lib.Config):
        hints = typing.get_type_hints(section.default_factory)
        for key, hint in hints.items():
            if {int, float} & ({hint} | set(typing.get_args(hint))):
                keys.append((section.name, key))
    return keys


def test_every_numeric_key_has_an_allowed_range():
    missing = [f"{s}.{k}" for s, k in numeric_keys() if (s, k) not in validation._RANGES]
    assert not missing, f"no range for {missing}"


@pytest.mark.parametrize("override,expected", [
    ("optimizer.lr=-1", "optimizer.lr=-1.0 is out of range: it must be at least 0."),
    ("optimizer.b1=1.0", "optimizer.b1=1.0 is out of range: it must be in [0, 1)."),
    ("data.validation_fraction=1", "data.validation_fraction=1.0 is out of range: it must be in "
                                   "(0, 1)."),
    ("training.zero_stage=-1", "training.zero_stage=-1 is out of range: it must be in [0, 3]."),
    ("checkpoint.every_steps=-2", "checkpoint.every_steps=-2 is out of range: it must be at "
                                  "least 0."),
    ("logging.peak_tflops=0", "logging.peak_tflops=0.0 is out of range: it must be above 0."),
])
def test_a_value_out_of_range_is_one_sentence_with_key_value_and_range(override, expected):
    with pytest.raises(ConfigError) as error:
        validation.validate(compose_config(override))
    assert str(error.value) == expected


def test_both_batch_keys_may_be_set_only_if_they_agree():
    cfg = compose_config("training.global_batch_size=16", "training.micro_batch_size=2",
                         "training.gradient_accumulation_steps=2")
    assert batch_shape(cfg.training, 32, fsdp_size=4).rows == 8  # 2 × 4 × 2 = 16: agreed
    with pytest.raises(ConfigError, match=r"training.global_batch_size=16 but training."
                                          r"micro_batch_size=2 × fsdp=2 × gradient_accumulation_"
                                          r"steps=2 = 8; set only one"):
        batch_shape(cfg.training, 32, fsdp_size=2)
    assert batch_shape(compose_config().training, 32, fsdp_size=2).rows == 16  # the default 8


def test_every_user_path_becomes_absolute_against_the_start_directory(tmp_path):
    import os

    from tunix_train import paths

    (tmp_path / "outputs" / "run").mkdir(parents=True)
    (tmp_path / "ckpt").mkdir()
    cfg = compose_config("checkpoint.init_params_from=outputs/run", "data=jsonl",
                         "data.path=corpus/*.jsonl", "data.eval_path='~/val.jsonl'",
                         "data.tokenizer=sentencepiece:tok.model", "export.path=exported/",
                         "model.init_from=hf:ckpt")
    paths.resolve(cfg, tmp_path)
    assert cfg.checkpoint.init_params_from == str(tmp_path / "outputs" / "run")
    assert cfg.data.path == str(tmp_path / "corpus" / "*.jsonl")  # a glob stays a glob
    assert cfg.data.eval_path == os.path.expanduser("~/val.jsonl")
    assert cfg.data.tokenizer == f"sentencepiece:{tmp_path / 'tok.model'}"
    assert cfg.export.path == str(tmp_path / "exported")
    assert cfg.model.init_from == f"hf:{tmp_path / 'ckpt'}"
    assert paths.resolve(compose_config(), tmp_path).data.tokenizer == "byte"


@pytest.mark.parametrize("override,key", [
    ("checkpoint.resume_from=outputs/gone", "checkpoint.resume_from"),
    ("checkpoint.init_params_from=outputs/gone", "checkpoint.init_params_from"),
    ("model.init_from=hf:checkpoints/gone", "model.init_from"),
])
def test_a_missing_path_is_one_sentence_naming_the_key(tmp_path, override, key):
    from tunix_train import paths

    with pytest.raises(ConfigError, match=rf"^{key}=\S*gone does not exist \({tmp_path}/"):
        paths.resolve(compose_config(override), tmp_path)


@pytest.mark.parametrize("given,group,why", [
    (["data.path=a/b.jsonl"], "jsonl", "its extension"),
    (["data.path=corpus/*.parquet"], "parquet", "its extension"),
    (["data.path=train.bin"], "tokens", "its extension"),
    (["data.path=notes/*.txt"], "text", "its extension"),
    (["trainer=grpo", "data.path=prompts.jsonl"], "prompts", "trainer=grpo's data"),
    (["trainer=dpo", "data.path=pairs.jsonl"], "preferences", "trainer=dpo's data"),
])
def test_a_data_path_without_its_group_takes_its_trainers_or_its_extensions(given, group, why):
    from tunix_train import overrides

    composed, note = overrides.with_data_group(given)
    assert composed == [f"data={group}", *given] and f"read as data={group} ({why})" in note
    assert overrides.compose_checked(composed).data.name in (group, "jsonl")  # sft/jsonl alias
    assert overrides.with_data_group(["data=text", "data.path=x.jsonl"])[0] == [
        "data=text", "data.path=x.jsonl"]  # a chosen group is the user's


def test_a_data_path_of_unknown_kind_without_a_group_is_refused():
    from tunix_train import overrides

    with pytest.raises(ConfigError, match="data.path=corpus needs a data= group"):
        overrides.with_data_group(["data.path=corpus"])


def test_near_miss_keys_get_a_suggestion_and_sweeps_are_checked_at_their_first_value():
    from tunix_train import overrides

    with pytest.raises(ConfigError, match=r"optimiser.lr is not a config key \(did you mean "
                                          r"optimizer.lr\?\)"):
        overrides.compose_checked(["optimiser.lr=1e-3"])
    with pytest.raises(ConfigError, match="colour is not a config key, with or without a .+. in"):
        overrides.compose_checked(["+colour=red"])
    assert overrides.single_values(["optimizer.lr=1e-3,3e-4", "training.steps=3"]) == [
        "optimizer.lr=0.001", "training.steps=3"]
    assert set(overrides.known_keys()) >= {"training.steps", "model.mesh_shape", "grpo.beta"}


# (trainer, its keys, lora.rank) → whether a reference model is held, and the updates a step.
TRAINER_CASES = [
    ("default", {}, 0, False, 1),
    ("grpo", {"beta": 0.04, "num_iterations": 3}, 0, True, 3),
    ("grpo", {"beta": 0.0}, 0, False, 1),
    ("grpo", {"beta": 0.04}, 8, False, 1),  # LoRA: the base with the adapters off
    ("dpo", {}, 0, True, 1),
    ("dpo", {"precompute_reference": True}, 8, False, 1),
]


@pytest.mark.parametrize("trainer,keys,rank,held,updates", TRAINER_CASES)
def test_the_trainer_registry_says_which_runs_hold_a_reference_and_count_their_updates(
        trainer, keys, rank, held, updates):
    from tunix_train import trainers
    from tunix_train.training import reference

    cfg = config_lib.Config()
    cfg.trainer.name, cfg.lora.rank, cfg.training.steps = trainer, rank, 10
    for key, value in keys.items():
        setattr(getattr(cfg, trainer), key, value)
    reason = reference.none_held(cfg)
    assert (reason is None) == held, reason
    assert reason is None or reason == trainers.NO_REFERENCE or "none held" in reason
    if "precompute_reference" in keys:  # the trainer's own reason comes before LoRA's
        assert "dpo.precompute_reference=true" in reason
    assert trainers.optimizer_steps(cfg) == 10 * updates


@pytest.mark.parametrize("jax_version,flax_version,refused", [
    ("0.11.2", "0.12.8", True), ("0.11.0rc1", "0.12.9", True), ("0.12.0", "0.12.9", True),
    ("0.11.2", "0.12.10", False), ("0.11.2", "0.13.0.dev20261201", False),
    ("0.10.2", "0.12.8", False)])
def test_a_flax_that_cannot_import_on_the_installed_jax_is_one_sentence(jax_version, flax_version,
                                                                         refused):
    """jax 0.11 removed what flax 0.12.9 and older import; pip lets that pairing install."""
    installed = {"jax": jax_version, "flax": flax_version}.__getitem__
    if not refused:
        validation.check_installed(installed)
        return
    with pytest.raises(ConfigError) as error:
        validation.check_installed(installed)
    assert str(error.value) == (
        f"flax {flax_version} is installed with jax {jax_version}, and flax older than 0.12.10 "
        f"does not import on jax 0.11 or newer: pip install 'flax>=0.12.10', or go back to the "
        f"pinned versions with pip install -c constraints.txt -e .")


def test_the_installed_versions_are_checked_before_any_value(monkeypatch):
    """Every command checks single keys' values before it imports Flax
    (validation.check_values), and the installed versions first."""
    import importlib.metadata

    cfg = compose_config()
    validation.check_values(cfg)  # these versions pass
    monkeypatch.setattr(importlib.metadata, "version", {"jax": "0.11.2", "flax": "0.12.8"}.get)
    with pytest.raises(ConfigError, match="flax 0.12.8 is installed with jax 0.11.2"):
        validation.check_values(cfg)
