"""FSDP that really shards: gradients reduced layer by layer inside the backward pass, a sharded
accumulator, the reductions' kind, place and dtype in the compiled program, and the losses of
every ZeRO stage with accumulation against the single-device full-batch run."""

import re

import jax
import numpy as np
import pytest

from helpers import (ONE_STACK, TINY, compiled_run, compose_config, family_tiny, mesh_arg,
                     train_losses)
from tunix_train.parallel import collectives, fsdp
from tunix_train.analysis import hlo

# A model whose gradient dominates memory: wide MLPs, 13 layers, 4 tokens per sequence.
GRADIENT_HEAVY = [*TINY, "model.hidden_dim=2048", "model.num_layers=13", "data.seq_len=4",
                  mesh_arg(8, 1), "training.micro_batch_size=1", "training.zero_stage=3"]


def _whole_unreduced_gradient(setup) -> int:
    plan = setup.options.sync
    return fsdp.local_gradient_bytes(plan, setup.params.abstract,
                                          setup.options.compute_dtype)


@pytest.fixture(scope="module")
def heavy():
    """accumulation → (setup, analysis) of the compiled ZeRO-3 step."""
    runs = {}
    for accum in (1, 4):
        cfg = compose_config(*GRADIENT_HEAVY, f"training.gradient_accumulation_steps={accum}")
        setup, analysis, _, _ = compiled_run(cfg, steps=0)
        runs[accum] = (setup, analysis)
    return runs


def test_no_whole_unreduced_gradient_is_ever_held(heavy):
    setup, analysis = heavy[1]
    assert analysis.xla_memory["temp"] < _whole_unreduced_gradient(setup)
    assert analysis.per_device_bytes["grad_buffer"] == 0


def test_accumulation_adds_only_the_sharded_accumulator(heavy):
    grown = heavy[4][1].xla_memory["temp"] - heavy[1][1].xla_memory["temp"]
    sharded_fp32_gradient = heavy[1][1].per_device_bytes["grads"]
    assert grown <= 1.2 * sharded_fp32_gradient


def _loop_computations(module: hlo.Module) -> set[str]:
    """Every computation a while loop's body runs, directly or through calls and fusions."""
    bodies = {re.search(r"body=%([\w.\-]+)", i.attrs).group(1)
              for instructions in module.computations.values() for i in instructions
              if i.opcode == "while"}
    inside, frontier = set(), set(bodies)
    while frontier:
        name = frontier.pop()
        inside.add(name)
        for inst in module.computations.get(name, ()):
            frontier |= set(re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)",
                                       inst.attrs)) - inside
    return inside


def _sync_reduce_scatters(module: hlo.Module):
    for name, instructions in module.computations.items():
        for inst in instructions:
            if inst.opcode.startswith("reduce-scatter") and \
                    collectives.SYNC_SCOPE in inst.attrs:
                yield name, inst


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_reduce_scatters_sit_inside_the_layer_loop(stage):
    # Loops of two trips or more everywhere (XLA unrolls a single trip): two [local, global]
    # blocks of layers, and the vocabulary in two chunks.
    cfg = compose_config(*TINY, "model.num_layers=4", "model.global_every=2",
                         "training.loss_vocab_chunk=256", mesh_arg(8, 1),
                         "training.micro_batch_size=1", f"training.zero_stage={stage}",
                         "training.mixed_precision=bf16")
    setup, analysis, _, _ = compiled_run(cfg, steps=0)
    module = analysis.module
    in_loops = _loop_computations(module)
    found = list(_sync_reduce_scatters(module))
    assert found and all(name in in_loops for name, _ in found)
    rows = [c for c in analysis.comm.collectives
            if c.kind == "reduce-scatter" and c.phase == "gradient sync"]
    assert {c.dtype for c in rows} == {"bf16"}
    # One reduce-scatter per layer and weight, not one per stacked tree leaf.
    assert sum(c.count for c in rows) >= cfg.model.num_layers * 7
    assert analysis.comm.gradient_reductions_per_step == 1


