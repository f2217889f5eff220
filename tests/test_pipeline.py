"""Pipeline parallelism (parallel/pipeline.py) on 8 CPU devices, against the same run without pp:
losses, parameters really split over the stages, the planner's figures, checkpoints across
pp / no-pp meshes, and what a layer count that does not split gives."""

import jax
import numpy as np
import pytest

from helpers import (PP_MESHES, TINY, assert_restores_onto, compiled_run, compose_config,
                     mesh_arg, mesh_of, train_losses)
from tunix_train import validation
from tunix_train.config import ConfigError
from tunix_train.models import families
from tunix_train.parallel import stages
from tunix_train.training.setup import Setup

STEPS = 3
# 4 blocks of [local, global] and one trailing local: stages of 2 or 1 blocks, and a layer that
# runs outside the stages. 8 rows per micro-step, 2 micro-steps accumulated.
MODEL = [*TINY, "model.num_layers=9", "model.global_every=2", "training.global_batch_size=16",
         "training.gradient_accumulation_steps=2"]


@pytest.fixture(scope="module")
def runs():
    """name → (setup, costs, losses, final state); "none": the same run on fsdp 2 × tp 2 (the
    2x2x2 mesh's fsdp × tp) over 4 devices."""
    out = {"none": compiled_run(compose_config(*MODEL, mesh_arg(2, 2)), STEPS, jax.devices()[:4])}
    for name, shape in PP_MESHES.items():
        out[name] = compiled_run(compose_config(*MODEL, mesh_of(shape)), STEPS)
    return out


@pytest.mark.parametrize("name", list(PP_MESHES))
def test_losses_equal_the_run_without_pp(runs, name):
    reference = runs["none"][2]
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(runs[name][2], reference, rtol=1e-5)


@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-5), ("bf16", 1e-2)])
def test_zero_1_and_spaced_out_reductions_match_the_run_without_pp(precision, rtol):
    """Other settings through the same pipeline: ZeRO-1 and one gradient reduction per two
    accumulated micro-steps, in fp32 (exact) and with bf16 compute (to bf16's precision)."""
    settings = [*MODEL, "training.zero_stage=1", f"training.mixed_precision={precision}",
                "training.sync_gradients_every=2"]
    without = train_losses(compose_config(*settings, mesh_arg(4, 1)), 5, jax.devices()[:4])[0]
    with_pp = train_losses(compose_config(*settings, mesh_of(PP_MESHES["2x4x1"])), 5)[0]
    assert np.isfinite(with_pp).all() and without[-1] < without[0]
    np.testing.assert_allclose(with_pp, without, rtol=rtol)


