"""What keeping the parameters in host memory costs a step, in one run.

    python bench/offload.py [overrides]

The real train step of the same model and batch three ways: everything on the device; Adam's
moments in pinned host memory (`training.offload_optimizer=true`); and the parameters there
too (`training.offload_params=true`: each layer copied to the device when reached, the update
streamed a layer at a time). On a CPU both memories are the same RAM, so the ratio is the cost
of the copies and of the layer-at-a-time update themselves, not of a PCIe link; on a GPU the
same command measures the link too. Steps are timed in alternating rounds; the last line is
JSON.
"""

from __future__ import annotations

import json
import sys

import jax

from timing import alternating_medians, train_stepper

ROUNDS, STEPS_PER_ROUND, WARMUP = 5, 2, 1
MODEL = ["model=llama3_tiny", "model.num_layers=8", "model.embed_dim=256",
         "model.hidden_dim=1024", "model.head_dim=64", "model.num_heads=4",
         "model.num_kv_heads=2", "data.seq_len=512", "training.micro_batch_size=4",
         "model.mesh_shape=[[1,1],[\"fsdp\",\"tp\"]]"]
VARIANTS = {"device": [], "optimizer_offloaded": ["training.offload_optimizer=true"],
            "params_offloaded": ["training.offload_optimizer=true",
                                 "training.offload_params=true"]}


def main(overrides: list[str]) -> dict:
    runs = {name: train_stepper([*MODEL, *extra, *overrides], devices=1)[1]
            for name, extra in VARIANTS.items()}
    median = alternating_medians(runs, WARMUP, ROUNDS, STEPS_PER_ROUND)
    ratios = {name: median[name] / median["device"] for name in runs if name != "device"}
    print(f"step: on the device {median['device'] * 1e3:.0f} ms, optimizer offloaded "
          f"{median['optimizer_offloaded'] * 1e3:.0f} ms ({ratios['optimizer_offloaded']:.2f}x), "
          f"parameters and optimizer offloaded {median['params_offloaded'] * 1e3:.0f} ms "
          f"({ratios['params_offloaded']:.2f}x)")
    result = {"step_s": {k: round(v, 4) for k, v in median.items()},
              **{f"{k}_over_device": round(v, 3) for k, v in ratios.items()},
              "device_kind": jax.devices()[0].device_kind}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
