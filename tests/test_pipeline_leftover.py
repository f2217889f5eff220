"""Pipeline stages on a model whose blocks do not divide into them (parallel/stages.py's
`Stages`): the leftover blocks run after the stages, the block stacks are stored whole over pp
and split over fsdp × pp by ZeRO. Against the same run without pp: losses at ZeRO 1-3,
storage and per-device bytes, checkpoints across meshes."""

import jax
import numpy as np
import pytest

from helpers import (PP_MESHES, TINY, assert_restores_onto, compiled_run, compose_config,
                     mesh_arg, mesh_of, train_losses)
from tunix_train.models import families
from tunix_train.parallel import stages

STEPS = 3
# 5 blocks and a trailing local: at pp 2, stages of 2 blocks and one left over; at pp 4, of 1.
UNEVEN = [*TINY, "model.num_layers=11", "model.global_every=2", "training.global_batch_size=16",
          "training.gradient_accumulation_steps=2"]


@pytest.fixture(scope="module")
def uneven():
    """Like `runs`, on a model whose blocks do not divide into the stages."""
    out = {"none": compiled_run(compose_config(*UNEVEN, mesh_arg(2, 2)), STEPS, jax.devices()[:4])}
    for name in ("2x2x2", "4x1x2"):
        out[name] = compiled_run(compose_config(*UNEVEN, mesh_of(PP_MESHES[name])), STEPS)
    return out


@pytest.mark.parametrize("name", ["2x2x2", "4x1x2"])
def test_blocks_left_over_after_the_stages_give_the_losses_without_pp(uneven, name):
    reference = uneven["none"][2]
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(uneven[name][2], reference, rtol=1e-5)
    split = stages.Stages.of(families.stacking(uneven[name][0].cfg.model), int(name[0]))
    assert (split.per_stage, split.leftover) == {"2x2x2": (2, 1), "4x1x2": (1, 1)}[name]


@pytest.mark.parametrize("settings", [["training.zero_stage=1", "training.sync_gradients_every=2"],
                                      ["training.zero_stage=2"]])
def test_left_over_blocks_at_other_zero_stages(settings):
    without = train_losses(compose_config(*UNEVEN, *settings, mesh_arg(4, 1)), 3,
                           jax.devices()[:4])[0]
    with_pp = train_losses(compose_config(*UNEVEN, *settings, mesh_of(PP_MESHES["2x4x1"])), 3)[0]
    np.testing.assert_allclose(with_pp, without, rtol=1e-5)


def test_left_over_blocks_keep_the_stacks_whole_over_pp_and_zero_splits_them(uneven):
    """The stacks cannot be split by rows into 2 stages (5 blocks): stored whole over pp, and
    ZeRO-3 splits them over fsdp × pp; per-device bytes still halve from the run without pp."""
    setup, costs, _, state = uneven["2x2x2"]
    for stack in ("local_layers", "global_layers"):
        for leaf in jax.tree.leaves(state["params"][stack]):
            spec = tuple(leaf.sharding.spec)
            assert spec[0] is None and "pp" not in spec
            if leaf.ndim > 2:  # not a norm's scale
                dim = spec.index(("fsdp", "pp"))
                assert len({s.index[dim].start for s in leaf.addressable_shards}) == 4
    abstract, shardings = setup.params.abstract, setup.params.shardings
    whole = sum(np.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
                for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings))
                if not {"fsdp", "pp"} & set(jax.tree.leaves(tuple(s.spec))))
    without = uneven["none"][1].per_device_bytes["params"]
    # The block stacks' norm scales are whole on every device too: at pp=1 as well.
    assert costs.per_device_bytes["params"] - whole == pytest.approx((without - whole) / 2, abs=64)
    assert costs.comm.gradient_reductions_per_step == pytest.approx(2, rel=0.02)  # 2 micro-steps


@pytest.mark.parametrize("source,target", [("2x2x2", "none"), ("none", "4x1x2")])
def test_left_over_blocks_restore_across_pp_and_no_pp(uneven, tmp_path, source, target):
    assert_restores_onto(uneven[source], uneven[target][0], tmp_path)
