"""Context parallelism against data parallelism on the same devices, in one run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/context_parallel.py [overrides]

The real train step on 8 devices, the same model and the same 8 rows of 4,096 tokens per step:
fsdp 8 (one row per device) against fsdp 2 × cp 4 (4 rows per fsdp rank, each split into 4
parts, an early and a late piece each), the latter twice: keys and values passed around a ring
and all-gathered (`model.cp_exchange`). Every device does the same FLOPs of projections
and MLP either way, and the same attention tiles; cp adds the exchange of each layer's keys and
values and reduces weight gradients over fsdp × cp instead of fsdp. Steps are timed in
alternating rounds; the last line is JSON.
"""

from __future__ import annotations

import json
import sys

import jax

from timing import alternating_medians, train_stepper

ROUNDS, STEPS_PER_ROUND, WARMUP = 5, 2, 1
MODEL = ["model.num_layers=4", "model.global_every=2", "model.embed_dim=128",
         "model.hidden_dim=512", "model.num_heads=4", "model.num_kv_heads=1",
         "model.head_dim=32", "model.vocab_size=512", "model.sliding_window=512",
         "data.seq_len=4096", "training.global_batch_size=8", "training.mixed_precision=fp32",
         "model.attention_impl=blockwise"]
MESHES = {"fsdp8": 'model.mesh_shape=[[8,1,1],["fsdp","cp","tp"]]',
          "fsdp2_cp4": 'model.mesh_shape=[[2,4,1],["fsdp","cp","tp"]]'}


def main(overrides: list[str]) -> dict:
    runs = {"fsdp8": train_stepper([*MODEL, *overrides, MESHES["fsdp8"]])[1]}
    for exchange in ("ring", "all_gather"):
        runs[f"fsdp2_cp4_{exchange}"] = train_stepper(
            [*MODEL, *overrides, MESHES["fsdp2_cp4"], f"model.cp_exchange={exchange}"])[1]
    median = alternating_medians(runs, WARMUP, ROUNDS, STEPS_PER_ROUND)
    ratios = {name: median[name] / median["fsdp8"] for name in runs if name != "fsdp8"}
    print(f"step: fsdp 8 {median['fsdp8'] * 1e3:.0f} ms, fsdp 2 × cp 4 ring "
          f"{median['fsdp2_cp4_ring'] * 1e3:.0f} ms, all-gather "
          f"{median['fsdp2_cp4_all_gather'] * 1e3:.0f} ms; cp / fsdp "
          f"{ratios['fsdp2_cp4_ring']:.2f} (ring), {ratios['fsdp2_cp4_all_gather']:.2f} "
          f"(all-gather)")
    result = {"step_s": {k: round(v, 4) for k, v in median.items()},
              "cp_over_fsdp_ring": round(ratios["fsdp2_cp4_ring"], 3),
              "cp_over_fsdp_all_gather": round(ratios["fsdp2_cp4_all_gather"], 3),
              "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
