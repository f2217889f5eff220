"""Compile time of the train step against depth: scanned layers make it (nearly) flat.

    python bench/compile_time.py                       # gemma3_tiny widths, 4 vs 26 layers
    python bench/compile_time.py model=gemma3_1b 'model.mesh_shape=[[1,1],["fsdp","tp"]]'

Compiles the framework's jitted step from abstract shapes (nothing is allocated, so even the
published sizes compile on a laptop) at `model.num_layers` = 4, 14 and 26, each in a fresh
cache, best of two. The last line is JSON with `ratio` = compile(26) / compile(4) and
`ratio_same_structure` = compile(26) / compile(14).

Why two ratios: the program holds one copy of each distinct layer body, whatever the depth.
4 layers are all local (one body); 14 and 26 both have several [5 local + global] blocks and 2
trailing locals (three bodies: local-in-block, global, trailing local), so 14 → 26 is depth
alone (goal <= 1.2) and 4 → 26 adds the other layer kinds (unrolled layers would grow ~6.5×).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tunix_train import cli  # noqa: E402
from tunix_train.training.setup import Setup  # noqa: E402

DEPTHS = (4, 14, 26)


def compile_seconds(overrides: list[str], layers: int) -> float:
    cfg = cli.compose([*overrides, f"model.num_layers={layers}"])
    setup = Setup.create(cfg)
    best = float("inf")
    for _ in range(2):
        jax.clear_caches()
        start = time.perf_counter()
        setup.compile_train_step()
        best = min(best, time.perf_counter() - start)
    return best


def main(overrides: list[str]) -> dict:
    seconds = {layers: compile_seconds(overrides, layers) for layers in DEPTHS}
    for layers, s in seconds.items():
        print(f"{layers:3d} layers: compile {s:.2f} s")
    result = {"ratio": round(seconds[26] / seconds[4], 3),
              "ratio_same_structure": round(seconds[26] / seconds[14], 3),
              "compile_s": {str(k): round(v, 3) for k, v in seconds.items()},
              "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
              "overrides": overrides}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
