"""Hugging Face `config.json` ↔ our `ModelConfig`, for every family.

`model_type` names the family (models/families.py); the family reads and writes its own keys
(models/<family>.py), with transformers' defaults filled in for keys a checkpoint leaves out, and
refuses by name the options it does not implement. Multimodal Gemma 3 checkpoints nest the text
model under `text_config`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.paths import HF_PREFIX

if TYPE_CHECKING:
    from tunix_train.models.family import Family

# The families (and Flax with them) are imported where a checkpoint's config is read or written,
# not at the top: cli.typed imports this module to check a command's config, and a refused
# value is told before the model code loads.

# ModelConfig keys that are not the checkpoint's to decide: the command's own.
RUNTIME_KEYS = ("name", "init_from", "mesh_shape", "sharding_rules", "attention_impl",
                "cp_exchange", "unroll_layers")
# Every ModelConfig key that a checkpoint decides.
CHECKPOINT_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                        if f.name not in RUNTIME_KEYS)


def checkpoint_dir(init_from: str) -> Path:
    """The folder named by `model.init_from=hf:<dir>`, checked to hold a config.json."""
    if not init_from.startswith(HF_PREFIX):
        raise ConfigError(
            f"model.init_from={init_from!r} is not supported; use hf:<folder of a Hugging Face "
            f"checkpoint>."
        )
    path = Path(init_from[len(HF_PREFIX):]).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.init_from={init_from!r}: {path / 'config.json'} does not exist; point it at a "
            f"folder holding config.json and *.safetensors."
        )
    return path


def read(path: Path) -> tuple[Family, dict[str, Any]]:
    """The family of the checkpoint at `path` and its (text) model's config.json entries,
    with the family's defaults filled in."""
    from tunix_train.models import families

    raw = json.loads((path / "config.json").read_text())
    text = raw.get("text_config", raw) if raw.get("model_type") == "gemma3" else raw
    if "model_type" not in text and "text_config" in raw:
        text = {**text, "model_type": "gemma3_text"}
    family = families.by_model_type(text.get("model_type", "gemma3_text"),
                                    str(path / "config.json"))
    defaults = family.hf_defaults()
    # An explicit null for a defaulted key (e.g. "rope_scaling": null) means the default.
    return family, {**defaults,
                    **{k: v for k, v in text.items() if v is not None or k not in defaults}}


def model_fields(family: Family, hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields described by a config.json (as returned by `read`)."""
    return {"family": family.name, **family.from_hf(hf)}


def resolve(model: ModelConfig, explicit: Iterable[str]) -> ModelConfig:
    """`model` with the dimensions of its `init_from` checkpoint (see `adopt`)."""
    if not model.init_from:
        return model
    path = checkpoint_dir(model.init_from)
    adopted = adopt(model, model_fields(*read(path)), explicit, str(path / "config.json"))
    return dataclasses.replace(adopted, name=path.name)


def adopt(model: ModelConfig, fields: dict[str, Any], explicit: Iterable[str],
          source: str) -> ModelConfig:
    """`model` with `fields` (a checkpoint's dimensions) replacing its own.

    `explicit` names the model keys the user set on the command line: one that contradicts the
    checkpoint is a mistake (a different shape than the weights), not a preference.
    """
    for key in sorted(set(explicit) & set(fields)):
        ours, theirs = getattr(model, key), fields[key]
        if ours is not None and theirs is not None and not _same(ours, theirs):
            raise ConfigError(
                f"model.{key}={ours} contradicts {source}, which gives {theirs}; drop the "
                f"override (the dimensions come from the checkpoint)."
            )
    return dataclasses.replace(model, **fields)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str) or isinstance(a, bool) or isinstance(b, bool):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-9) if isinstance(a, float) or \
        isinstance(b, float) else a == b


def to_hf(model: ModelConfig, token_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """A `<Family>ForCausalLM` config.json for `model`."""
    from tunix_train.models import families

    family = families.of(model)
    return {"architectures": list(family.architectures), **family.to_hf(model),
            **(token_ids if token_ids is not None else family.default_token_ids)}


def token_ids(path: Path) -> dict[str, int]:
    """The special token ids a Hugging Face checkpoint's config.json names (its family's
    defaults where it names none)."""
    family, hf = read(path)
    return {k: hf.get(k, v) if hf.get(k) is not None else v
            for k, v in family.default_token_ids.items()}
