"""A mixture of experts' train step against a dense model of the same active size, in one run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/moe.py [overrides]

The MoE model is Qwen 3 MoE with E = 8 experts of width F, each token through 2 of them
(every layer routed); the dense one is Qwen 3 with an MLP of width 2·F: the same multiply-adds
per token in every matmul but the router's (d × E). Both train on the same random batch with the
same attention, on one device, on fsdp 4 × tp 2 and with the experts split over devices on
fsdp 2 × ep 4 (the dense model there on fsdp 8: ep devices are data-parallel ranks for every
weight but the experts), timed in alternating rounds; the ratio
step(MoE) / step(dense) is what routing costs: the router, the sort, moving rows to their
experts and back, and the grouped matmul's own waste. Three grouped matmuls are timed:
`blocks` (the default: each expert's mean share in place, the rest by a loop over the tiles it
fills), `model.moe_matmul=tiles` (every expert's rows padded to tiles: at most half the rows
again) and `model.moe_matmul=ragged_dot` (jax.lax.ragged_dot, which XLA's CPU compiler turns
into every row times every expert). A fourth run, `balanced`, is the blocks with
`model.moe_force_load_balance=true`: pseudo-random router logits in the forward pass, so each
expert takes its mean share up to sampling noise, as under a router trained to balance
(Megatron-Core and torchtitan time MoE steps so); the others route by the router at init,
whose choices on this random batch are uneven. The last line is JSON.

The widths (d = 256, F = 512 by default) and what is timed can be changed:

    MOE_EMBED_DIM=512 MOE_EXPERT_WIDTH=1024 MOE_VARIANTS=blocks \
        XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/moe.py

(heads of 64: d / 64 heads, half as many key-value heads; `MOE_VARIANTS` names the MoE runs,
comma-separated, of `blocks`, `balanced`, `tiles` and `ragged_dot`; on the ep mesh the
exchange's blocks bounded at twice a shard's mean share are timed too.)

`MOE_EXPERTS` (8 by default) sets E, the experts' width and the dense model staying as they are:
with 2, every token goes to both experts, so the MoE has the dense model's parameters and rows
and the ratio is what routing's machinery costs alone (docs/performance.md); each doubling of E
after that doubles the experts' parameters, and what moving them costs, for the same work.

So can the batch, `MOE_SEQUENCES` sequences of 256 tokens a step (8 by default; a multiple of
the meshes' data-parallel ranks: 1, 4 and 8), and the meshes timed, `MOE_MESHES`
(comma-separated, of `1`, `fsdp4xtp2` and `fsdp2xep4`).
The tiles' padding is a fixed number of rows a device (at most E tiles' worth, tiles of up to
256 rows), so its share of the work falls as each device's tokens grow:

    MOE_SEQUENCES=128 MOE_MESHES=1,fsdp4xtp2 MOE_VARIANTS=tiles \
        XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/moe.py

(8,192 tokens on each of fsdp 4's data-parallel ranks, 32,768 on one device:
docs/performance.md).
"""

from __future__ import annotations

import json
import os
import sys

import jax

from timing import alternating_medians, train_stepper

ROUNDS, STEPS_PER_ROUND, WARMUP = 15, 2, 1
TOP_K = 2


def _whole_number(knob: str, default: int) -> int:
    """An integer knob; anything else is one sentence and exit 2, before anything compiles."""
    value = os.environ.get(knob, str(default))
    if not value.isdigit():
        print(f"error: {knob}={value} is not a whole number; give one such as {default}.",
              file=sys.stderr)
        sys.exit(2)
    return int(value)


EXPERTS = _whole_number("MOE_EXPERTS", 8)
EMBED_DIM = _whole_number("MOE_EMBED_DIM", 256)
EXPERT_WIDTH = _whole_number("MOE_EXPERT_WIDTH", 512)
SEQUENCES, SEQ_LEN = _whole_number("MOE_SEQUENCES", 8), 256
SHARED = ["model.num_layers=4", f"model.embed_dim={EMBED_DIM}",
          f"model.num_heads={EMBED_DIM // 64}", f"model.num_kv_heads={EMBED_DIM // 128}",
          "model.head_dim=64", "model.vocab_size=512",
          f"data.seq_len={SEQ_LEN}", "training.mixed_precision=fp32"]
MOE = ["model=qwen3_moe_tiny", f"model.num_experts={EXPERTS}",
       f"model.experts_per_token={TOP_K}", f"model.expert_hidden_dim={EXPERT_WIDTH}"]
