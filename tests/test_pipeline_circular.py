"""The circular pipeline schedule (`training.pipeline_repeats`, parallel/pipeline.py) on 8 CPU
devices, against the same run without pp: losses (micro-batches parked at stage 0 between
rounds or not, four stages with a left-over block), the stacks stored whole over pp, the
planner's bubble and permutes, checkpoints across schedules, and the settings it refuses."""

import jax
import numpy as np
import pytest

from helpers import (PP_MESHES, TINY, assert_restores_onto, compiled_run, compose_config,
                     mesh_arg, mesh_of, train_losses)
from tunix_train.config import ConfigError
from tunix_train.models import families
from tunix_train.parallel import stages
from tunix_train.training.setup import Setup

STEPS = 3
# 4 blocks of [local, global] and one trailing local: 2 stages of 2 chunks of 1 block.
# 8 rows per micro-step, 2 micro-steps accumulated.
MODEL = [*TINY, "model.num_layers=9", "model.global_every=2", "training.global_batch_size=16",
         "training.gradient_accumulation_steps=2", "training.pipeline_repeats=2"]
NO_PP = [setting for setting in MODEL if not setting.startswith("training.pipeline_repeats")]


@pytest.fixture(scope="module")
def runs():
    """name → (setup, costs, losses, final state). "2x2x2": 4 rows per fsdp shard cut into
    M=4 > pp micro-batches, so each waits at stage 0 before its second round; "2x4x1": 2 rows,
    M = pp = 2, so none waits. "none": fsdp 2 × tp 2 without pp, on 4 devices."""
    out = {"none": compiled_run(compose_config(*NO_PP, mesh_arg(2, 2)), STEPS, jax.devices()[:4])}
    out["2x2x2"] = compiled_run(compose_config(*MODEL, mesh_of(PP_MESHES["2x2x2"]),
                                               "training.pipeline_microbatches=4"), STEPS)
    out["2x4x1"] = compiled_run(compose_config(*MODEL, mesh_of(PP_MESHES["2x4x1"])), STEPS)
    return out


@pytest.mark.parametrize("name", ["2x2x2", "2x4x1"])
def test_circular_losses_equal_the_run_without_pp(runs, name):
    reference = runs["none"][2]
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(runs[name][2], reference, rtol=1e-5)
    plan = runs[name][0].options.pipeline
    assert (plan.repeats, plan.microbatches) == {"2x2x2": (2, 4), "2x4x1": (2, 2)}[name]


def test_four_stages_round_the_ring_with_a_left_over_block():
    """9 blocks on 4 stages of 2 chunks: chunks of 1 block and one block after the stages;
    8 rows per fsdp shard: M = 8 (the fewest keeping 3/(2·M+3) ≤ 25% that divide 8)."""
    model = [*TINY, "model.num_layers=19", "model.global_every=2",
             "training.global_batch_size=16", "training.gradient_accumulation_steps=2"]
    without = train_losses(compose_config(*model, mesh_arg(1, 2)), STEPS, jax.devices()[:2])[0]
    cfg = compose_config(*model, "training.pipeline_repeats=2", mesh_of(PP_MESHES["4x1x2"]))
    split = stages.Stages.of(families.stacking(cfg.model), 4, 2)
    assert (split.chunk, split.per_stage, split.leftover) == (1, 2, 1)
    assert Setup.create(cfg).options.pipeline.microbatches == 8
    np.testing.assert_allclose(train_losses(cfg, STEPS)[0], without, rtol=1e-5)


def test_the_stacks_are_stored_whole_over_pp_in_the_models_order(runs):
    """A stage's chunks are not consecutive rows: the stacks keep the model's layer order and
    ZeRO-3 splits them over fsdp × pp (per-device bytes still halve from the run without pp);
    each stage's row order puts its chunks together, in the order it runs them."""
    setup, costs, _, state = runs["2x2x2"]
    for stack in ("local_layers", "global_layers"):
        for leaf in jax.tree.leaves(state["params"][stack]):
            spec = tuple(leaf.sharding.spec)
            assert spec[0] is None and "pp" not in spec
    abstract, shardings = setup.params.abstract, setup.params.shardings
    whole = sum(np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
                if not {"fsdp", "pp"} & set(jax.tree.leaves(tuple(s.spec))))
    without = runs["none"][1].per_device_bytes["params"]
    assert costs.per_device_bytes["params"] - whole == pytest.approx((without - whole) / 2, abs=64)
    split = stages.Stages.of(families.stacking(setup.cfg.model), 2, 2)
    # Blocks 0 and 2 on stage 0, 1 and 3 on stage 1; the local stack has one row per block.
    assert split.row_order("global_layers").tolist() == [0, 2, 1, 3]
    # 5 blocks of [2 locals, global], 1 left over:
    three = stages.Stages.of(families.stacking(compose_config("model.num_layers=15",
                                                            "model.global_every=3").model), 2, 2)
    assert three.row_order("local_layers").tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9]


def test_the_planner_shows_the_shorter_bubble_and_the_ring(runs):
    setup, costs, _, _ = runs["2x2x2"]
    plan = setup.options.pipeline
    assert plan.iterations == 2 * 4 + 1 and plan.bubble == pytest.approx(1 / 9)
    permutes = [c for c in costs.comm.collectives if c.kind == "collective-permute"]
    assert {c.axis for c in permutes} == {"pp"}
    # One permute per iteration (the ring, closing edge included), forward and backward, per
    # micro-step.
    assert sum(c.count for c in permutes) == 2 * plan.iterations * 2
    assert costs.comm.gradient_reductions_per_step == pytest.approx(2, rel=0.02)
    record = stages.describe(plan, setup.cfg.model, 4)
    assert (record["layers_per_stage"], record["layers_per_chunk"]) == (4, 2)
    assert "in 2 chunks of 2, circular" in stages.line(record)
    assert "bubble (pp-1)/(2·M+pp-1) = 11.1%" in stages.line(record)


@pytest.mark.parametrize("source,target", [("2x2x2", "none"), ("none", "2x4x1")])
def test_a_checkpoint_restores_across_circular_and_no_pp(runs, tmp_path, source, target):
    assert_restores_onto(runs[source], runs[target][0], tmp_path)


def test_the_default_microbatches_and_what_the_schedule_refuses():
    for pp, rows, repeats in ((2, 4, 2), (2, 12, 3), (4, 8, 2), (4, 64, 4)):
        plan = stages.schedule(pp, rows, None, repeats)
        assert plan.microbatches >= pp and rows % plan.microbatches == 0
        assert plan.bubble == pytest.approx((pp - 1) / (repeats * plan.microbatches + pp - 1))
        assert plan.bubble <= stages.MAX_BUBBLE
    with pytest.raises(ConfigError, match="training.pipeline_microbatches=2 is fewer than pp=4"):
        stages.schedule(4, 8, 2, repeats=2)
    with pytest.raises(ConfigError, match="takes 2 row.* raise training.micro_batch_size to 4"):
        stages.schedule(4, 2, None, repeats=2)
    with pytest.raises(ConfigError, match="training.pipeline_repeats=3 cuts the 4 block.* at "
                                          "most 2"):
        Setup.create(compose_config(*NO_PP, "training.pipeline_repeats=3",
                                    mesh_of(PP_MESHES["2x2x2"])))
    with pytest.raises(ConfigError, match="training.pipeline_repeats=2 needs pipeline stages"):
        Setup.create(compose_config(*MODEL, mesh_arg(4, 2)))
