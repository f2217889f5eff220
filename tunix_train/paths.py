"""Every path a user gives, resolved once, at config time, against the starting directory.

A user types relative paths (`checkpoint.init_params_from=outputs/sums-sft`) and expects them to
mean what they mean in their shell. Orbax refuses relative paths, a resumed or launched run may
start elsewhere, and a checkpoint's saved config is read by later commands from other
directories; so each path key is made absolute here, before anything reads it, and a path that
must already exist and does not is one sentence naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path

from tunix_train.config import Config, ConfigError

HF_PREFIX = "hf:"
_TOKENIZER_KINDS = ("sentencepiece:", "hf:")


class StorageError(OSError):
    """A checkpoint could not be read for a reason other than damage (nothing was moved), or
    could not be saved (checkpoint.py raises it; here, below the commands, so that they catch
    it without importing Orbax and JAX before a bad override is refused)."""


class PeerSaveError(RuntimeError):
    """A save of a multi-process job failed where this process waited for the others (one
    failed or is gone): exit code 5, and the process that failed first says why."""


def absolute(path: str, base: Path) -> str:
    """`path` (`~` expanded, globs kept) made absolute against `base`; absolute paths stay."""
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else os.path.normpath(base / expanded)


def resolve(cfg: Config, base: Path) -> Config:
    """Makes every path key of `cfg` absolute against `base` (in place) and checks that the
    checkpoints and model folders it names exist. Data paths are checked when data opens,
    where a glob is expanded."""
    d = cfg.data
    for section, key in (("checkpoint", "resume_from"), ("checkpoint", "init_params_from")):
        value = getattr(getattr(cfg, section), key)
        if value:
            setattr(getattr(cfg, section), key, _existing(f"{section}.{key}", value, base))
    if cfg.model.init_from and cfg.model.init_from.startswith(HF_PREFIX):
        folder = _existing("model.init_from", cfg.model.init_from[len(HF_PREFIX):], base)
        cfg.model.init_from = HF_PREFIX + folder
    d.path = absolute(d.path, base) if d.path else d.path
    d.eval_path = absolute(d.eval_path, base) if d.eval_path else d.eval_path
    d.tokenizer = _tokenizer(d.tokenizer, base)
    cfg.export.path = absolute(cfg.export.path, base) if cfg.export.path else cfg.export.path
    return cfg


def _existing(key: str, value: str, base: Path) -> str:
    path = absolute(value, base)
    if not os.path.exists(path):
        where = "" if value == path else f" ({path})"
        raise ConfigError(f"{key}={value} does not exist{where}; give an existing path, "
                          f"relative to the directory the command is started from or absolute.")
    return path


def _tokenizer(source: str, base: Path) -> str:
    for kind in _TOKENIZER_KINDS:
        if source.startswith(kind) and len(source) > len(kind):
            return kind + absolute(source[len(kind):], base)
    return source


def make_dir(key: str, value: str, what: str = "directory") -> Path:
    """The folder a key names, made (with its parents) now, or a ConfigError naming the key,
    the value and why it cannot be made (a path through a file, /proc, no permission)."""
    path = Path(value).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        where = f" at {error.filename}" if error.filename else ""
        raise ConfigError(f"{key}={value} cannot be created ({os.strerror(error.errno)}{where}); "
                          f"give a {what} you can write to.") from None
    return path
