"""Weights for inference and export, each array created in its sharding on the current mesh:
a training run's checkpoint (`checkpoint.resume_from=<run dir>`), a Hugging Face checkpoint
(`model.init_from=hf:<dir>`), or, for trying things out, a random initialisation. A LoRA run's
checkpoint holds its adapters: its base is rebuilt from the source the run recorded, and the
model gets both (the adapters on)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable

import jax

from tunix_train import checkpoint, starting_weights
from tunix_train.config import Config, LoraConfig, ModelConfig
from tunix_train.models import hf_config
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.parallel.layout import ParamLayout

log = logging.getLogger("tunix_train")


def for_inference(cfg: Config, explicit: Iterable[str]) -> tuple[Config, ParamLayout, Any]:
    """(config with the weights' model dimensions, their layout on the current mesh, the
    model's whole parameter tree, laid out as `layout.merged_shardings()`).
    `checkpoint.resume_from=<run dir>` wins over `model.init_from`; with neither, the
    parameters are the random initialisation of `training.seed`."""
    base_source = None
    if cfg.checkpoint.resume_from:
        cfg.model = saved_model_config(cfg.checkpoint.resume_from, cfg.model, explicit)
        cfg.lora, base_source = saved_lora(cfg.checkpoint.resume_from)
    devices = jax.devices()
    mesh = mesh_lib.create_mesh(mesh_lib.parse(cfg.model.mesh_shape, len(devices)), devices)
    layout = ParamLayout.create(cfg.model, mesh, cfg.training.zero_stage,
                                mixed_precision=cfg.training.mixed_precision, lora=cfg.lora)
    if cfg.checkpoint.resume_from:
        log.info("loading parameters from %s", cfg.checkpoint.resume_from)
        params = checkpoint.load_params(cfg.checkpoint.resume_from, layout.abstract,
                                        layout.shardings)
        if layout.frozen is None:
            return cfg, layout, params
        seed, init_params_from = base_source
        base = starting_weights.base(layout, seed, init_params_from)
        return cfg, layout, layout.merge(params, base)
    if not cfg.model.init_from:
        log.warning("neither checkpoint.resume_from nor model.init_from is set: using random "
                    "weights")
    return cfg, layout, layout.merge(*starting_weights.initial(layout, cfg.training.seed))


def saved_lora(run_dir: str | Path) -> tuple[LoraConfig, tuple[int, str | None]]:
    """A saved run's LoRA settings, and where its base came from: (training.seed,
    checkpoint.init_params_from); `model.init_from` is in its model config."""
    saved = checkpoint.saved_config(run_dir)
    lora = LoraConfig(**saved.get("lora", {}))
    return lora, (saved["training"]["seed"], saved["checkpoint"].get("init_params_from"))


def saved_model_config(run_dir: str | Path, current: ModelConfig,
                       explicit: Iterable[str]) -> ModelConfig:
    """The saved run's model (newest committed step), placed on the current command's mesh."""
    saved = checkpoint.saved_config(run_dir)
    # The command's own keys stay (mesh, attention); `init_from` stays as a record of where
    # the weights first came from (export copies that checkpoint's tokenizer).
    fields = set(hf_config.CHECKPOINT_KEYS) | {"name", "init_from"}
    model = {k: v for k, v in saved["model"].items() if k in fields}
    return hf_config.adopt(current, model, explicit, f"the checkpoint of {run_dir}")


def hf_origin(model: ModelConfig) -> Path | None:
    """The Hugging Face checkpoint folder `model.init_from` names, if it is still there."""
    init_from = model.init_from
    if not init_from or not init_from.startswith(hf_config.HF_PREFIX):
        return None
    path = Path(init_from[len(hf_config.HF_PREFIX):]).expanduser()
    return path if (path / "config.json").is_file() else None


def tokenizer_source(cfg: Config, chosen: bool) -> str:
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
