"""Training throughput and MFU of the compiled train step on random tokens (no data pipeline).

    python bench/mfu.py model=gemma3_1b data.seq_len=2048 training.mixed_precision=bf16 \\
        training.micro_batch_size=4 'model.mesh_shape=[[-1,1],["fsdp","tp"]]'

Any run_training.py override is accepted. The step is the framework's own (`Setup.train_step`),
fed one fixed batch already on the devices, so the number is the step's speed alone
(the median of `MFU_ROUNDS`, default 5, timings of 5 steps). The batch
is a real one from the configured data (packed documents, so attention carries document
masks); `MFU_BATCH=random` uses unpacked random tokens instead (no masks).
Prints tokens/s/device and MFU (model FLOPs from tunix_train/analysis/flops.py over the device kind's
peak; `logging.peak_tflops=…` sets the peak where the table has none). The last line is JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tunix_train import cli  # noqa: E402
from tunix_train.analysis import flops  # noqa: E402
from tunix_train.models import attention  # noqa: E402
from tunix_train.training.setup import Setup  # noqa: E402

WARMUP, STEPS_PER_ROUND = 3, 5
ROUNDS = int(os.environ.get("MFU_ROUNDS", 5))  # the median of ROUNDS timings of 5 steps


def main(overrides: list[str]) -> dict:
    cfg = cli.compose(overrides)
    setup = Setup.create(cfg)
    batch = _batch(setup)
    step = setup.train_step()
    state = setup.fresh_state()
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    state = [state]

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            state[0], metrics = compiled(state[0], batch)
        jax.block_until_ready(metrics["loss"])
        return (time.perf_counter() - start) / steps

    run(WARMUP)
    step_s = statistics.median(run(STEPS_PER_ROUND) for _ in range(ROUNDS))
    return report(cfg, setup, step_s, compile_s, _attention(cfg, setup, batch, compiled))


def _attention(cfg, setup, batch, compiled) -> str:
    """The attention path the step took: the model's rule (models/attention.py), except that a
    cuDNN call it refused falls back; cuDNN's fused attention shows up as __cudnn$fmha calls."""
    if "__cudnn$fmha" in compiled.as_text():
        return "cudnn"
    path, _ = attention.attention_path(cfg.model.attention_impl, setup.options.compute_dtype,
                                       "segment_ids" in batch, cfg.data.seq_len,
                                       cfg.model.head_dim)
    return attention.without_cudnn(cfg.data.seq_len, cfg.model.head_dim, "")[0] \
        if path == "cudnn" else path


def _batch(setup: Setup):
    if os.environ.get("MFU_BATCH", "data") != "data":
        return setup.random_batch()
    data = setup.open_data()
    batch = next(data.train)
    data.close()
    return batch


def report(cfg, setup, step_s: float, compile_s: float, attention: str) -> dict:
    devices = jax.devices()
    tokens = setup.tokens_per_step
    per_token = flops.training_flops_per_token(cfg.model, cfg.data.seq_len)
    peak = flops.peak_flops_per_device(cfg.logging, devices[0])
    tokens_per_s_device = tokens / step_s / len(devices)
    mfu = tokens_per_s_device * per_token / peak if peak else None
    result = {
        "model": cfg.model.name, "device_kind": devices[0].device_kind, "devices": len(devices),
        "mesh": dict(setup.mesh.shape), "seq_len": cfg.data.seq_len,
        "compute_dtype": np.dtype(setup.options.compute_dtype).name,
        "batch": os.environ.get("MFU_BATCH", "data"),
        "attention": attention,
        "peak_memory_gb": _peak_memory_gb(devices[0]),
        "tokens_per_step": tokens, "step_s": round(step_s, 5), "compile_s": round(compile_s, 1),
        "tokens_per_s_per_device": round(tokens_per_s_device, 1),
        "model_flops_per_token": per_token,
        "mfu": None if mfu is None else round(mfu, 4),
    }
    print(f"{cfg.model.name} on {len(devices)} × {devices[0].device_kind}: "
          f"{tokens_per_s_device:,.0f} tokens/s/device, step {step_s * 1e3:.1f} ms, "
          f"{attention} attention, peak memory "
          + (f"{result['peak_memory_gb']} GB" if result["peak_memory_gb"] is not None else "n/a")
          + ", MFU "
          + (f"{mfu:.1%}" if mfu is not None else "n/a (set logging.peak_tflops)"))
    print(json.dumps(result))
    return result


def _peak_memory_gb(device) -> float | None:
    """The device allocator's high-water mark (GB = 1e9 bytes); None where the backend keeps
    no statistics (CPU)."""
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else round(peak / 1e9, 2)


if __name__ == "__main__":
    main(sys.argv[1:])
