"""Model FLOPs per token and the peak FLOP/s of the device, for MFU.

MFU = (model FLOPs per token × tokens/s) / (peak FLOP/s × devices), where model FLOPs count what
the model needs, not what the program does (remat's recomputation is not counted):

    per token = 6·N                                   every parameter: 2 forward + 4 backward
              + 12 · heads · head_dim · Σ_layers ctx  QKᵀ and AV, forward + backward
    ctx       = mean keys a query attends to: (L+1)/2 for a causal layer over L tokens, and
                at most `window` for a sliding-window one.

N counts the output projection, a real matmul, but not the input lookup, which costs nothing:
with tied weights the embedding counts once (as the head), with an output head of its own the
embedding table is left out. This is PaLM's (Chowdhery et al. 2022, app. B) formula with the
causal half and Gemma's windows made exact.
"""

from __future__ import annotations

import logging

import jax

from tunix_train.config import LoggingConfig, ModelConfig
from tunix_train.models import families

log = logging.getLogger("tunix_train")

# Dense bf16 peak TFLOP/s per device (no sparsity), by a substring of `device.device_kind`.
# Checked in order: more specific names first.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
    ("H800", 989.4), ("GH200", 989.4), ("B200", 2250.0), ("B100", 1750.0),
    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10G", 70.0),
    ("V100", 125.0), ("TPU v6", 918.0), ("TPU v5p", 459.0), ("TPU v5 lite", 197.0),
    ("TPU v5e", 197.0), ("TPU v4", 275.0),
)


def mean_context(seq_len: int, window: int | None) -> float:
    """Mean number of keys a causal query attends to over a sequence of `seq_len` tokens."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    # Positions 0..w-1 see 1..w keys; the remaining seq_len - w positions see w each.
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def training_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    stacking = families.stacking(model)
    context = sum(stacking.count(stack) * mean_context(seq_len, stacking.window(stack))
                  for stack in stacking.stacks)
    matmul_params = families.active_params(model) - (
        0 if model.tie_embeddings else families.embedding_size(model))
    return 6.0 * matmul_params + 12.0 * model.num_heads * model.head_dim * context


def peak_flops_per_device(cfg: LoggingConfig, device: jax.Device) -> float | None:
    """`logging.peak_tflops`, else the table's entry for the device kind; None if unknown."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device.device_kind.lower():
            return tflops * 1e12
    return None


def mfu_per_token_per_s(model: ModelConfig, seq_len: int, cfg: LoggingConfig,
                        devices: list[jax.Device]) -> float | None:
    """The factor turning tokens/s into MFU (None when the peak is unknown, e.g. on CPU)."""
    peak = peak_flops_per_device(cfg, devices[0])
    per_token = training_flops_per_token(model, seq_len)
    if peak is None:
        log.info("MFU not reported: no peak FLOP/s known for %r; set logging.peak_tflops "
                 "(per device).", devices[0].device_kind)
        return None
    log.info("model FLOPs: %.3g per token; peak %.0f TFLOP/s × %d devices", per_token,
             peak / 1e12, len(devices))
    return per_token / (peak * len(devices))
