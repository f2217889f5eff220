"""Entry-point glue shared by run_training.py and the `python -m tunix_train.*` tools:
DictConfig → typed Config, and user mistakes → one sentence and a non-zero exit."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from tunix_train.checkpoint import StorageError
from tunix_train.config import CONFIG_DIR, Config, ConfigError

log = logging.getLogger("tunix_train")

EXIT_CONFIG_ERROR = 2
EXIT_NON_FINITE = 3  # training.nan_policy=halt met a non-finite step (the watchdog exits 4)
EXIT_STORAGE = 6  # a checkpoint could not be read, for a reason other than damage (5: init)


def typed(cfg: DictConfig, overrides: Sequence[str] = ()) -> Config:
    """The typed config; with `model.init_from`, model dimensions come from that checkpoint."""
    from tunix_train.models import hf_config

    config = OmegaConf.to_object(cfg)
    config.model = hf_config.resolve(config.model, explicit_model_keys(overrides))
    return config


def explicit_model_keys(overrides: Sequence[str]) -> set[str]:
    """Model keys the user chose on the command line: `model.k=v`, or all of a `model=<name>`."""
    from tunix_train.models import hf_config

    keys = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "model":
            keys.update(hf_config.CHECKPOINT_KEYS)
        elif key.startswith("model."):
            keys.add(key.split(".")[1])
    return keys


def given(overrides: Sequence[str], key: str) -> bool:
    """Whether the command line sets `key` itself."""
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in overrides)


def compose(argv: Sequence[str]) -> Config:
    """Config of a `python -m tunix_train.<tool> overrides...` command (no Hydra run dir)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from tunix_train.config import register_configs

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose("config", overrides=list(argv))
        return typed(cfg, argv)
    except (HydraException, OmegaConfBaseException) as error:  # a misspelt key or bad value
        raise ConfigError(" ".join(str(error).split())) from None


class BelowError(logging.Filter):
    """Lets through what is not an error: the console on stdout leaves errors to stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def tool_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(levelname)s] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    for noisy in ("absl", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A ConfigError is the user's to fix, a halt on NaN the run's: one sentence, no traceback."""
    try:
        yield
    except ConfigError as error:
        log.error("error: %s", error)
        sys.exit(EXIT_CONFIG_ERROR)
    except FloatingPointError as error:  # the loop's NonFiniteLoss: the run, not the code, failed
        log.error("error: %s", error)
        sys.exit(EXIT_NON_FINITE)
    except StorageError as error:
        log.error("error: %s", error)
        sys.exit(EXIT_STORAGE)


def run_training(cfg: DictConfig, run_dir: str, hooks=None) -> None:
    """`hooks`: tests/faulty_training.py's fault injection; run_training.py passes none."""
    from hydra.core.hydra_config import HydraConfig

    # After Hydra set up logging and the run dir:
    from tunix_train.grpo import trainer as grpo_trainer
    from tunix_train.training import run as default_trainer

    with user_errors():
        config = typed(cfg, HydraConfig.get().overrides.task)
        trainer = grpo_trainer if config.trainer.name == "grpo" else default_trainer
        trainer.run(config, Path(run_dir), hooks or default_trainer.StepHooks())
