"""ZeRO stages 0-3 on an 8-way fsdp mesh: same losses, the ZeRO paper's memory accounting, and
the collectives each stage is defined by, read off the compiled step."""

import json

import numpy as np
import pytest

from helpers import TINY, compiled_run, compose_config, mesh_arg
from tunix_train import plan

STEPS = 5
N = 8  # fsdp
# A wider MLP than TINY's, so that the few replicated norm scales stay below 5% of a shard.
# Two blocks of (local, global) layers: loops of two trips, a quicker compile than TINY's three.
MODEL = [*TINY, "model.hidden_dim=512", "model.num_layers=4", "model.global_every=2",
         mesh_arg(N, 1), "training.micro_batch_size=1"]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """stage → (plan.json as written by the planner, analysis, losses, final state)."""
    runs = {}
    for stage in range(4):
        cfg = compose_config(*MODEL, f"training.zero_stage={stage}")
        setup, analysis, losses, state = compiled_run(cfg, STEPS)
        run_dir = tmp_path_factory.mktemp(f"stage{stage}")
        plan.write(run_dir, setup, analysis)
        runs[stage] = (json.loads((run_dir / "plan.json").read_text()), analysis, losses, state)
    return runs


def test_every_zero_stage_gives_the_same_losses(stages):
    reference = stages[0][2]
    assert reference[-1] < reference[0]
    for stage in (1, 2, 3):
        np.testing.assert_allclose(stages[stage][2], reference, rtol=1e-5)


def test_model_state_bytes_follow_the_zero_paper(stages):
    """fp32 parameters 4Ψ, gradients 4Ψ, Adam moments 8Ψ; each sharded over N from its stage."""
    psi = stages[0][0]["num_params"]
    expected = {0: 16 * psi, 1: 8 * psi + 8 * psi / N, 2: 4 * psi + 12 * psi / N,
                3: 16 * psi / N}
    for stage, bytes_ in expected.items():
        per_device = stages[stage][0]["per_device_bytes"]
        model_state = per_device["params"] + per_device["grads"] + per_device["optimizer"]
        assert model_state == pytest.approx(bytes_, rel=0.05), stage
        assert stages[stage][0]["zero_stage"] == stage
        assert stages[stage][0]["mesh"] == {"fsdp": N, "tp": 1}


def _float_rows(analysis, **match):
    return [c for c in analysis.comm.collectives if c.dtype in ("f32", "bf16")
            and all(getattr(c, k) == v for k, v in match.items())]


def test_each_stage_communicates_what_it_is_defined_by(stages):
    for stage in range(4):
        analysis = stages[stage][1]
        param_gathers = _float_rows(analysis, kind="all-gather", phase="forward")
        updated_gathers = _float_rows(analysis, kind="all-gather", phase="update")
        _, synced = analysis.comm.total(phase="gradient sync")
        _, scattered = analysis.comm.total(kind="reduce-scatter", phase="gradient sync")
        assert analysis.comm.gradient_reductions_per_step == 1
        assert all(c.axis == "fsdp" for c in analysis.comm.collectives)  # nothing on tp
        if stage <= 1:  # gradients all-reduced: every device keeps all of them
            assert scattered == 0 and synced > 0
        else:  # reduce-scattered (norm scales, replicated, are still all-reduced)
            assert scattered >= 0.95 * synced
        if stage == 0:  # DDP: nothing sharded, nothing gathered
            assert not param_gathers and not updated_gathers
        if stage in (1, 2):  # sharded update, then the new parameters all-gathered
            assert updated_gathers and not param_gathers
        if stage == 3:  # FSDP: gathered before use, forward and backward
            assert param_gathers and _float_rows(analysis, kind="all-gather", phase="backward")


def test_bf16_gradient_reductions_carry_half_the_bytes(stages):
    cfg = compose_config(*MODEL, "training.zero_stage=3", "training.mixed_precision=bf16")
    _, bf16, _, _ = compiled_run(cfg, steps=0)
    _, fp32_bytes = stages[3][1].comm.total(phase="gradient sync")
    _, bf16_bytes = bf16.comm.total(phase="gradient sync")
    assert {c.dtype for c in bf16.comm.collectives if c.phase == "gradient sync"} == {"bf16"}
    assert bf16_bytes == pytest.approx(fp32_bytes / 2, rel=1e-3)


def test_planner_parameter_bytes_equal_a_real_allocation(stages):
    from tunix_train.training import state as state_lib

    for stage in (0, 3):
        _, per_device = state_lib.param_bytes(stages[stage][3]["params"])
        assert stages[stage][0]["per_device_bytes"]["params"] == per_device
