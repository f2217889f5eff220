"""`python -m tunix_train.generate <model/checkpoint overrides> generate.prompt="…"`

Loads weights (`checkpoint.resume_from=<run dir>` or `model.init_from=hf:<dir>`), runs the
compiled KV-cache sampler (tunix_train/sampler.py) on one prompt and prints the completion; the
last line printed is JSON `{"ids": [...], "text": "..."}` (`ids` = the new tokens only).
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable

from tunix_train import cli, pretrained
from tunix_train.config import Config, ConfigError
from tunix_train.data.tokenizer import ByteTokenizer
from tunix_train.sampler import Sampler, SamplingOptions
from tunix_train.train import compute_dtype


def tokenizer(cfg: Config) -> Any:
    if cfg.data.tokenizer != "byte":
        raise ConfigError(
            f"data.tokenizer={cfg.data.tokenizer!r} cannot encode generate.prompt here; pass "
            f"token ids as generate.prompt_ids=[...] instead."
        )
    return ByteTokenizer()


def prompt_ids(cfg: Config) -> list[int]:
    g = cfg.generate
    if (g.prompt is None) == (g.prompt_ids is None):
        raise ConfigError('set exactly one of generate.prompt="text" or generate.prompt_ids=[...].')
    ids = list(g.prompt_ids) if g.prompt_ids is not None else [
        tokenizer(cfg).bos_id, *tokenizer(cfg).encode(g.prompt).tolist()]
    bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
    if not ids or bad:
        raise ConfigError(
            f"generate.prompt_ids must be non-empty ids below model.vocab_size="
            f"{cfg.model.vocab_size}; got {bad or 'none'}."
        )
    return ids


def options(cfg: Config) -> SamplingOptions:
    g = cfg.generate
    if g.temperature < 0 or g.top_k < 0:
        raise ConfigError("generate.temperature and generate.top_k must be >= 0.")
    eos = g.eos_id
    if eos is None:
        eos = tokenizer(cfg).eos_id if cfg.data.tokenizer == "byte" else -1
    return SamplingOptions(g.max_new_tokens, g.temperature, g.top_k, eos)


def generate(cfg: Config, explicit: Iterable[str] = ()) -> dict[str, Any]:
    ids = prompt_ids(cfg)
    sampling = options(cfg)
    cfg, setup, params = pretrained.load(cfg, explicit)
    sampler = Sampler(setup.spec.graphdef, setup.spec.shardings["params"], sampling,
                      compute_dtype(cfg.training.mixed_precision), setup.mesh, setup.plan.params)
    new = sampler(params, [ids], seed=cfg.generate.seed)[0]
    text = tokenizer(cfg).decode(new) if cfg.data.tokenizer == "byte" else ""
    return {"ids": new, "text": text}


def main(argv: list[str]) -> None:
    cli.tool_logging()
    with cli.user_errors():
        result = generate(cli.compose(argv), cli.explicit_model_keys(argv))
    print(result["text"])
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