def test_each_stage_holds_its_own_blocks_only(runs):
    setup, _, _, state = runs["2x2x2"]
    blocks = families.stacking(setup.cfg.model).num_blocks
    for stack in ("local_layers", "global_layers"):
        for leaf in jax.tree.leaves(state["params"][stack]):
            assert leaf.sharding.spec[0] == "pp"
            assert {s.data.shape[0] for s in leaf.addressable_shards} == {blocks // 2}
            starts = {s.device: s.index[0].start for s in leaf.addressable_shards}
            assert sorted(set(starts.values())) == [0, blocks // 2]
    # What every stage runs (embedding, trailing layers) is split over fsdp and pp together
    # along the dimension fsdp splits (ZeRO-3 over the 4 devices holding a copy), not by layer.
    for key in ("trailing_layers", "embedder"):
        for leaf in jax.tree.leaves(state["params"][key]):
            spec = tuple(leaf.sharding.spec)
            assert "pp" not in spec
            if leaf.ndim > 1 + (key == "trailing_layers"):  # not a norm's scale
                dim = spec.index(("fsdp", "pp"))
                assert len({s.index[dim].start for s in leaf.addressable_shards}) == 4


def test_the_planner_shows_the_stage_memory_bubble_and_permutes(runs):
    """Per-device parameter and optimizer bytes halve at pp=2 for the same fsdp × tp (ZeRO-3):
    the block stacks are split into stages, the rest over fsdp × pp; only the norms' scales
    outside the stages (replicated over fsdp anyway, <1% of the bytes) stay whole."""
    with_pp, without = runs["2x2x2"], runs["none"]
    abstract, shardings = with_pp[0].params.abstract, with_pp[0].params.shardings
    replicated = sum(np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize  # on every device
                     for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
                     if not {"fsdp", "pp"} & set(jax.tree.leaves(tuple(s.spec))))
    for kind, copies in (("params", 1), ("optimizer", 2)):  # Adam: two moments per parameter
        bytes_ = {name: run[1].per_device_bytes[kind] for name, run in runs.items()}
        whole = copies * replicated
        assert bytes_["2x2x2"] - whole == pytest.approx((bytes_["none"] - whole) / 2, abs=64)
    assert 0 < replicated < 0.01 * without[1].per_device_bytes["params"]
    plan = with_pp[0].options.pipeline
    assert (plan.stages, plan.microbatches) == (2, 4)  # 4 rows per fsdp shard: M=4, bubble 20%
    assert plan.bubble == pytest.approx(1 / 5)
    permutes = [c for c in with_pp[1].comm.collectives if c.kind == "collective-permute"]
    assert {c.axis for c in permutes} == {"pp"}
    # One permute per pipeline iteration, forward and (transposed) backward, per micro-step.
    assert sum(c.count for c in permutes) == 2 * plan.iterations * 2
    record = stages.describe(plan, with_pp[0].cfg.model, 4)
    assert (record["layers_per_stage"], record["layers_outside_stages"]) == (4, 1)
    assert "bubble (pp-1)/(M+pp-1) = 20.0%" in stages.line(record)


@pytest.mark.parametrize("source,target", [("2x2x2", "none"), ("none", "4x1x2")])
def test_a_checkpoint_restores_across_pp_and_no_pp(runs, tmp_path, source, target):
    assert_restores_onto(runs[source], runs[target][0], tmp_path)


def test_stages_of_whole_blocks_and_what_a_layer_count_gives():
    four_b = compose_config("model=gemma3_4b").model  # 34 layers: 5 blocks of 6, 4 trailing
    for pp, (per_stage, after) in {2: (12, 10), 4: (6, 10), 5: (6, 4)}.items():
        stages.check_layers(four_b, pp)
        record = stages.describe(stages.Schedule(pp, 8), four_b, 8)
        assert (record["layers_per_stage"], record["layers_outside_stages"]) == (per_stage, after)
    with pytest.raises(ConfigError, match=r"model.num_layers=34 has 5 block\(s\) of 6 layer\(s\), "
                                          r"too few for pp=8 .* at most 5"):
        stages.check_layers(four_b, 8)
    with pytest.raises(ConfigError, match="pp=2 .*; use no pp axis"):  # 7 layers: one block
        Setup.create(compose_config(*TINY, mesh_of([[2, 4, 1], ["pp", "fsdp", "tp"]])))


def test_pipeline_microbatches_default_keeps_the_bubble_at_a_quarter():
    for pp, rows in ((2, 4), (2, 12), (4, 12), (4, 64), (8, 64)):
        plan = stages.schedule(pp, rows, None)
        assert rows % plan.microbatches == 0 and plan.bubble <= stages.MAX_BUBBLE
        smaller = [m for m in range(1, plan.microbatches) if rows % m == 0]
        assert all((pp - 1) / (m + pp - 1) > stages.MAX_BUBBLE for m in smaller)
    assert stages.schedule(4, 2, None).microbatches == 2  # too few rows: all of them
    assert stages.schedule(2, 8, 2).bubble == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match="training.pipeline_microbatches=3 must divide the 8"):
        stages.schedule(2, 8, 3)


def test_grpo_with_pipeline_stages_is_refused_by_name():
    cfg = compose_config("trainer=grpo", "data=prompts", "data.path=x.jsonl",
                         mesh_of([[2, 4, 1], ["pp", "fsdp", "tp"]]))
    with pytest.raises(ConfigError, match="pipeline stages, which trainer=grpo does not"):
        validation.validate(cfg)
