"""The one place that asks JAX which platform runs the program.

The CPU and the GPU program differ on purpose in a few places, each for a reason its caller
states: a CPU has no bf16 matmul or bf16 collective (parallel/collectives.py carries 16-bit
reductions in fp32, models/layers.py transposes a projection's operand itself,
models/partitioning.py keeps one-device axes manual), cuDNN and the Pallas kernels need a GPU
(models/attention.py, models/flash.py), `training.mixed_precision=auto` is fp32 on a CPU
(parallel/layout.py), the CPU client creates 4-bit arrays its AOT executables refuse
(training/setup.py), a multi-process CPU job keys JAX's persistent cache by its devices' kinds
(parallel/distributed.py), the start-up lines name the platform and advise CUDA's wheels on a
machine whose GPUs JAX does not use (training/run.py, parallel/mesh.py), and tokamax's GPU
kernels, which call what jax 0.11 removed, are refused by name (models/moe.py). Asking
here, and only here (tests/test_architecture.py), keeps that list short and findable: every
difference between the program a CPU test runs and the one a GPU runs starts at a call to these
functions.
"""

from __future__ import annotations

import jax


def name() -> str:
    """"cpu", "gpu" or "tpu": the platform of JAX's default devices."""
    return jax.default_backend()


def is_cpu() -> bool:
    return name() == "cpu"


def is_gpu() -> bool:
    return name() == "gpu"
