"""`python -m tunix_train.export checkpoint.resume_from=<run dir> export.path=<dir>`

Writes a folder that Hugging Face `transformers` loads as the family's `…ForCausalLM`
(`Gemma3ForCausalLM`, `LlamaForCausalLM`, `Qwen3ForCausalLM`): config.json and
safetensors (split at `export.max_shard_gb` with an index). `model.init_from=hf:<dir>` instead
of a run exports an imported checkpoint (a round trip). If the weights first came from a
Hugging Face checkpoint that is still there, its tokenizer and generation config are copied;
otherwise the run's tokenizer file (`data.tokenizer`) is, and its special ids go into the config.

A LoRA run (models/lora.py) exports as `export.lora` says: `merged` folds its adapters into the
base's weights (dequantized, for QLoRA) and writes the folder above; `adapter` writes a PEFT
adapter folder (adapter_config.json, adapter_model.safetensors) for
`peft.PeftModel.from_pretrained` on the base model, whose folder is named in it when the base
came from `model.init_from=hf:<dir>`.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from tunix_train import cli, gc_policy, paths, validation
from tunix_train.config import Config, ConfigError
from tunix_train.data import tokenizer as tokenizer_lib
from tunix_train.models import hf_config

log = logging.getLogger("tunix_train")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                    "special_tokens_map.json", "generation_config.json")


def export(cfg: Config, explicit: Iterable[str] = (), tokenizer_chosen: bool = False) -> list[Path]:
    """Writes the export folder (process 0 only); returns the safetensors files written.
    `tokenizer_chosen`: `data.tokenizer` was given on the command line (else the weights' own)."""
    _check(cfg)
    from tunix_train.inference import weights  # JAX, Flax and Orbax: once the values are checked

    source = weights.tokenizer_source(cfg, tokenizer_chosen)
    tok = None if source == "none" else tokenizer_lib.open_tokenizer(source)  # fails before loading
    trained = weights.saved_lora(cfg.checkpoint.resume_from)[0] if cfg.checkpoint.resume_from \
        else cfg.lora
    if cfg.export.lora == "adapter" and not trained.on:
        raise ConfigError(f"export.lora=adapter writes a LoRA run's adapters, but "
                          f"{cfg.checkpoint.resume_from or cfg.model.init_from} has none "
                          f"(lora.rank=0); drop export.lora to export the whole model.")
    out = paths.make_dir("export.path", cfg.export.path, "folder")  # before the weights load
    cfg, layout, params = weights.for_inference(cfg, explicit)
    origin = weights.hf_origin(cfg.model)
    if layout.frozen is not None and cfg.export.lora == "adapter":
        return _export_adapter(cfg, params, out, origin)
    return _export_model(cfg, params, layout.frozen is not None, out, origin, (tok, source))


def _check(cfg: Config) -> None:
    validation.check_values(cfg)  # every key's, the export's and the model's among them
    if not cfg.export.path:
        raise ConfigError("export.path is not set; give the folder to write, e.g. export.path=out.")
    if not (cfg.checkpoint.resume_from or cfg.model.init_from):
        raise ConfigError(
            "nothing to export: set checkpoint.resume_from=<run dir> (or model.init_from=hf:<dir>)."
        )


def _export_model(cfg: Config, params: Any, adapters: bool, out: Path, origin: Path | None,
                  tokenizer: tuple[tokenizer_lib.Tokenizer | None, str]) -> list[Path]:
    """The whole model as a `transformers` folder; a LoRA run's `adapters` folded in."""
    import jax

    from tunix_train.models import hf_weights, lora, quantization

    if adapters:
        params = jax.jit(lambda p: lora.folded(quantization.dequantized(p), cfg.lora))(params)
    host = _to_host(params)
    if jax.process_index() != 0:
        return []
    tok, source = tokenizer
    files = hf_weights.save(host, cfg.model, out, np.dtype(cfg.export.dtype),
                            int(cfg.export.max_shard_gb * 1e9), _token_ids(tok, origin))
    if origin is not None:
        for name in _TOKENIZER_FILES:
            if (origin / name).is_file():
                shutil.copy2(origin / name, out / name)
    else:
        _copy_tokenizer(source, out)
    log.info("exported %s to %s (%d safetensors file(s))", cfg.model.name, out, len(files))
    return files


def _export_adapter(cfg: Config, params: Any, out: Path, origin: Path | None) -> list[Path]:
    """A LoRA run's adapters as a PEFT adapter folder for the base at `origin`."""
    import jax

    from tunix_train.models import hf_weights, lora
    from tunix_train.parallel import layout as layout_lib

    host = _to_host(layout_lib.select(params, lora.is_adapter))
    if jax.process_index() != 0:
        return []
    file = hf_weights.save_adapter(host, cfg.model, cfg.lora, out, np.dtype(cfg.export.dtype),
                                   None if origin is None else str(origin))
    log.info("exported the LoRA adapter of %s to %s (base: %s)", cfg.model.name, out,
             origin or "not a Hugging Face folder; export it with export.lora=merged")
    return [file]


def _to_host(params: Any) -> Any:
    import jax
    from jax.experimental import multihost_utils

    # Every process takes part in gathering a sharded array, even those that write nothing.
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                        params)


def _token_ids(tok: tokenizer_lib.Tokenizer | None,
               origin: Path | None) -> dict[str, int] | None:
    """Special token ids of the tokenizer the weights were trained with (None: the family's)."""
    if origin is not None:
        return hf_config.token_ids(origin)
    if tok is None:
        return None
    ids = {"pad_token_id": tok.pad_id, "eos_token_id": tok.eos_id, "bos_token_id": tok.bos_id}
    return {k: v for k, v in ids.items() if v is not None}


def _copy_tokenizer(source: str, out: Path) -> None:
    """A file tokenizer goes into the folder under the name `transformers` looks for."""
    kind, _, location = source.partition(":")
    path = Path(location).expanduser()
    if kind == "sentencepiece":
        shutil.copy2(path, out / "tokenizer.model")
    elif kind == "hf":
        file = path / "tokenizer.json" if path.is_dir() else path
        shutil.copy2(file, out / "tokenizer.json")
        if (file.parent / "tokenizer_config.json").is_file():
            shutil.copy2(file.parent / "tokenizer_config.json", out / "tokenizer_config.json")


def main(argv: list[str]) -> None:
    cli.tool_logging()
    with cli.user_errors():
        export(cli.compose(argv), cli.explicit_model_keys(argv), cli.given(argv, "data.tokenizer"))


if __name__ == "__main__":
    gc_policy.collect_less_often()
    main(sys.argv[1:])
