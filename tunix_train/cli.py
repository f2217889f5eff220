"""Entry-point glue shared by run_training.py and the `python -m tunix_train.*` tools:
DictConfig → typed Config, and user mistakes → one sentence and a non-zero exit."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Iterator

from omegaconf import DictConfig, OmegaConf

from tunix_train.config import Config, ConfigError

log = logging.getLogger("tunix_train")

EXIT_CONFIG_ERROR = 2
EXIT_NON_FINITE = 3  # training.nan_policy=halt met a non-finite step (the watchdog exits 4)


def typed(cfg: DictConfig) -> Config:
    return OmegaConf.to_object(cfg)


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


def run_training(cfg: DictConfig, run_dir: str) -> None:
    from tunix_train import train  # after Hydra has set up logging and the run dir

    with user_errors():
        train.run(typed(cfg), Path(run_dir))
