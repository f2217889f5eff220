"""`training.offload_optimizer`: Adam's moments in pinned host memory (this CPU backend has it
too), against the same run with them on the device."""

import types
from dataclasses import replace

import jax
import numpy as np
import pytest

from helpers import ONE_STACK, compiled_run, compose_config, mesh_arg
from tunix_train import checkpoint
from tunix_train import config as config_lib
from tunix_train.checkpoint import Checkpoints
from tunix_train.config import CheckpointConfig, ConfigError
from tunix_train.training import setup as setup_lib
from tunix_train.training.setup import Setup

STEPS = 3
RUN = [*ONE_STACK, mesh_arg(4, 2), "training.zero_stage=3"]


@pytest.fixture(scope="module")
def runs():
    """offload → (setup, costs, losses, final state), from the compiled step a run uses."""
    return {offload: compiled_run(compose_config(*RUN, f"training.offload_optimizer={offload}"),
                                  STEPS) for offload in (False, True)}


def _memory_kinds(tree) -> set[str]:
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def test_losses_equal_the_run_without_offload(runs):
    np.testing.assert_allclose(runs[True][2], runs[False][2], rtol=1e-6)
    assert runs[False][2][-1] < runs[False][2][0]


def test_the_moments_live_in_host_memory_and_the_rest_on_the_device(runs):
    setup, _, _, state = runs[True]
    mu = state["opt_state"].inner_state[1][0].mu  # (clip, adamw) → adamw's scale_by_adam
    assert _memory_kinds(mu) == {"pinned_host"}
    assert _memory_kinds(state["params"]) == {"device"}
    assert _memory_kinds(state["opt_state"].notfinite_count) == {"device"}
    assert _memory_kinds(runs[False][3]["opt_state"]) == {"device"}


def test_xla_places_the_optimizer_bytes_in_host_memory(runs):
    """The compiled program's own layout: what moved to host memory is the whole optimizer
    state but its scalar counters, and the device holds that much less."""
    on, off = runs[True][1], runs[False][1]
    moments = on.per_device_bytes["optimizer_host"]
    assert 0 < off.per_device_bytes["optimizer"] - moments <= 32  # the scalar counters
    assert on.per_device_bytes["host"] == moments
    assert on.xla_memory["host_arguments"] == moments
    assert off.per_device_bytes["host"] == 0 and off.per_device_bytes["optimizer_host"] == 0
    assert on.xla_memory["arguments"] == pytest.approx(off.xla_memory["arguments"] - moments, abs=32)
    assert "pinned host memory" in "\n".join(on.memory_lines())


def test_the_planners_verdict_covers_host_memory(runs):
    """The planner's verdict (and so its exit code) holds the host bytes against
    plan.host_memory_gb where the step keeps anything there, and names host memory when only
    that does not fit; a step with nothing on the host is never refused for it."""
    from tunix_train import plan

    setup, costs = runs[True][:2]
    host = costs.per_device_bytes["host"]
    roomy = plan._record(setup, costs, 0.0)
    assert roomy["fits"] and f"; host {host / plan.GB:.2f} GB of 128 GB per device" in \
        plan._verdict(roomy)
    limit = host / plan.GB / 2
    tight = plan._record(replace(setup, cfg=compose_config(
        *RUN, "training.offload_optimizer=true", f"plan.host_memory_gb={limit}")), costs, 0.0)
    assert (tight["fits"], tight["fits_device"], tight["fits_host"]) == (False, True, False)
    assert plan._verdict(tight).startswith(
        f"does NOT fit in host memory: {host / plan.GB:.2f} GB > {limit:g} GB per device")
    device_only = runs[False][0]
    nothing = plan._record(replace(device_only, cfg=compose_config(
        *RUN, f"plan.host_memory_gb={limit}")), runs[False][1], 0.0)
    assert nothing["fits"] and "host" not in plan._verdict(nothing)


def test_a_checkpoint_moves_between_offloaded_and_device_moments(runs, tmp_path):
    """Saved offloaded, read into a run without offload on another mesh, and back."""
    cfg, state = runs[True][0].cfg, runs[True][3]
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(async_save=False))
    checkpoints.save(STEPS, state, {}, config_lib.to_dict(cfg))
    checkpoints.close()
    expected = jax.device_get(state)
    for overrides, kinds in (([*ONE_STACK, mesh_arg(8, 1)], {"device"}), (RUN, {"device",
                                                                          "pinned_host"})):
        target = compose_config(*overrides, f"training.offload_optimizer={kinds != {'device'}}")
        setup = Setup.create(target)
        restored = checkpoint.restore(tmp_path, setup.state.with_shardings(),
                                      config_lib.to_dict(target)).state
        assert _memory_kinds(restored["opt_state"]) == kinds
        for got, want in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(got, want)


def test_a_device_without_host_memory_is_refused_by_name():
    device = types.SimpleNamespace(platform="tpu", addressable_memories=lambda: [
        types.SimpleNamespace(kind="device")])
    with pytest.raises(ConfigError, match="training.offload_optimizer=true needs pinned host"):
        setup_lib._check_host_memory([device])
