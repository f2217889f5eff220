"""`training.offload_optimizer`: Adam's moments in pinned host memory (this CPU backend has it
too), and `training.offload_params`: the parameters there too, each against the same run with
them on the device."""

import types
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import ONE_STACK, compiled_run, compose_config, mesh_arg, mesh_of
from tunix_train import checkpoint
from tunix_train import config as config_lib
from tunix_train.checkpoint import Checkpoints
from tunix_train.config import CheckpointConfig, ConfigError
from tunix_train.training import offload, optim
from tunix_train.training import setup as setup_lib
from tunix_train.training.offload import StreamedUpdate
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


# ---------------------------------------------------------------------------------------------
# training.offload_params: fp32 parameters (and LoRA's base) in host memory, each layer copied
# to the device when the layer loop reaches it, the update streamed a layer at a time.

PARAMS_OFF = ["training.offload_params=true", "training.offload_optimizer=true"]


@pytest.mark.parametrize("overrides", [
    [mesh_arg(1, 1)],
    [mesh_arg(4, 2), "training.gradient_accumulation_steps=2"],
    [mesh_arg(4, 2), "training.zero_stage=2"],
    [mesh_arg(4, 2), "training.zero_stage=1", "lora.rank=4", "lora.dropout=0.1"],
], ids=["1x1", "4x2-accum2", "4x2-zero2", "4x2-zero1-lora"])
def test_offloaded_parameters_give_the_losses_and_state_of_the_run_without(overrides):
    """Losses equal the run with everything on the device (fp32, 1e-6), and so does every array
    of the final state: the moments, LoRA's base and the counters within 1e-6 (the clip's
    global norm is summed in another order), the parameters within 1% of one Adam step at the peak learning rate. Adam's step
    m/√v is about lr whatever the gradient's size, so an entry whose gradient is mostly rounding
    (LoRA's A while B is still near zero) moves by a rounding-sensitive fraction of lr: 2.0e-6
    and 1.6e-6 against lr 3e-3 in one entry each of q_lora's and down_lora's A on an AMD EPYC
    VM (2026-12-02), under 2.4e-7 elsewhere; an update lost or applied twice moves a parameter
    by about lr. Between steps the parameters, the moments and LoRA's base are in pinned host
    memory, the step counters on the device; evaluation reads them from there."""
    devices = jax.devices()[:1] if overrides[0] == mesh_arg(1, 1) else None
    base = [*ONE_STACK, *overrides]
    on_device, _, want, reference = compiled_run(compose_config(*base), STEPS, devices)
    setup, costs, got, state = compiled_run(compose_config(*base, *PARAMS_OFF), STEPS, devices)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    lr = on_device.cfg.optimizer.lr
    assert state.keys() == reference.keys()
    for part in state:
        atol = lr / 100 if part == "params" else 1e-6
        for a, b in zip(jax.tree.leaves(state[part]), jax.tree.leaves(reference[part]),
                        strict=True):
            np.testing.assert_allclose(jax.device_get(a), jax.device_get(b), rtol=1e-5,
                                       atol=atol, err_msg=part)
    assert _memory_kinds(state["params"]) == {"pinned_host"}
    assert _memory_kinds(state.get("frozen", {})) <= {"pinned_host"}
    assert _memory_kinds(state["opt_state"].inner_state[1][0].mu) == {"pinned_host"}
    assert _memory_kinds(state["step"]) == {"device"}
    host = costs.per_device_bytes["params_host"] + costs.per_device_bytes["optimizer_host"]
    assert costs.per_device_bytes["host"] == host > 0
    batches = setup.open_data().eval_batches  # evaluated a layer at a time from host memory
    assert setup.evaluator(batches)(state) == pytest.approx(
        on_device.evaluator(batches)(reference), rel=1e-6)


def test_the_streamed_update_is_optaxs_update_in_one_piece():
    """Two stacks of other lengths and a leaf that is not a stack, updated a layer at a time,
    against the optimizer's own update of the whole tree: with the clip by global norm
    triggered, and with one layer's gradient not finite (every leaf skipped, counted once)."""
    cfg = compose_config("optimizer.grad_clip=0.5").optimizer
    whole, pieces = optim.adamw(cfg, 10), optim.adamw(cfg, 10, clipped_outside=True)
    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.normal(size=(3, 4, 2)), jnp.float32),
              "b": {"scale": jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)},
              "embed": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)}
    stacked = {"a": True, "b": {"scale": True}, "embed": False}
    streamed = StreamedUpdate(pieces, cfg.grad_clip, stacked)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    homes = {"params": jax.tree.map(lambda _: device, params), "opt_state": jax.tree.map(
        lambda _: device, whole.init(params))}
    state_whole = state_pieces = whole.init(params)
    p_whole = p_pieces = params

    @jax.jit  # one program each, as in the train step, not op by op
    def update_whole(grads, state, params):
        updates, state = whole.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    streamed_step = jax.jit(lambda *args: streamed(*args, homes))

    for step in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        if step == 1:
            grads["a"] = grads["a"].at[2, 0, 0].set(jnp.nan)
        p_whole, state_whole = update_whole(grads, state_whole, p_whole)
        sums = jax.tree.map(lambda g: 4 * g, grads)  # and the step's denominator, 4 tokens
        p_pieces, state_pieces, norm = streamed_step(sums, jnp.float32(4), state_pieces,
                                                     p_pieces)
        if step != 1:
            assert float(norm) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-6)
        for a, b in zip(jax.tree.leaves((p_pieces, state_pieces)),
                        jax.tree.leaves((p_whole, state_whole)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    assert int(optim.skipped_updates(state_pieces)) == 1
    assert float(optax.tree.norm(grads)) > cfg.grad_clip  # the clip did act


def test_offload_params_is_refused_by_name_where_it_cannot_run():
    for overrides, key in (([mesh_of([[2, 2, 2], ["pp", "fsdp", "tp"]])], "pp=2"),
                           (["trainer=dpo", "data=preferences", "data.path=x.jsonl"],
                            "trainer=dpo")):
        with pytest.raises(ConfigError, match=f"training.offload_params=true .*{key}"):
            offload.check_supported(compose_config(
                *ONE_STACK, *overrides, "training.offload_params=true"),
                2 if key == "pp=2" else 1)
