"""The pipeline bubble the planner prints, against the step time it costs, in one run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/pipeline_bubble.py [overrides]

Times the real train step on the same model, global batch and ZeRO stage with pp=2
(pp 2 × fsdp 4, 16 rows per fsdp shard cut into M pipeline micro-batches) and without pipeline
stages (fsdp 8, the same rows as M/2 accumulated micro-batches, so that every matmul has the
pipeline micro-batch's shape: CPU speed per FLOP depends on it). Every device of one CPU shares
the same cores, so a stage's idle iterations are not hidden by other stages' work: they cost
compute, as a GPU's idle time costs wall-clock. With the blocks dominating the step,
step(pp) / step(no pp) ≈ 1 / (1 - bubble), so the measured bubble is 1 - step(no pp) /
step(pp), to set beside the printed (pp-1)/(M+pp-1), and for the circular schedule with two
rounds (`training.pipeline_repeats=2`) beside (pp-1)/(2·M+pp-1). The default model is block-heavy (small
vocabulary, no trailing layers) so that what runs outside the stages stays a small part. Loops
are as configured (rolled by default; `model.unroll_layers=true` unrolls the layers and the
pipeline's iterations): docs/performance.md has both. The last line is JSON.
"""

from __future__ import annotations

import json
import sys

import jax

from timing import alternating_medians, train_stepper

ROUNDS, STEPS_PER_ROUND, WARMUP = 5, 2, 1
MODEL = ["model.num_layers=8", "model.global_every=2", "model.embed_dim=128",
         "model.hidden_dim=512", "model.num_heads=4", "model.num_kv_heads=1",
         "model.head_dim=32", "model.vocab_size=512", "model.sliding_window=64",
         "data.seq_len=128", "training.micro_batch_size=8", "training.mixed_precision=fp32",
         "training.zero_stage=1"]
NO_PP = 'model.mesh_shape=[[8,1],["fsdp","tp"]]'
PP2 = 'model.mesh_shape=[[2,4,1],["pp","fsdp","tp"]]'
MICROBATCHES = (2, 4, 8)
REPEATS = (1, 2)  # GPipe, and the circular schedule with 2 rounds (4 blocks: chunks of 1)


def main(overrides: list[str]) -> dict:
    runs, plans = {}, {}
    for m in MICROBATCHES:
        runs[("none", m)] = train_stepper([*MODEL, *overrides, NO_PP,
                                           f"training.micro_batch_size={16 // m}",
                                           f"training.gradient_accumulation_steps={m // 2}"])[1]
        for v in REPEATS:
            setup, runs[(v, m)] = train_stepper([*MODEL, *overrides, PP2,
                                                 "training.micro_batch_size=16",
                                                 f"training.pipeline_microbatches={m}",
                                                 f"training.pipeline_repeats={v}"])
            plans[(v, m)] = setup.options.pipeline
    median = alternating_medians(runs, WARMUP, ROUNDS, STEPS_PER_ROUND)
    rows = []
    for v in REPEATS:
        for m in MICROBATCHES:
            baseline, plan, step = median[("none", m)], plans[(v, m)], median[(v, m)]
            measured = 1 - baseline / step
            rows.append({"repeats": v, "microbatches": m,
                         "printed_bubble": round(plan.bubble, 4),
                         "measured_bubble": round(measured, 4),
                         "step_ratio": round(step / baseline, 4),
                         "relative_error": round(abs(measured - plan.bubble) / plan.bubble, 3)})
            print(f"{'GPipe' if v == 1 else f'circular, {v} rounds'}, M={m}: printed bubble "
                  f"{plan.bubble:.1%}, measured {measured:.1%} (step {step * 1e3:.0f} ms vs "
                  f"{baseline * 1e3:.0f} ms without pp)")
    result = {"rows": rows, "devices": jax.device_count(),
              "device_kind": jax.devices()[0].device_kind}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
