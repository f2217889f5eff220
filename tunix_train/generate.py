"""`python -m tunix_train.generate <model/checkpoint overrides> generate.prompt="…"`

Loads weights (`checkpoint.resume_from=<run dir>` or `model.init_from=hf:<dir>`), runs the
compiled KV-cache sampler (tunix_train/inference/sampler.py) on one prompt and prints the
completion; the last line printed is JSON `{"ids": [...], "text": "..."}` (`ids` = the new
tokens only).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any, Iterable

from tunix_train import cli, gc_policy, validation
from tunix_train.config import Config, ConfigError
from tunix_train.data import tokenizer as tokenizer_lib

if TYPE_CHECKING:  # JAX, Flax and Orbax are imported once the values are checked
    from tunix_train.inference.sampler import SamplingOptions


def tokenizer(cfg: Config, chosen: bool = False) -> tokenizer_lib.Tokenizer | None:
    """The weights' tokenizer (see `weights.tokenizer_source`); None for `data.tokenizer=none`."""
    from tunix_train.inference import weights

    source = weights.tokenizer_source(cfg, chosen)
    return None if source == "none" else tokenizer_lib.open_tokenizer(source)


def prompt_ids(cfg: Config, tok: tokenizer_lib.Tokenizer | None) -> list[int]:
    g = cfg.generate
    if (g.prompt is None) == (g.prompt_ids is None):
        raise ConfigError('set exactly one of generate.prompt="text" or generate.prompt_ids=[...].')
    if g.prompt_ids is not None:
        ids = list(g.prompt_ids)
    elif tok is None:
        raise ConfigError("data.tokenizer=none cannot encode generate.prompt; pass token ids as "
                          "generate.prompt_ids=[...] or name a tokenizer with data.tokenizer=...")
    else:
        tokenizer_lib.check_vocab(tok, cfg.model.vocab_size)
        bos = [] if tok.bos_id is None else [tok.bos_id]
        ids = [*bos, *tok.encode(g.prompt).tolist()]
    bad = [i for i in ids if not 0 <= i < cfg.model.vocab_size]
    if not ids or bad:
        raise ConfigError(
            f"generate.prompt_ids must be non-empty ids below model.vocab_size="
            f"{cfg.model.vocab_size}; got {bad or 'none'}."
        )
    return ids


def options(cfg: Config, tok: tokenizer_lib.Tokenizer | None) -> SamplingOptions:
    from tunix_train.inference.sampler import SamplingOptions

    g = cfg.generate
    eos = g.eos_id
    if eos is None:
        eos = -1 if tok is None or tok.eos_id is None else tok.eos_id
    return SamplingOptions(g.max_new_tokens, g.temperature, g.top_k, eos)


def generate(cfg: Config, explicit: Iterable[str] = (),
             tokenizer_chosen: bool = False) -> dict[str, Any]:
    """`explicit`: model keys given on the command line; `tokenizer_chosen`: so was
    `data.tokenizer` (else the weights' own tokenizer is used)."""
    # Every key's value (the generate.*, model.* and lora.* ones among them), before any
    # weights are read or JAX imported.
    validation.check_values(cfg)
    from tunix_train.inference import weights
    from tunix_train.inference.sampler import Sampler

    tok = tokenizer(cfg, tokenizer_chosen)
    ids = prompt_ids(cfg, tok)
    sampling = options(cfg, tok)
    cfg, layout, params = weights.for_inference(cfg, explicit)
    sampler = Sampler(layout.graphdef, layout.merged_shardings(), sampling,
                      layout.compute_dtype, layout.mesh, layout.rules.params)
    new = sampler(params, [ids], seed=cfg.generate.seed)[0]
    # Rows of a vocabulary padded beyond the tokenizer's have no text (an untrained model may
    # still pick them); `ids` keeps them.
    text = tok.decode([i for i in new if i < tok.vocab_size]) if tok is not None else ""
    return {"ids": new, "text": text}


def main(argv: list[str]) -> None:
    cli.tool_logging()
    with cli.user_errors():
        result = generate(cli.compose(argv), cli.explicit_model_keys(argv),
                          cli.given(argv, "data.tokenizer"))
    print(result["text"])
    print(json.dumps(result))


if __name__ == "__main__":
    gc_policy.collect_less_often()
    main(sys.argv[1:])