DENSE = ["model=qwen3_tiny", f"model.hidden_dim={TOP_K * EXPERT_WIDTH}"]
# MOE_MESHES key: (name, the MoE's mesh, the dense model's, devices, data-parallel ranks)
ONE_DEVICE = 'model.mesh_shape=[[1,1],["fsdp","tp"]]'
FSDP_TP = 'model.mesh_shape=[[4,2],["fsdp","tp"]]'
ALL_MESHES = {"1": ("1 device", ONE_DEVICE, ONE_DEVICE, 1, 1),
              "fsdp4xtp2": ("fsdp 4 x tp 2", FSDP_TP, FSDP_TP, 8, 4),
              "fsdp2xep4": ("fsdp 2 x ep 4", 'model.mesh_shape=[[2,4,1],["fsdp","ep","tp"]]',
                            'model.mesh_shape=[[8,1],["fsdp","tp"]]', 8, 8)}
MESHES = {name: ALL_MESHES.get(name) for name in
          os.environ.get("MOE_MESHES", ",".join(ALL_MESHES)).split(",")}
# The MoE runs timed against the dense one: the default (blocks), the blocks with routing forced
# balanced, the tiles, ragged_dot, and on an ep mesh the exchange's blocks bounded at twice a
# shard's mean share (dropless blocks: the worst case).
ALL_VARIANTS = {"blocks": [], "balanced": ["model.moe_force_load_balance=true"],
                "tiles": ["model.moe_matmul=tiles"],
                "ragged_dot": ["model.moe_matmul=ragged_dot"]}
VARIANTS = {name: ALL_VARIANTS.get(name) for name in
            os.environ.get("MOE_VARIANTS", ",".join(ALL_VARIANTS)).split(",")}
EP_VARIANTS = {"blocks_2x": ["model.moe_ep_buffer_factor=2"]}


def _check_knobs() -> None:
    """Bad knobs are one sentence and exit 2, before anything compiles."""
    unknown = [name for name, extra in VARIANTS.items() if extra is None]
    if unknown:
        _refuse(f"error: MOE_VARIANTS names {', '.join(unknown)}; give a comma-separated list "
                f"of {', '.join(ALL_VARIANTS)}.")
    unknown = [name for name, mesh in MESHES.items() if mesh is None]
    if unknown:
        _refuse(f"error: MOE_MESHES names {', '.join(unknown)}; give a comma-separated list "
                f"of {', '.join(ALL_MESHES)}.")
    ranks = max(mesh[4] for mesh in MESHES.values())
    if SEQUENCES < 1 or SEQUENCES % ranks:
        _refuse(f"error: MOE_SEQUENCES={SEQUENCES} is not a positive multiple of {ranks} (the "
                f"data-parallel ranks of MOE_MESHES={','.join(MESHES)}, each taking whole "
                f"sequences); give {ranks}, {2 * ranks}, {4 * ranks}, ...")
    if EXPERTS < TOP_K:
        _refuse(f"error: MOE_EXPERTS={EXPERTS} is fewer than the {TOP_K} experts each token "
                f"goes to; give {TOP_K} or more.")
    if "fsdp2xep4" in MESHES and EXPERTS % 4:
        _refuse(f"error: MOE_EXPERTS={EXPERTS} does not split over ep 4 (MOE_MESHES names "
                "fsdp2xep4); give a multiple of 4, or leave fsdp2xep4 out of MOE_MESHES.")
    if EMBED_DIM % 128:
        _refuse(f"error: MOE_EMBED_DIM={EMBED_DIM} is not a multiple of 128 (heads of 64, half "
                "as many key-value heads); give 256, 384, 512, ...")


def _refuse(sentence: str) -> None:
    print(sentence, file=sys.stderr)
    sys.exit(2)


def main(overrides: list[str]) -> dict:
    _check_knobs()
    rows = []
    for name, mesh, dense_mesh, devices, ranks in MESHES.values():
        micro = [f"training.micro_batch_size={SEQUENCES // ranks}"]
        variants = {**VARIANTS, **(EP_VARIANTS if '"ep"' in mesh else {})}
        runs = {"dense": train_stepper([*DENSE, *SHARED, *overrides, dense_mesh, *micro],
                                       devices)[1]}
        for variant, extra in variants.items():
            runs[variant] = train_stepper([*MOE, *SHARED, *overrides, mesh, *micro, *extra],
                                          devices)[1]
        median = alternating_medians(runs, WARMUP, ROUNDS, STEPS_PER_ROUND)
        row = {"mesh": name, **{f"{run}_ms": round(median[run] * 1e3, 1) for run in runs},
               **{f"ratio_{v}": round(median[v] / median["dense"], 3) for v in variants}}
        rows.append(row)
        print(f"{name}: dense {row['dense_ms']} ms, " + ", ".join(
            f"MoE {v} {row[f'{v}_ms']} ms (ratio {row[f'ratio_{v}']})" for v in variants))
    result = {"rows": rows, "experts": EXPERTS, "top_k": TOP_K, "expert_width": EXPERT_WIDTH,
              "embed_dim": EMBED_DIM, "sequences": SEQUENCES, "seq_len": SEQ_LEN,
              "device_kind": jax.devices()[0].device_kind}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
