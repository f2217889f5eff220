"""Data pipeline tokens/s vs the tokens/s the train step consumes: same config, same run.

    python bench/data_throughput.py                      # gemma3_tiny, builtin corpus, bytes
    python -m tunix_train.data.demo demo_data && python bench/data_throughput.py data=jsonl data.path=demo_data/docs.jsonl data.tokenizer=sentencepiece:demo_data/spm.model

Any Hydra override of run_training.py is accepted. The pipeline is timed alone (source → tokenize
→ pack → batch → global jax.Array, its prefetch thread included) over `PIPELINE_STEPS` batches;
the train step is compiled, warmed up and timed on one device-resident batch. The last line is
JSON with `ratio` = pipeline / train-step tokens per second (goal >= 10: the data never stalls
the step).
"""

from __future__ import annotations

import json
import sys
import time

import jax

from tunix_train import cli
from tunix_train.data import pipeline
from tunix_train.training.setup import Setup

PIPELINE_WARMUP, PIPELINE_STEPS = 5, 200
STEP_WARMUP, STEPS = 2, 10


def pipeline_seconds_per_batch(data: pipeline.Data) -> float:
    for _ in range(PIPELINE_WARMUP):
        next(data.train)
    start = time.perf_counter()
    for _ in range(PIPELINE_STEPS):
        batch = next(data.train)
    jax.block_until_ready(batch)
    return (time.perf_counter() - start) / PIPELINE_STEPS


def step_seconds(setup: Setup, batch: pipeline.Batch) -> float:
    step = setup.train_step()
    state = setup.fresh_state()
    for _ in range(STEP_WARMUP):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(STEPS):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / STEPS


def main(overrides: list[str]) -> dict:
    cfg = cli.compose(overrides)
    setup = Setup.create(cfg)
    data = setup.open_data()
    per_batch = pipeline_seconds_per_batch(data)
    batch = next(data.train)
    data.close()
    per_step = step_seconds(setup, batch)
    tokens = setup.tokens_per_step
    result = {
        "ratio": round(per_step / per_batch, 2),
        "pipeline_tokens_per_s": round(tokens / per_batch), "step_tokens_per_s": round(tokens / per_step),
        "data": cfg.data.name, "tokenizer": cfg.data.tokenizer, "packing": cfg.data.packing,
        "model": cfg.model.name, "tokens_per_step": tokens, "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
    }
    print(f"pipeline {tokens / per_batch:,.0f} tokens/s, train step {tokens / per_step:,.0f} "
          f"tokens/s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
