import dataclasses
import typing

import pytest
from hydra.errors import ConfigCompositionException

from helpers import compose_config
from tunix_train import config as config_lib
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
    with pytest.raises(ConfigCompositionException):
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
        config_lib.validate(compose_config(override))


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
    missing = [f"{s}.{k}" for s, k in numeric_keys() if (s, k) not in config_lib._RANGES]
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
        config_lib.validate(compose_config(override))
    assert str(error.value) == expected
