"""Whether a saved checkpoint fits this run, decided before any array is read: the saved train
state's structure and shapes against this run's (a changed model, optimizer or LoRA setting is
named with both values), and LoRA adapters against the frozen base they were trained on.
Reads nothing itself: checkpoint.py hands it the saved arrays' metadata and a reader of the
saved config.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import jax

from tunix_train.config import ConfigError

# Settings that decide the train state's structure or shapes, named when a checkpoint's differ.
STRUCTURE_KEYS = (
    *(f"model.{k}" for k in ("family", "num_layers", "embed_dim", "hidden_dim", "num_heads",
                             "num_kv_heads", "head_dim", "vocab_size", "global_every",
                             "tie_embeddings")),
    "optimizer.name", "optimizer.grad_clip", "optimizer.weight_decay",
    "lora.rank", "lora.targets",  # LoRA's adapters
)
# What checkpoints saved before a key existed meant by its absence.
_BEFORE_THE_KEY = {"model.family": "gemma3", "model.tie_embeddings": True, "lora.rank": 0,
                   "lora.targets": ["all"]}
LORA_BASE = "lora_base"  # the saved config's record of LoRA's frozen base (training/setup.py)


def check_structure(saved_tree: Any, target: Any, step_dir: Path,
                    read_saved_config: Callable[[], dict], config: dict | None,
                    part: str | None = None) -> None:
    """Before any array is read: the saved state (or its `part`) has the target's structure
    and shapes, or the user hears which settings differ."""
    saved, wanted = _shapes(saved_tree), _shapes(target)
    if part is not None:
        saved = _only(saved, part)
    if saved == wanted:
        return
    changed = _changed_settings(read_saved_config, config)
    if changed:
        what = "; ".join(f"{k}={a} there, {b} here" for k, a, b in changed)
    else:
        path = sorted(set(saved) ^ set(wanted) or
                      [k for k in saved if saved[k] != wanted.get(k)])[0]
        what = f"{path}: {saved.get(path, 'absent')} there, {wanted.get(path, 'absent')} here"
    params_fit = part is None and _only(saved, "params") == _only(wanted, "params")
    keep_params = (f", or take only its parameters with checkpoint.init_params_from={step_dir}"
                   if params_fit else "")
    raise ConfigError(
        f"checkpoint {step_dir} was saved with other settings that change the train state's shape "
        f"({what}); nothing was moved: continue it with the saved values or start afresh in "
        f"another hydra.run.dir{keep_params}.")


def check_lora_base(step_dir: Path, read_saved_config: Callable[[], dict],
                    config: dict | None) -> None:
    """LoRA adapters are only meaningful on the base they were trained on: a checkpoint whose
    recorded base (source and fingerprint) is not this run's is refused by name, naming the
    keys that make the base another one where one of them changed."""
    now = (config or {}).get(LORA_BASE)
    if now is None:
        return
    saved_config = read_saved_config()
    saved = saved_config.get(LORA_BASE)
    if saved is not None and _same_base(saved, now):
        return
    where = f"checkpoint {step_dir} holds LoRA adapters of another base"
    keep = "nothing was moved"
    changed = [(f"{section}.{key}", _get(saved_config, section, key), _get(config, section, key))
               for section, key in _BASE_KEYS]
    changed = [(k, there, here) for k, there, here in changed if there != here]
    if saved is not None and changed:
        named = "; ".join(f"{k}={there} there, {here} here" for k, there, here in changed)
        back = " ".join(f"{k}={there}" for k, there, _ in changed)
        raise ConfigError(f"{where}: {named}; {keep}: resume with {back}, or start afresh in "
                          f"another hydra.run.dir.")
    there = "none (not a LoRA run)" if saved is None else \
        f"{saved['source']} (fingerprint {_digits(saved['fingerprint'])})"
    raise ConfigError(
        f"{where}: {there} there, {now['source']} (fingerprint {_digits(now['fingerprint'])}) "
        f"here; {keep}: give the same base (model.init_from or checkpoint.init_params_from), or "
        f"start afresh in another hydra.run.dir.")


# What decides the frozen base's values beside its source.
_BASE_KEYS = (("lora", "base_quantization"), ("training", "mixed_precision"),
              ("model", "init_from"), ("checkpoint", "init_params_from"))


def _get(config: dict | None, section: str, key: str) -> Any:
    return ((config or {}).get(section) or {}).get(key)


def _same_base(saved: dict, now: dict) -> bool:
    """The same source and fingerprint: the digest compared as a number (to its 6 digits)."""
    return saved["source"] == now["source"] and math.isclose(
        float(saved["fingerprint"]), float(now["fingerprint"]), rel_tol=1e-5)


def _digits(fingerprint: str) -> str:
    return f"{float(fingerprint):.6e}"


def _only(shapes: dict[str, tuple], part: str) -> dict[str, tuple]:
    return {k: v for k, v in shapes.items() if k.startswith(part + "/")}


def _shapes(tree: Any) -> dict[str, tuple]:
    """{"opt_state/inner_state/1/0/mu/embedder/embedding": shape, ...} of arrays or metadata."""
    def name(key) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(map(name, path)): tuple(leaf.shape) for path, leaf in leaves}


def _changed_settings(read_saved_config: Callable[[], dict],
                      config: dict | None) -> list[tuple]:
    if config is None:
        return []
    saved = read_saved_config()
    changed = []
    for dotted in STRUCTURE_KEYS:
        section, key = dotted.split(".")
        before = saved.get(section, {}).get(key, _BEFORE_THE_KEY.get(dotted))
        now = config.get(section, {}).get(key, _BEFORE_THE_KEY.get(dotted))
        if before != now:
            changed.append((dotted, before, now))
    return changed
