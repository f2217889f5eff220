"""Parameters for inference and export: from a run's checkpoint, a Hugging Face checkpoint, or
(for trying things out) a fresh random initialisation — always created in their shardings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import jax
from flax import nnx

from tunix_train import checkpoint, saved_run
from tunix_train.config import Config, ModelConfig
from tunix_train.models import hf_config, hf_weights
from tunix_train.models.gemma3 import Gemma3
from tunix_train.training.run import Setup, build_setup

log = logging.getLogger("tunix_train")


def load(cfg: Config, explicit: Iterable[str]) -> tuple[Config, Setup, Any]:
    """(config with the weights' model dimensions, setup on the current mesh, parameters).

    `checkpoint.resume_from=<run dir>` wins over `model.init_from`; with neither, the
    parameters are the random initialisation of `training.seed`.
    """
    if cfg.checkpoint.resume_from:
        cfg.model = saved_run.model_config(cfg.checkpoint.resume_from, cfg.model, explicit)
    setup = build_setup(cfg)
    abstract, shardings = setup.spec.abstract["params"], setup.spec.shardings["params"]
    if cfg.checkpoint.resume_from:
        log.info("loading parameters from %s", cfg.checkpoint.resume_from)
        return cfg, setup, saved_run.load_params(cfg.checkpoint.resume_from, abstract, shardings)
    if cfg.model.init_from:
        return cfg, setup, hf_weights.load_init_from(cfg.model, abstract, shardings)
    log.warning("neither checkpoint.resume_from nor model.init_from is set: using random weights")
    make = lambda: nnx.to_pure_dict(nnx.state(Gemma3(cfg.model, rngs=nnx.Rngs(cfg.training.seed))))  # noqa: E731
    return cfg, setup, jax.jit(make, out_shardings=shardings)()


def hf_origin(model: ModelConfig) -> Path | None:
    """The Hugging Face checkpoint folder `model.init_from` names, if it is still there."""
    init_from = model.init_from
    if not init_from or not init_from.startswith(hf_config.HF_PREFIX):
        return None
    path = Path(init_from[len(hf_config.HF_PREFIX):]).expanduser()
    return path if (path / "config.json").is_file() else None


def tokenizer_spec(cfg: Config, chosen: bool) -> str:
    """The `data.tokenizer` the weights go with: the command line's when `chosen` there, else
    the saved run's (`checkpoint.resume_from`), else an imported checkpoint's own tokenizer file,
    else the config's."""
    if chosen:
        return cfg.data.tokenizer
    if cfg.checkpoint.resume_from:
        return checkpoint.saved_config(cfg.checkpoint.resume_from).get("data", {}).get(
            "tokenizer", cfg.data.tokenizer)
    origin = hf_origin(cfg.model)
    for name, kind in (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece")):
        if origin is not None and (origin / name).is_file():
            return f"{kind}:{origin / name}"
    return cfg.data.tokenizer