@pytest.mark.parametrize("accum,sync,reductions", [(4, 1, 4), (4, 2, 2), (4, 4, 1)])
def test_reductions_per_step_follow_sync_gradients_every(accum, sync, reductions):
    cfg = compose_config(*ONE_STACK, mesh_arg(8, 1), "training.micro_batch_size=1",
                         f"training.gradient_accumulation_steps={accum}",
                         f"training.sync_gradients_every={sync}")
    _, analysis, _, _ = compiled_run(cfg, steps=0)
    assert analysis.comm.gradient_reductions_per_step == reductions
    assert (analysis.per_device_bytes["grad_buffer"] > 0) == (sync > 1)


def test_grad_reduce_dtype_fp32_reduces_in_fp32_under_bf16_compute():
    cfg = compose_config(*ONE_STACK, mesh_arg(8, 1), "training.micro_batch_size=1",
                         "training.mixed_precision=bf16", "training.grad_reduce_dtype=fp32")
    _, analysis, _, _ = compiled_run(cfg, steps=0)
    reductions = {c.dtype for c in analysis.comm.collectives if c.phase == "gradient sync"
                  and c.kind in ("reduce-scatter", "all-reduce") and c.axis == "fsdp"}
    gathers = {c.dtype for c in analysis.comm.collectives
               if c.kind == "all-gather" and c.phase == "forward" and c.dtype != "s32"}
    assert reductions == {"f32"} and gathers == {"bf16"}


# Losses: the single-device full batch against stages, meshes, accumulation and sync.
STEPS = 4
GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def full_batch_losses():
    cfg = compose_config(*ONE_STACK, mesh_arg(1, 1), f"training.micro_batch_size={GLOBAL_BATCH}")
    return train_losses(cfg, STEPS, jax.devices()[:1])[0]


@pytest.mark.parametrize("fsdp,tp,stage,accum,sync", [
    (8, 1, 0, 2, 1), (8, 1, 3, 2, 2), (2, 4, 1, 2, 1), (2, 4, 2, 4, 2), (2, 4, 3, 4, 1),
])
def test_every_stage_with_accumulation_gives_the_full_batch_losses(
        full_batch_losses, fsdp, tp, stage, accum, sync):
    micro = GLOBAL_BATCH // (fsdp * accum)
    cfg = compose_config(*ONE_STACK, mesh_arg(fsdp, tp), f"training.micro_batch_size={micro}",
                         f"training.zero_stage={stage}",
                         f"training.gradient_accumulation_steps={accum}",
                         f"training.sync_gradients_every={sync}")
    losses, state = train_losses(cfg, STEPS, jax.devices()[: fsdp * tp])
    np.testing.assert_allclose(losses, full_batch_losses, rtol=1e-5)
    sharded = [x for x in jax.tree.leaves(state["params"]) if "fsdp" in x.sharding.spec]
    assert bool(sharded) == (stage == 3)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_one_device_compiles_no_parameter_gathers_or_reductions(family):
    """fsdp = 1 leaves out FSDP's collectives over its group of one device: XLA's CPU compiler
    kept them as copies laid out along their axis, and a mixture's tiles then read every expert
    weight through a transposed view (docs/performance.md); the embedding's ids and rows are
    not exchanged either. The same model on fsdp 2 has them, so this reads the program, not a
    report that leaves them out."""
    def collectives(fsdp_ways: int) -> list[str]:
        cfg = compose_config(*family_tiny(family, mesh_arg(fsdp_ways, 1),
                                          "training.micro_batch_size=1"))
        _, analysis, _, _ = compiled_run(cfg, steps=0, devices=jax.devices()[:fsdp_ways])
        kinds = (inst.opcode.removesuffix("-start") for inst, _, _ in
                 analysis.module.instructions() if re.search(r"\[\d", inst.shape))
        # (not the loss's and metrics' scalar sums)
        return [k for k in kinds if k in ("all-gather", "reduce-scatter", "all-reduce")]

    assert collectives(1) == []
    assert {"all-gather", "reduce-scatter"} <= set(collectives(2))
