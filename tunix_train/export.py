"""`python -m tunix_train.export checkpoint.resume_from=<run dir> export.path=<dir>`

Writes a folder that Hugging Face `transformers` loads as `Gemma3ForCausalLM`: config.json and
safetensors (split at `export.max_shard_gb` with an index). `model.init_from=hf:<dir>` instead
of a run exports an imported checkpoint (a round trip). If the weights first came from a
Hugging Face checkpoint that is still there, its tokenizer and generation config are copied.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

import jax
import numpy as np
from jax.experimental import multihost_utils

from tunix_train import cli, pretrained
from tunix_train.config import Config, ConfigError
from tunix_train.data.tokenizer import ByteTokenizer
from tunix_train.models import hf_config, hf_weights

log = logging.getLogger("tunix_train")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "special_tokens_map.json", "generation_config.json")


def export(cfg: Config, explicit: Iterable[str] = ()) -> list[Path]:
    """Writes the export folder (process 0 only); returns the safetensors files written."""
    if not cfg.export.path:
        raise ConfigError("export.path is not set; give the folder to write, e.g. export.path=out.")
    if not (cfg.checkpoint.resume_from or cfg.model.init_from):
        raise ConfigError(
            "nothing to export: set checkpoint.resume_from=<run dir> (or model.init_from=hf:<dir>)."
        )
    cfg, _, params = pretrained.load(cfg, explicit)
    host = _to_host(params)
    if jax.process_index() != 0:
        return []
    out = Path(cfg.export.path).expanduser()
    origin = _origin(cfg)
    files = hf_weights.save(host, cfg.model, out, np.dtype(cfg.export.dtype),
                            int(cfg.export.max_shard_gb * 1e9), _token_ids(cfg, origin))
    for name in _TOKENIZER_FILES:
        if origin is not None and (origin / name).is_file():
            shutil.copy2(origin / name, out / name)
    log.info("exported %s to %s (%d safetensors file(s))", cfg.model.name, out, len(files))
    return files


def _to_host(params: Any) -> Any:
    # Every process takes part in gathering a sharded array, even those that write nothing.
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                        params)


def _origin(cfg: Config) -> Path | None:
    init_from = cfg.model.init_from
    if not init_from or not init_from.startswith(hf_config.HF_PREFIX):
        return None
    path = Path(init_from[len(hf_config.HF_PREFIX):]).expanduser()
    return path if (path / "config.json").is_file() else None


def _token_ids(cfg: Config, origin: Path | None) -> dict[str, int]:
    """Special token ids of the tokenizer the weights were trained with."""
    if origin is not None:
        hf = hf_config.read(origin)
        return {k: hf.get(k, v) for k, v in hf_config.GEMMA_TOKEN_IDS.items()}
    if cfg.data.tokenizer == "byte":
        byte = ByteTokenizer()
        return {"pad_token_id": byte.pad_id, "eos_token_id": byte.eos_id,
                "bos_token_id": byte.bos_id}
    return dict(hf_config.GEMMA_TOKEN_IDS)


def main(argv: list[str]) -> None:
    cli.tool_logging()
    with cli.user_errors():
        export(cli.compose(argv), cli.explicit_model_keys(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
